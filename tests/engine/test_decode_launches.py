"""What a decode token launches, counted in the simulator: at one token each launch is latency, not bandwidth."""
import pytest
from engine_setup import SIMULATOR_TINY, engine_config
from gguf import GGMLQuantizationType as QType
from launch_recorder import recording_launches
from numba import config as numba_config

from strata.engine.decode import step as step_module
from strata.engine.facade import Engine
from strata.errors import AllocationError
from strata.model.synth import write_synthetic_model

pytestmark = pytest.mark.skipif(not numba_config.ENABLE_CUDASIM, reason="counts the simulator's launches")


def test_a_resident_token_routes_each_layer_in_one_launch(tmp_path, monkeypatch):
    path = write_synthetic_model(tmp_path / "tiny.gguf", SIMULATOR_TINY, QType.Q4_0, seed=3)
    engine = Engine.load(engine_config(path, runtime={"backend": "cudasim", "vram_budget": "64MiB",
                                                      "warmup": False}), show_progress=False)
    with recording_launches(monkeypatch) as recorder:
        engine.runner.decode_step.compile_resident(5, 3)  # a whole resident token's launches, uncaptured
    counts, num_layers = recorder.counts, engine.spec.num_layers
    # the norm, the router's product, the routing and the slot map are one launch a layer
    assert counts["decode_route_kernel"] == num_layers
    assert not {"rms_norm_kernel", "route_block_kernel", "map_ids_kernel"} & set(counts), counts
    assert counts["gate_up_kernel"] == counts["down_kernel"] == num_layers


def test_a_token_whose_capture_fails_midway_keeps_none_of_its_parts(tmp_path, monkeypatch):
    # the parts captured before the failure are closed, so the next step captures the whole token again
    # instead of replaying the first layers alone
    path = write_synthetic_model(tmp_path / "tiny.gguf", SIMULATOR_TINY, QType.Q4_0, seed=3)
    engine = Engine.load(engine_config(path, runtime={"backend": "cudasim", "vram_budget": "64MiB",
                                                      "warmup": False}), show_progress=False)
    monkeypatch.setattr(step_module, "TOKEN_PART_LAYERS", 1)
    step, captured, closed, failing = engine.runner.decode_step, [], [], [2]  # the second capture fails, once

    class Part:
        def close(self):
            closed.append(self)

    def capture(fn, owner):
        captured.append(fn)
        if len(captured) in failing:
            failing.clear()
            raise AllocationError("decode_graphs: the driver could not allocate 1.0 MiB")
        return Part()

    monkeypatch.setattr(step, "_capture", capture)
    with pytest.raises(AllocationError):
        step._token_segments()
    assert len(closed) == 1 and step._token_parts == []
    captured.clear()
    assert len(step._token_segments()) == engine.spec.num_layers == 2  # all of them, captured again
