"""Small reads from the device for the decode loop, through pinned memory and events.

The greedy decode loop picks each token on the device (``CudaOps.greedy_token``) and feeds it to
the next step there, so the host only needs the id to stream the text and to decide whether to
stop. ``queue`` enqueues a 4-byte copy into pinned memory behind everything enqueued so far and
records an event after it; ``read`` waits for that event alone, not for the step queued since.

Two pinned slots alternate, so a copy never targets the slot the host is about to read. A slot is
queued again two ``queue`` calls later: the caller reads a ticket before it queues the second one
after it (the decode loop holds at most two tickets, the step it reads and the step running ahead).

``queue_record`` and ``read_record`` do the same for a few int32s at once (a verify step's acceptance
and picks), in two slots of their own that alternate as the tokens' do.

``now`` reads a few small arrays at once (a layer's routed and predicted expert ids): one queued
copy each into pinned memory and one event wait, instead of a synchronous pageable copy each.

Without a driver library (the simulator) ``queue`` copies synchronously and the ticket is the id,
and ``now`` copies each array.
"""

from __future__ import annotations

import numpy as np

from strata.gpu import driver_calls

_NUM_SLOTS = 2
_SCRATCH_OFFSET = 64
SCRATCH_BYTES = 4096  # what ``now`` reads at once
RECORD_BYTES = 64  # what ``queue_record`` reads at once
_RECORDS_OFFSET = _SCRATCH_OFFSET + SCRATCH_BYTES
PINNED_BYTES = _RECORDS_OFFSET + _NUM_SLOTS * RECORD_BYTES


class Readback:
    def __init__(self, pinned: np.ndarray | None, calls: driver_calls.DriverCalls | None):
        """pinned: ``PINNED_BYTES`` of page-locked memory (None: no driver library)."""
        self._calls = calls if pinned is not None else None
        self._slots = pinned[:4 * _NUM_SLOTS].view(np.int32) if pinned is not None else None  # [2]
        self._scratch = pinned[_SCRATCH_OFFSET:] if pinned is not None else None
        # the pinned block does not move: its addresses once, not a ``.ctypes`` object each copy
        self._slots_address = self._slots.ctypes.data if pinned is not None else 0
        self._scratch_address = self._scratch.ctypes.data if pinned is not None else 0
        self._records = pinned[_RECORDS_OFFSET:].view(np.int32).reshape(_NUM_SLOTS, -1) if pinned is not None else None
        self._record_addresses = [row.ctypes.data for row in self._records] if pinned is not None else []
        # one event per slot, one for ``now``, one per record slot
        self._events = [calls.event_create() for _ in range(2 * _NUM_SLOTS + 1)] if self._calls else []
        self._next = self._next_record = 0

    def queue(self, token) -> int:
        """A ticket for the current value of ``token`` ([1] int32 on the device)."""
        if self._calls is None:
            return int(token.copy_to_host()[0])
        slot, self._next = self._next, (self._next + 1) % _NUM_SLOTS
        destination = self._slots_address + 4 * slot
        self._calls.copy_out(destination, token.device_ctypes_pointer.value, 4, 0)
        self._calls.event_record(self._events[slot], 0)
        return slot

    def read(self, ticket: int) -> int:
        """The token id of ``ticket``, once its copy has landed."""
        if self._calls is None:
            return ticket
        self._calls.event_synchronize(self._events[ticket])
        return int(self._slots[ticket])

    def queue_record(self, array):
        """A ticket for the current values of ``array`` ([n] int32 on the device, ``RECORD_BYTES`` at most)."""
        if array.nbytes > RECORD_BYTES:
            raise ValueError(f"a record is at most {RECORD_BYTES} bytes, got {array.nbytes}")
        if self._calls is None:
            return array.copy_to_host()
        slot, self._next_record = self._next_record, (self._next_record + 1) % _NUM_SLOTS
        self._calls.copy_out(self._record_addresses[slot], array.device_ctypes_pointer.value, array.nbytes, 0)
        self._calls.event_record(self._events[_NUM_SLOTS + 1 + slot], 0)
        return slot, array.shape[0]

    def read_record(self, ticket) -> np.ndarray:
        """The values of ``ticket``'s array [n] int32, once its copy has landed."""
        if self._calls is None:
            return ticket
        slot, size = ticket
        self._calls.event_synchronize(self._events[_NUM_SLOTS + 1 + slot])
        return self._records[slot, :size].copy()

    def now(self, *arrays) -> list[np.ndarray]:
        """Host copies of small contiguous device arrays (``SCRATCH_BYTES`` in all), once the work
        enqueued before them has run; None stays None."""
        present = [a for a in arrays if a is not None]
        if not all(a.is_c_contiguous() for a in present) or sum(_padded(a.nbytes) for a in present) > SCRATCH_BYTES:
            raise ValueError(f"now() reads contiguous arrays of {SCRATCH_BYTES} bytes in all")
        if self._calls is None:
            return [a.copy_to_host() if a is not None else None for a in arrays]
        placed, offset = [], 0
        for array in arrays:
            if array is None:
                placed.append(None)
                continue
            self._calls.copy_out(self._scratch_address + offset, array.device_ctypes_pointer.value,
                                 array.nbytes, 0)
            placed.append((offset, array))
            offset += _padded(array.nbytes)
        self._calls.event_record(self._events[_NUM_SLOTS], 0)
        self._calls.event_synchronize(self._events[_NUM_SLOTS])
        return [None if p is None else _host_copy(self._scratch, *p) for p in placed]

    def close(self) -> None:
        for event in self._events:
            self._calls.event_destroy(event)
        self._events = []


def _padded(num_bytes: int) -> int:
    return -(-num_bytes // 16) * 16  # each array starts 16-byte aligned in the scratch


def _host_copy(scratch: np.ndarray, offset: int, array) -> np.ndarray:
    return scratch[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape).copy()
