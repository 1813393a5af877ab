"""Small synthetic models and configs for whole-engine tests on the numpy backend."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.config import parse_config
from strata.model.gguf_file import open_gguf
from strata.model.reference import KVCache, ReferenceModel
from strata.model.synth import PRESETS, write_synthetic_model

# 32 experts of 54 KiB in 3 layers: 96 experts (5.3 MiB) against a cache of a few 2 MiB segments,
# so prefill streams through the ring and decode evicts.
SMALL_MOE = dataclasses.replace(PRESETS["tiny"], num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2,
                                head_dim=32, num_experts=32, num_experts_used=4, expert_ffn_size=256,
                                vocab_size=512)

# The CUDA simulator runs every thread in Python, and the tiny preset's output head (512 rows, 32 blocks of
# gemv's 16) is most of a decode step there: the simulator's tiny model has the same layers and the least
# byte-level vocabulary (259) rounded to a half block (264: 16 full blocks and one of 8 rows).
SIMULATOR_TINY = dataclasses.replace(PRESETS["tiny"], vocab_size=264)


def write_small_moe(path, with_mtp: bool = False, qtype: QType = QType.Q4_0):
    return write_synthetic_model(path, SMALL_MOE, qtype, seed=7, with_mtp=with_mtp)


def engine_config(path, runtime=None, planner=None, loan=None, **sections):
    data = {
        "model": {"path": str(path)},
        "runtime": {"backend": "numpy", "vram_budget": "6MiB", "vmm_segment": "2MiB", "context_tokens": 1024,
                    **(runtime or {})},
        "planner": {"chunk_quantum_tokens": 16, "max_ring_slots": 16, **(planner or {})},
        **copy.deepcopy(sections),
    }
    if loan:
        data["loan"] = loan
    return parse_config(data)


LOAN_RUNTIME = {"serve": True, "vram_elastic": True, "vmm_segment": "64MiB", "mtp": True, "spec_depth": 2,
                "vram_budget": "160MiB"}


def reference_greedy(path, prompt: list[int], num_tokens: int, context: int = 1024) -> list[int]:
    model = open_gguf(path)
    ref = ReferenceModel.from_gguf(model)
    kv = KVCache.for_spec(model.spec, context)
    logits = ref.forward(np.array(prompt), 0, kv)[-1]
    out, position = [], len(prompt)
    for _ in range(num_tokens):
        token = int(np.argmax(logits))
        out.append(token)
        logits = ref.forward(np.array([token]), position, kv)[-1]
        position += 1
    return out


def greedy(engine, prompt: list[int], num_tokens: int):
    from strata.engine.sampling import SamplingParams

    generation = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=num_tokens))
    tokens = [event.token_id for event in generation if event.token_id >= 0]
    return tokens, generation.stats
