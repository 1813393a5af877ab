"""Whole-model logits of the engine against the NumPy reference, per weight format.

``python -m strata.bench.logits_error [--tiny]``: for each weight format a small synthetic MoE
(head_dim 128, so prefill attention takes the tensor-core path on a GPU) is written to a
temporary directory and run through the engine on the configured kernels: a prompt prefilled in
several chunks with experts streaming through the ring, then a few greedy decode steps. Every
logits vector the engine produces is compared with the reference forward's over the same tokens:

    relative error = max |engine - reference| / max |reference|   (over the vocabulary)

The table reports the worst relative error over the prompt's last position and the decode
steps, and whether the greedy token agrees. The reference's KV cache rounds each row to the
configured format as the engine's does (``KVCache(kv_type=...)``), so the figures measure the
engine's own numerics: activations rounded to f16 for the tensor-core products, sums in float32
in another order, and a cache row quantized from inputs that differ by those roundings.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.config import parse_config
from strata.model.gguf_file import open_gguf
from strata.model.reference import KVCache, ReferenceModel
from strata.model.synth import PRESETS, write_synthetic_model

FORMATS = (QType.F32, QType.F16, QType.Q8_0, QType.Q6_K, QType.Q4_K, QType.Q4_1, QType.Q4_0)
SHAPE = dataclasses.replace(PRESETS["tiny"], num_layers=2, hidden_size=512, num_heads=8, num_kv_heads=2,
                            head_dim=128, num_experts=16, num_experts_used=4, expert_ffn_size=256, vocab_size=4096)
TINY_SHAPE = PRESETS["tiny"]  # for the simulator: the FFMA attention path, seconds per format


@dataclasses.dataclass(frozen=True)
class LogitsError:
    fmt: str
    num_vectors: int
    max_relative_error: float
    num_argmax_agree: int


def measure(path: Path, backend: str, num_prompt: int, num_decode: int, kv_type: str,
            vocab_size: int) -> tuple[float, int, int]:
    from strata.engine.facade import Engine
    from strata.engine.sampling import SamplingParams

    config = parse_config({
        "model": {"path": str(path)},
        "runtime": {"backend": backend, "vram_budget": "96MiB", "vmm_segment": "2MiB", "context_tokens": 2048,
                    "kv_type": kv_type, "warmup": False, "expert_preload": False},  # experts stream
        "planner": {"chunk_quantum_tokens": 16, "max_chunk_tokens": max(16, num_prompt // 3), "max_ring_slots": 8},
    })
    engine = Engine.load(config, show_progress=False)
    recorded = []
    compute_logits = engine.ops.logits

    def recording_logits(*args, **kwargs):
        recorded.append(np.array(compute_logits(*args, **kwargs), dtype=np.float64))
        return recorded[-1].astype(np.float32)

    engine.ops.logits = recording_logits
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, vocab_size, size=num_prompt)]
    tokens = [e.token_id for e in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=num_decode))
              if e.token_id >= 0]
    engine.close()
    model = open_gguf(path)
    reference = ReferenceModel.from_gguf(model)
    kv = KVCache.for_spec(model.spec, 2048, kv_type)  # the oracle reads the values the engine's cache holds
    expected = [reference.forward(np.array(prompt), 0, kv)[-1]]
    for position, token in enumerate(tokens[:-1], start=len(prompt)):
        expected.append(reference.forward(np.array([token]), position, kv)[-1])
    worst, agree = 0.0, 0
    for got, ref in zip(recorded, expected):
        worst = max(worst, float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
        agree += int(np.argmax(got) == np.argmax(ref))
    return worst, agree, min(len(recorded), len(expected))


def run_all(backend: str, num_prompt: int, num_decode: int, kv_type: str, formats=FORMATS,
            shape=SHAPE) -> list[LogitsError]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in formats:
            path = write_synthetic_model(Path(tmp) / f"{qtype.name}.gguf", shape, qtype, seed=21)
            worst, agree, count = measure(path, backend, num_prompt, num_decode, kv_type, shape.vocab_size)
            rows.append(LogitsError(qtype.name, count, worst, agree))
            print(f"{qtype.name}: {worst:.2e} ({agree}/{count} argmax)", flush=True)
    return rows


def format_table(rows: list[LogitsError], kv_type: str) -> str:
    lines = ["| weights | KV cache | logits vectors | max relative error | greedy token agrees |",
             "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r.fmt} | {kv_type} | {r.num_vectors} | {r.max_relative_error:.2e} | "
              f"{r.num_argmax_agree}/{r.num_vectors} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    from strata.backend.select import has_cuda_device

    parser = argparse.ArgumentParser(prog="python -m strata.bench.logits_error", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model, a short prompt and two formats "
                                                            "(for the simulator)")
    parser.add_argument("--kv-type", default="f16", choices=("f16", "q8_0", "q4_0"))
    parser.add_argument("--backend", choices=("cuda", "cudasim", "numpy"),
                        help="the engine's backend (default: cuda with a GPU, else cudasim)")
    args = parser.parse_args(argv)
    backend = args.backend or ("cuda" if has_cuda_device() else "cudasim")
    num_prompt, num_decode = (20, 2) if args.tiny else (200, 8)
    formats = (QType.Q8_0, QType.Q4_0) if args.tiny else FORMATS
    rows = run_all(backend, num_prompt, num_decode, args.kv_type, formats, TINY_SHAPE if args.tiny else SHAPE)
    print(f"# whole-model logits, {backend} backend vs the NumPy reference; prompt {num_prompt} tokens, "
          f"{num_decode} greedy steps")
    print(format_table(rows, args.kv_type))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
