"""Strata's side of tools/peer-logits: the NumPy reference forward (the oracle) and the engine on numpy.

usage: python strata_dump.py MODEL.gguf PROMPT_FILE NUM_STEPS OUT_PREFIX
Writes OUT_PREFIX.json (prompt ids, greedy ids, the first step's top 10, the engine's ids) and
OUT_PREFIX.logits.f32 (the first step's logits), as dump.cpp does: the prompt in one batch with an f16
KV cache, then NUM_STEPS argmax steps a token at a time.
"""

import json
import sys

import numpy as np

from strata.config import parse_config
from strata.engine.facade import Engine
from strata.engine.sampling import SamplingParams
from strata.model.gguf_file import open_gguf
from strata.model.reference import KVCache, ReferenceModel
from strata.model.tokenizer import Tokenizer


def reference_run(path: str, prompt: str, num_steps: int) -> tuple[list[int], np.ndarray, list[int]]:
    """(prompt ids, the first step's logits [V], greedy ids) of the reference forward."""
    model = open_gguf(path)
    ids = Tokenizer.from_metadata(model.metadata).encode(prompt)  # the model's BOS rule, no special tokens
    reference = ReferenceModel.from_gguf(model)
    kv = KVCache.for_spec(model.spec, len(ids) + num_steps + 1, kv_type="f16")
    logits = reference.forward(np.asarray(ids, dtype=np.int64), 0, kv)[-1]
    first = np.asarray(logits, dtype=np.float32)
    generated = []
    for step in range(num_steps):
        generated.append(int(np.argmax(logits)))
        if step + 1 < num_steps:
            logits = reference.forward(np.array([generated[-1]]), len(ids) + step, kv)[0]
    return ids, first, generated


def engine_run(path: str, prompt: str, num_steps: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) of the engine on the numpy backend at temperature 0."""
    config = parse_config({"model": {"path": path},
                           "runtime": {"backend": "numpy", "context_tokens": max(256, 4 * len(prompt) + num_steps + 16)}})
    engine = Engine.load(config, show_progress=False)
    try:
        ids = engine.tokenizer.encode(prompt)
        events = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=num_steps))
        return ids, [event.token_id for event in events if event.token_id >= 0]
    finally:
        engine.close()


def main() -> None:
    path, prompt_file, num_steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with open(prompt_file, encoding="utf-8") as f:
        prompt = f.read()
    ids, first, generated = reference_run(path, prompt, num_steps)
    first.tofile(out + ".logits.f32")
    top = np.argsort(-first, kind="stable")[:10]
    engine_ids, engine_generated = engine_run(path, prompt, num_steps)
    result = {"prompt_ids": ids, "generated": generated, "top10": [[int(i), float(first[i])] for i in top],
              "engine_prompt_ids": engine_ids, "engine_generated": engine_generated}
    with open(out + ".json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
