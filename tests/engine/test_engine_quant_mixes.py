"""llama.cpp's preset mixes through the whole engine: the I-quant mix on the Numba kernels against the
NumPy reference, and the refusal, at load and in ``strata check``, of what no backend runs."""

import numpy as np
import pytest
from engine_setup import engine_config, greedy, reference_greedy
from gguf import GGMLQuantizationType as QType
from numba import config as numba_config

from strata.backend import formats
from strata.backend.select import has_cuda_device
from strata.cli import main
from strata.engine.facade import Engine
from strata.errors import ModelFormatError
from strata.model.gguf_file import open_gguf
from strata.model.synth import PRESETS, SynthShape, write_synthetic_model

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
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 290, size=5)]
    tokens, _ = greedy(engine, prompt, 2)
    assert tokens == reference_greedy(path, prompt, 2, context=256)


def test_experts_whose_type_changes_between_layers_are_refused_at_load_and_in_check(tmp_path, capsys):
    path = write_synthetic_model(tmp_path / "q4_k_m.gguf", PRESETS["tiny"], "Q4_K_M", seed=1)  # 2 layers
    fix = r"blk\.1\.ffn_down_exps\.weight is Q8_0, blk\.0's Q5_0: no backend runs.*--tensor-type"
    with pytest.raises(ModelFormatError, match=fix):
        Engine.load(engine_config(path), show_progress=False)
    config = tmp_path / "check.toml"
    config.write_text(f'[model]\npath = "{path}"\n[runtime]\nbackend = "cuda"\nvram_budget = "64MiB"\n')
    assert main(["--config", str(config), "check"]) == 2
    assert "blk.1.ffn_down_exps.weight is Q8_0" in capsys.readouterr().err


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
