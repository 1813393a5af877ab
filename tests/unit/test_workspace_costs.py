"""What a prompt token of a chunk costs the planner, as the runtime options change it."""

from strata.config import parse_config
from strata.engine.planning.placement import workspace_costs
from strata.model.synth import PRESETS


def _costs(runtime: dict):
    config = parse_config({"model": {"path": "model.gguf"}, "runtime": runtime})
    spec = PRESETS["qwen3-30b-a3b"].spec()
    return workspace_costs(spec, None, config), spec


def test_deterministic_sums_cost_a_second_accumulator_word_an_element():  # the cuda backend's int64 sums
    plain, spec = _costs({"deterministic": False})
    deterministic, _ = _costs({})  # on by default
    # the MoE accumulator [D] as int64 fixed-point sums: 8 bytes an element instead of 4
    assert deterministic.bytes_per_chunk_token - plain.bytes_per_chunk_token == 4 * spec.hidden_size


def test_numpy_sums_in_float64_and_reserves_nothing_more():
    plain, _ = _costs({"backend": "numpy", "deterministic": False})
    deterministic, _ = _costs({"backend": "numpy", "deterministic": True})
    assert deterministic.bytes_per_chunk_token == plain.bytes_per_chunk_token
