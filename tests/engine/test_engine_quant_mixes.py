"""llama.cpp's preset mixes through the whole engine: the I-quant mix on the Numba kernels against the
NumPy reference, the Q4_K_M mix (its ffn_down_exps type changes between layers) through the expert cache
and pack, and the refusal, at load and in ``strata check``, of what a backend does not run."""

import dataclasses
import json

import numpy as np
import pytest
from engine_setup import SMALL_MOE, engine_config, greedy, reference_greedy
from gguf import GGMLQuantizationType as QType
from numba import config as numba_config

from strata.backend import formats
from strata.backend.layouts import align, packed_expert_layout
from strata.backend.select import has_cuda_device
from strata.cli import main
from strata.engine.facade import Engine
from strata.engine.memory.expert_pack import HEADER_BYTES
from strata.errors import ModelFormatError
from strata.model import quants
from strata.model.gguf_file import open_gguf
from strata.model.reference import KVCache, ReferenceModel
from strata.model.synth import SynthShape, write_synthetic_model

BACKEND = "cuda" if has_cuda_device() else "cudasim"
# rows of 256 keep the 256-element formats; 4 experts (not 8) and 2 heads a KV head keep the mix's own rules
MIX_SHAPE = SynthShape(num_layers=1, hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128, num_experts=4,
                       num_experts_used=2, expert_ffn_size=256, vocab_size=300, context_length=1024)


@pytest.mark.skipif(BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                    reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")
def test_an_iq3_xxs_mix_runs_on_the_kernels_as_the_reference(tmp_path):
    path = write_synthetic_model(tmp_path / "iq3_xxs.gguf", MIX_SHAPE, "IQ3_XXS", seed=2)
    kinds = {ref.qtype for ref in open_gguf(path).tensors.values()}
    assert {QType.IQ3_XXS, QType.IQ3_S, QType.IQ2_S, QType.Q5_K} <= kinds
    engine = Engine.load(engine_config(path, runtime={"backend": BACKEND, "vram_budget": "64MiB", "warmup": False,
                                                      "context_tokens": 256}), show_progress=False)
    # the simulator: a prompt of two (each of its rows costs seconds there), then a decode step
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 290, size=5 if BACKEND == "cuda" else 2)]
    tokens, _ = greedy(engine, prompt, 2)
    assert tokens == reference_greedy(path, prompt, 2, context=256)


def test_experts_whose_type_changes_between_layers_stream_through_the_cache_and_a_pack_as_the_reference(
        tmp_path, capsys):
    # llama.cpp's Q4_K_M gives the more-bits layers' ffn_down_exps Q6_K: here layer 2 of 3, the others Q4_K
    # (gate and up, rows of 128, Q4_K's fallback Q5_0)
    path = write_synthetic_model(tmp_path / "q4_k_m.gguf", SMALL_MOE, "Q4_K_M", seed=3)
    model = open_gguf(path)
    assert [model.tensors[f"blk.{i}.ffn_down_exps.weight"].qtype for i in range(3)] == [QType.Q4_K] * 2 + [QType.Q6_K]
    pack = tmp_path / "q4_k_m.strpack"
    config = tmp_path / "pack.toml"
    config.write_text(f'[model]\npath = "{path}"\nexpert_pack = "{pack}"\n[runtime]\nbackend = "numpy"\n'
                      'vram_budget = "6MiB"\nvmm_segment = "2MiB"\ncontext_tokens = 1024\n'
                      '[planner]\nchunk_quantum_tokens = 16\nmax_ring_slots = 16\n')
    assert main(["--config", str(config), "pack", "--out", str(pack)]) == 0
    assert main(["--config", str(config), "check"]) == 0
    header = json.loads(pack.read_bytes()[:HEADER_BYTES].rstrip(b"\0"))
    q5_0, q4_k, q6_k = int(QType.Q5_0), int(QType.Q4_K), int(QType.Q6_K)
    assert [qtypes for qtypes, _ in header["layers"]] == [[q5_0, q5_0, q4_k]] * 2 + [[q5_0, q5_0, q6_k]]
    capsys.readouterr()
    engine = Engine.load(engine_config(path, model={"path": str(path), "expert_pack": str(pack)}),
                         show_progress=False)
    assert engine.cache.layout.is_mixed
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 500, size=40)]
    tokens, stats = greedy(engine, prompt, 6)
    assert stats.streamed_bytes > 0 and engine.cache.num_evictions > 0  # through the ring, and decode evicts
    assert tokens == reference_greedy(path, prompt, 6)


@pytest.mark.skipif(BACKEND != "cuda", reason="a whole mixed model of 256-wide rows on the kernels: GPU only")
@pytest.mark.parametrize("preset", ["Q4_K_M", "Q5_K_M", "IQ4_XS"])
def test_a_mix_whose_expert_types_change_between_layers_runs_on_the_gpu_as_the_reference(tmp_path, preset):
    # 8 layers: IQ4_XS gives layer 0 (the first eighth) a Q5_K ffn_down_exps, Q4_K_M and Q5_K_M layers 0, 3, 6, 7 Q6_K
    shape = dataclasses.replace(MIX_SHAPE, num_layers=8)
    path = write_synthetic_model(tmp_path / f"{preset}.gguf", shape, preset, seed=5)
    model = open_gguf(path)
    downs = [model.tensors[f"blk.{i}.ffn_down_exps.weight"].qtype for i in range(8)]
    assert len(set(downs)) == 2 and downs[0] != downs[2]
    engine = Engine.load(engine_config(path, runtime={"backend": BACKEND, "vram_budget": "64MiB",
                                                      "context_tokens": 256}), show_progress=False)
    assert engine.cache.layout.is_mixed
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 290, size=24)]
    tokens, _ = greedy(engine, prompt, 4)
    assert tokens == reference_greedy(path, prompt, 4, context=256)


