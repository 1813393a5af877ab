"""``runtime.copy_overlap`` on the CUDA backend: with it off, what is issued after a staging waits
for its copies; with it on, nothing waits until ``wait_staged``. The copy stream is a recording fake
(the simulator has none), so the decision is checked on any machine."""

import pytest
from numba import config as numba_config

from strata.backend.select import has_cuda_device, make_ops
from strata.gpu.ledger import VramLedger

BACKEND = "cuda" if has_cuda_device() else "cudasim"
pytestmark = pytest.mark.skipif(BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                                reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")


class RecordingCopyStream:
    def __init__(self):
        self.calls = []

    def stage(self, storage, slots, hosts, is_after_compute):
        self.calls.append(("stage", tuple(slots), is_after_compute))
        return f"ticket{len(self.calls)}"

    def wait(self, ticket):
        self.calls.append(("wait", ticket))


@pytest.mark.parametrize("is_copy_overlapped", [True, False])
def test_staging_waits_at_once_only_without_copy_overlap(is_copy_overlapped):
    ops = make_ops(BACKEND, VramLedger(1 << 30))
    ops._copy_stream = copies = RecordingCopyStream()
    ops.is_copy_overlapped = is_copy_overlapped
    ticket = ops.stage_experts(storage=None, slots=[3, 5], hosts=[b"a", b"b"], is_after_compute=False)
    expected = [("stage", (3, 5), False)] + ([] if is_copy_overlapped else [("wait", "ticket1")])
    assert ticket == "ticket1" and copies.calls == expected
    ops.wait_staged(ticket)
    assert copies.calls[-1] == ("wait", "ticket1")
