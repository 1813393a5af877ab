"""The architectures beside qwen3moe through the whole engine: a Mixtral-style llama MoE model (normal RoPE,
no q/k norm, top-2 of 8 experts) on numpy while prefill streams and decode evicts and from its expert pack,
and a dense qwen3 one; both on the Numba kernels (the simulator in CI, the GPU where there is one)."""

import dataclasses

import numpy as np
import pytest
from engine_setup import SIMULATOR_TINY, SMALL_MOE, engine_config, greedy, reference_greedy
from gguf import GGMLQuantizationType as QType
from numba import config as numba_config

from strata.backend.select import has_cuda_device
from strata.engine.facade import Engine
from strata.model.gguf_file import open_gguf
from strata.model.synth import PRESETS, write_synthetic_model

# 32 experts of 442 KiB (14 MiB) in 4 layers
SMALL_LLAMA_MOE = dataclasses.replace(SMALL_MOE, num_layers=4, hidden_size=256, num_experts=8, num_experts_used=2,
                                      expert_ffn_size=1024, arch="llama")
PROMPT = [int(t) for t in np.random.default_rng(11).integers(3, 500, size=90)]
GPU_BACKEND = "cuda" if has_cuda_device() else "cudasim"


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("models") / "small-llama-moe.gguf", SMALL_LLAMA_MOE,
                                 QType.Q4_0, seed=5)


@pytest.fixture(scope="module")
def expected(llama_path):
    return reference_greedy(llama_path, PROMPT, 12)


def test_the_file_is_a_llama_moe_model(llama_path):
    spec = open_gguf(llama_path).spec
    assert (spec.arch, spec.num_experts, spec.num_experts_used, spec.expert_ffn_size) == ("llama", 8, 2, 1024)
    assert not spec.is_rope_neox and not spec.has_qk_norm and spec.is_expert_weights_normalized


def test_greedy_output_equals_the_reference_while_streaming_and_evicting(llama_path, expected):
    # the cache holds a few of the 32 experts: prefill streams through the ring and decode evicts
    engine = Engine.load(engine_config(llama_path, runtime={"vram_budget": "10MiB"}, planner={"max_chunk_tokens": 32}),
                         show_progress=False)
    assert 0 < engine.cache.num_slots < 32
    tokens, stats = greedy(engine, PROMPT, 12)
    assert tokens == expected
    assert stats.num_chunks == 3 and stats.streamed_bytes > 0 and stats.cache_misses > 0
    assert engine.cache.num_evictions > 0
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)


def test_the_expert_pack_keeps_the_output(llama_path, expected, tmp_path):
    from strata.backend.layouts import expert_layout
    from strata.engine.memory.expert_pack import ExpertPack

    model = open_gguf(llama_path)
    pack_path = tmp_path / "small-llama-moe.strpack"
    ExpertPack.from_gguf(model, expert_layout(model), lambda n: np.empty(n, np.uint8)).write(pack_path, model)
    engine = Engine.load(engine_config(llama_path, model={"path": str(llama_path), "expert_pack": str(pack_path)},
                                       runtime={"vram_budget": "10MiB"}, planner={"max_chunk_tokens": 32}),
                         show_progress=False)
    assert greedy(engine, PROMPT, 12)[0] == expected


def test_a_dense_qwen3_model_gives_the_reference_output(tmp_path):
    path = write_synthetic_model(tmp_path / "qwen3.gguf", dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=3),
                                 QType.Q4_K, seed=8)
    spec = open_gguf(path).spec
    assert (spec.arch, spec.is_moe, spec.is_rope_neox, spec.has_qk_norm) == ("qwen3", False, True, True)
    prompt = [t % 500 for t in PROMPT]
    engine = Engine.load(engine_config(path, planner={"max_chunk_tokens": 32}), show_progress=False)
    tokens, stats = greedy(engine, prompt, 12)
    assert tokens == reference_greedy(path, prompt, 12) and stats.num_chunks == 3
    assert engine.cache is None  # no experts: nothing to cache or stream


@pytest.mark.skipif(GPU_BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                    reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")
@pytest.mark.parametrize("arch", ["llama-moe", "qwen3-dense"])
def test_greedy_output_on_the_kernels_equals_the_reference_in_two_chunks(tmp_path, arch):
    # the simulator runs each thread in Python: its tiny model, a 20-token prompt and 2 tokens
    if arch == "llama-moe":
        shape = dataclasses.replace(SIMULATOR_TINY, arch="llama") if GPU_BACKEND == "cudasim" else SMALL_LLAMA_MOE
    else:
        shape = PRESETS["tiny-qwen3"]
        if GPU_BACKEND == "cudasim":
            shape = dataclasses.replace(shape, vocab_size=SIMULATOR_TINY.vocab_size)
    path = write_synthetic_model(tmp_path / f"{arch}.gguf", shape, QType.Q4_0, seed=6)
    prompt, num_generated = ([t % 250 for t in PROMPT[:20]], 2) if GPU_BACKEND == "cudasim" else (PROMPT, 12)
    runtime = {"backend": GPU_BACKEND, "vram_budget": "64MiB", "warmup": False}
    engine = Engine.load(engine_config(path, runtime=runtime, planner={"max_chunk_tokens": 16}), show_progress=False)
    tokens, stats = greedy(engine, prompt, num_generated)
    assert stats.num_chunks == -(-len(prompt) // 16) > 1
    expected = reference_greedy(path, prompt, num_generated)
    ends = [i for i, token in enumerate(expected) if engine.tokenizer.is_eog(token)]
    assert tokens == expected[:ends[0] if ends else None]  # generation ends at an end-of-generation token
