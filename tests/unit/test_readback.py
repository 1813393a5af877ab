"""Readback's queued copies land in its pinned block: slot s of ``queue`` and the scratch of ``now``."""

import numpy as np

from strata.gpu.readback import PINNED_BYTES, Readback


class RecordingCalls:
    def __init__(self):
        self.copies: list[tuple[int, int, int]] = []  # (host destination, device source, bytes)
        self.num_events = 0

    def event_create(self) -> int:
        self.num_events += 1
        return self.num_events

    def copy_out(self, destination, source, num_bytes, stream) -> None:
        self.copies.append((destination, source, num_bytes))

    def event_record(self, event, stream) -> None:
        pass

    def event_synchronize(self, event) -> None:
        pass


class DeviceStandIn:
    """A device array as the readback reads it: its pointer, size and contiguity."""

    def __init__(self, address: int, num_bytes: int):
        self.device_ctypes_pointer = type("Pointer", (), {"value": address})()
        self.nbytes, self.dtype, self.shape = num_bytes, np.dtype(np.int32), (num_bytes // 4,)

    def is_c_contiguous(self) -> bool:
        return True


def test_queued_and_immediate_copies_target_the_pinned_block():
    pinned = np.zeros(PINNED_BYTES, dtype=np.uint8)
    calls = RecordingCalls()
    readback = Readback(pinned, calls)
    base = pinned.ctypes.data
    assert [readback.queue(DeviceStandIn(1000, 4)) for _ in range(3)] == [0, 1, 0]  # two slots, in turn
    assert [c[0] for c in calls.copies] == [base, base + 4, base]
    calls.copies.clear()
    readback.now(DeviceStandIn(2000, 24), None, DeviceStandIn(3000, 8))
    # the scratch starts 64 bytes in; each array 16-byte aligned after the one before
    assert calls.copies == [(base + 64, 2000, 24), (base + 64 + 32, 3000, 8)]