@pytest.mark.parametrize("backend, is_mtp", [
    ("numpy", False), ("numpy", True),
    pytest.param("cuda", True, marks=pytest.mark.skipif(BACKEND != "cuda", reason="the kernels' packed planes: GPU"))])
def test_the_mtp_blocks_wider_experts_widen_no_cache_slot_and_draft_as_the_reference(tmp_path, backend, is_mtp):
    # 2 main layers and the MTP block: Q4_K_M gives the last layer (the MTP block's) ffn_down_exps Q6_K, the
    # main layers' Q4_K
    shape = dataclasses.replace(SMALL_MOE, num_layers=2)
    path = write_synthetic_model(tmp_path / "q4_k_m-mtp.gguf", shape, "Q4_K_M", seed=3, with_mtp=True)
    model = open_gguf(path)
    assert [model.tensors[f"blk.{i}.ffn_down_exps.weight"].qtype for i in range(3)] == [QType.Q4_K] * 2 + [QType.Q6_K]
    runtime = {"backend": backend, "mtp": is_mtp, "spec_depth": int(is_mtp)}
    if backend == "cuda":
        runtime.update(vram_budget="64MiB", context_tokens=256)
    engine = Engine.load(engine_config(path, runtime=runtime), show_progress=False)
    layout = engine.cache.layout
    assert not layout.is_mixed and layout.matrix_qtypes[2] == (QType.Q4_K,)  # the main layers' types only
    down_bytes = {q: shape.hidden_size * quants.row_nbytes(q, shape.expert_ffn_size) for q in (QType.Q4_K, QType.Q6_K)}
    if backend == "numpy":
        assert layout.slot_bytes == layout.offsets[2] + align(down_bytes[QType.Q4_K])
    if not is_mtp:
        return
    experts = engine.resources["mtp_experts"]
    assert experts.layout.matrix_qtypes[2] == (QType.Q6_K,) and experts.layout.slot_bytes > layout.slot_bytes
    if backend == "numpy":
        assert experts.layout.slot_bytes == layout.offsets[2] + align(down_bytes[QType.Q6_K])
    assert engine.placement.mtp_expert_bytes == shape.num_experts * experts.layout.slot_bytes
    reference = ReferenceModel.from_gguf(model)
    tokens = np.arange(5, 17)
    kv = KVCache.for_spec(model.spec, 64)
    hidden = reference.forward_hidden(tokens, 0, kv)  # [12, D]
    expected = reference.mtp_hidden(hidden[:-1], tokens[1:], 0, kv)
    got = engine.ops.to_host(engine.mtp.hidden(engine.ops.upload("activations", hidden[:-1].astype(np.float32)),
                                               tokens[1:], 0))
    tolerance = 2e-3 if backend == "numpy" else 1e-2  # the kernels round activations to f16 on tensor cores
    assert np.max(np.abs(got - expected)) <= tolerance * np.max(np.abs(expected))


def test_check_plans_a_mixed_model_for_the_gpu_in_slots_of_its_largest_types(tmp_path, capsys):
    path = write_synthetic_model(tmp_path / "q4_k_m.gguf", SMALL_MOE, "Q4_K_M", seed=3)
    config = tmp_path / "check.toml"
    config.write_text(f'[model]\npath = "{path}"\n[runtime]\nbackend = "cuda"\nvram_budget = "64MiB"\n'
                      'vmm_segment = "2MiB"\ncontext_tokens = 1024\n')
    assert main(["--config", str(config), "check"]) == 0
    model = open_gguf(path)
    layout = packed_expert_layout(model)
    down = {layer: layout.at_layer(layer).sizes[2] for layer in range(3)}
    down_bytes = [model.tensors[f"blk.{i}.ffn_down_exps.weight"].nbytes // SMALL_MOE.num_experts for i in range(3)]
    # a block of 256 a row: quants as Q6_K's 192 bytes, scales as Q4_K's d and dmin, extra as Q6_K's 16 scales
    rows = SMALL_MOE.hidden_size
    assert down == {layer: rows * (192 + 4 + 16) for layer in range(3)}
    assert down_bytes == [rows * 144] * 2 + [rows * 210] and layout.offsets[2] + down[2] <= layout.slot_bytes


def test_a_type_the_backend_cannot_run_is_named_with_the_backends_that_can(tmp_path, monkeypatch):
    path = write_synthetic_model(tmp_path / "iq3_xxs.gguf", MIX_SHAPE, "IQ3_XXS", seed=2)
    every_type = formats.runnable_types

    def without_iq2_s_on_gpus(backend):
        return every_type(backend) - ({QType.IQ2_S} if backend != "numpy" else set())

    monkeypatch.setattr(formats, "runnable_types", without_iq2_s_on_gpus)
    with pytest.raises(ModelFormatError, match=r"the cuda backend cannot run blk\.0\.attn_k\.weight is IQ2_S "
                                               r"\(runs on numpy\); blk\.0\.attn_q\.weight is IQ2_S"):
        Engine.load(engine_config(path, runtime={"backend": "cuda"}), show_progress=False, is_dry_run=True)
    Engine.load(engine_config(path), show_progress=False, is_dry_run=True)  # numpy runs it
