"""Weights or activations that are NaN or infinite: refused at load naming the tensor, or failing the
request at its first non-finite logits, never an empty success."""

import numpy as np
import pytest
from corrupt import corrupt_copy
from engine_setup import engine_config, greedy, write_small_moe

from strata.cli import main
from strata.engine.facade import Engine
from strata.errors import NonFiniteLogitsError, NonFiniteWeightError

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 500, size=40)]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_small_moe(tmp_path_factory.mktemp("models") / "small-moe.gguf")


@pytest.mark.parametrize("tensor_name", ["blk.1.attn_k.weight", "output_norm.weight", "token_embd.weight",
                                         "blk.2.ffn_down_exps.weight"])
def test_a_model_with_a_non_finite_weight_is_refused_at_load_naming_the_tensor(moe_path, tmp_path, tensor_name):
    corrupt = corrupt_copy(moe_path, tmp_path / "corrupt.gguf", tensor_name, block=7)
    with pytest.raises(NonFiniteWeightError, match=f"tensor {tensor_name} .*holds NaN or infinity") as caught:
        Engine.load(engine_config(corrupt), show_progress=False)
    assert caught.value.tensor_name == tensor_name


def test_strata_pack_refuses_a_model_with_a_non_finite_expert(moe_path, tmp_path, capsys):
    corrupt = corrupt_copy(moe_path, tmp_path / "corrupt.gguf", "blk.0.ffn_up_exps.weight", block=3)
    config = tmp_path / "pack.toml"
    config.write_text(f'[model]\npath = "{corrupt}"\n[runtime]\nbackend = "numpy"\n')
    assert main(["--config", str(config), "pack"]) == 2
    assert "tensor blk.0.ffn_up_exps.weight (Q4_0) holds NaN or infinity" in capsys.readouterr().err
    assert not corrupt.with_suffix(".strpack").exists()


def test_strata_generate_on_a_corrupt_model_fails_naming_the_tensor(moe_path, tmp_path, capsys):
    corrupt = corrupt_copy(moe_path, tmp_path / "corrupt.gguf", "output.weight", block=0, value=np.inf)
    config = tmp_path / "generate.toml"
    config.write_text(f'[model]\npath = "{corrupt}"\n[runtime]\nbackend = "numpy"\n')
    assert main(["--config", str(config), "generate", "--prompt", "hello", "--max-tokens", "4"]) == 2
    assert "tensor output.weight (Q4_0) holds NaN or infinity" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, on the infinite activations
def test_non_finite_activations_fail_the_request_at_its_first_logits_and_the_engine_serves_on(moe_path):
    engine = Engine.load(engine_config(moe_path), show_progress=False)
    expected, _ = greedy(engine, PROMPT, 4)
    norm = engine.weights.vectors["output_norm"]
    saved = norm.copy()
    norm[3] = np.inf  # the hidden state is finite, the logits are not: as an overflow would make them
    engine.kv_tokens = []
    with pytest.raises(NonFiniteLogitsError, match=r"position 40 \(a request of 40 prompt tokens\) are NaN or "
                                                   "infinite"):
        greedy(engine, PROMPT, 4)
    assert engine.counters.num_failed_requests == 1
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)
    norm[:] = saved
    assert greedy(engine, PROMPT, 4)[0] == expected


def test_non_finite_logits_in_decode_end_the_request_with_the_error_not_a_stop(moe_path, monkeypatch):
    engine = Engine.load(engine_config(moe_path), show_progress=False)
    real_logits = engine.output_logits
    calls = []

    def nan_from_the_third(hidden):
        calls.append(1)
        logits = real_logits(hidden)
        return np.full_like(logits, np.nan) if len(calls) >= 3 else logits

    monkeypatch.setattr(engine, "output_logits", nan_from_the_third)
    from strata.engine.sampling import SamplingParams

    generation = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    tokens = []
    with pytest.raises(NonFiniteLogitsError, match="position 42"):
        for event in generation:
            tokens.append(event.token_id)
    assert len(tokens) == 2  # the tokens before the non-finite logits, then the error
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)
