"""Readback's queued copies land in its pinned block: slot s of ``queue``, the scratch of ``now``, the records."""

import numpy as np
import pytest

from strata.gpu.readback import PINNED_BYTES, RECORD_BYTES, SCRATCH_BYTES, Readback


class RecordingCalls:
    def __init__(self):
        self.copies: list[tuple[int, int, int]] = []  # (host destination, device source, bytes)
        self.num_events = 0
        self.recorded: list[int] = []  # events recorded, in order
        self.waited: list[int] = []  # events waited for

    def event_create(self) -> int:
        self.num_events += 1
        return self.num_events

    def copy_out(self, destination, source, num_bytes, stream) -> None:
        self.copies.append((destination, source, num_bytes))

    def event_record(self, event, stream) -> None:
        self.recorded.append(event)

    def event_synchronize(self, event) -> None:
        self.waited.append(event)


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


def test_records_alternate_two_slots_of_their_own_after_the_scratch():
    pinned = np.zeros(PINNED_BYTES, dtype=np.uint8)
    calls = RecordingCalls()
    readback = Readback(pinned, calls)
    base = pinned.ctypes.data
    tickets = [readback.queue_record(DeviceStandIn(1000, 12)) for _ in range(3)]
    records = base + 64 + SCRATCH_BYTES
    assert [c[0] for c in calls.copies] == [records, records + RECORD_BYTES, records]
    assert all(c[2] == 12 for c in calls.copies)
    pinned[64 + SCRATCH_BYTES:64 + SCRATCH_BYTES + 12] = np.array([2, 7, 9], np.int32).view(np.uint8)
    assert readback.read_record(tickets[2]).tolist() == [2, 7, 9]
    record_events = calls.recorded[:3]  # one a queued record
    assert record_events[0] == record_events[2] != record_events[1]  # each slot its own, in turn
    assert calls.waited == [record_events[2]]  # the read waited for its own copy alone
    readback.queue(DeviceStandIn(1000, 4))
    readback.queue(DeviceStandIn(1000, 4))
    readback.now(DeviceStandIn(2000, 8))
    assert len(set(calls.recorded[3:])) == 3 and not set(calls.recorded[3:]) & set(record_events)
    with pytest.raises(ValueError, match="at most 64 bytes"):
        readback.queue_record(DeviceStandIn(1000, RECORD_BYTES + 4))
