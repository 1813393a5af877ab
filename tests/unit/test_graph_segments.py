"""The simulator's stand-in for a captured segment: nothing runs at capture, every replay runs the
function again, and the arrays returned the first time hold each replay's results."""

import numpy as np

from strata.gpu.graphs import RerunSegment


class FakeDeviceArray:
    def __init__(self, values):
        self.values = np.array(values, dtype=np.float32)

    def copy_to_device(self, other):
        self.values[...] = other.values


def test_a_rerun_segment_runs_on_replay_and_keeps_its_first_outputs():
    calls = []
    source = {"x": 1.0}

    def segment():
        calls.append(source["x"])
        return FakeDeviceArray([source["x"]]), FakeDeviceArray([2 * source["x"]])

    captured = RerunSegment(segment)
    assert calls == [] and captured.outputs is None
    captured.replay()
    first, second = captured.outputs
    assert calls == [1.0] and first.values[0] == 1.0 and second.values[0] == 2.0
    source["x"] = 5.0  # a refreshed input
    captured.replay()
    assert captured.outputs[0] is first and first.values[0] == 5.0 and second.values[0] == 10.0
    captured.close()
    assert captured.outputs is None
