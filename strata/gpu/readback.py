"""A decode token's id read back from the device while the kernels queued after it run.

The greedy decode loop picks each token on the device (``CudaOps.greedy_token``) and feeds it to
the next step there, so the host only needs the id to stream the text and to decide whether to
stop. ``queue`` enqueues a 4-byte copy into pinned memory behind everything enqueued so far and
records an event after it; ``read`` waits for that event alone, not for the step queued since.

Two pinned slots alternate, so a copy never targets the slot the host is about to read. A slot is
queued again two ``queue`` calls later: the caller reads a ticket before it queues the second one
after it (the decode loop holds at most two tickets, the step it reads and the step running ahead).

Without a driver library (the simulator) ``queue`` copies synchronously and the ticket is the id.
"""

from __future__ import annotations

import numpy as np

from strata.gpu import driver_calls

_NUM_SLOTS = 2


class TokenReadback:
    def __init__(self, pinned: np.ndarray | None, calls: driver_calls.DriverCalls | None):
        self._calls = calls if pinned is not None else None
        self._slots = pinned.view(np.int32)[:_NUM_SLOTS] if pinned is not None else None  # [2]
        self._events = [calls.event_create() for _ in range(_NUM_SLOTS)] if self._calls else []
        self._next = 0

    def queue(self, token) -> int:
        """A ticket for the current value of ``token`` ([1] int32 on the device)."""
        if self._calls is None:
            return int(token.copy_to_host()[0])
        slot, self._next = self._next, (self._next + 1) % _NUM_SLOTS
        destination = self._slots.ctypes.data + 4 * slot
        self._calls.copy_out(destination, token.device_ctypes_pointer.value, 4, 0)
        self._calls.event_record(self._events[slot], 0)
        return slot

    def read(self, ticket: int) -> int:
        """The token id of ``ticket``, once its copy has landed."""
        if self._calls is None:
            return ticket
        self._calls.event_synchronize(self._events[ticket])
        return int(self._slots[ticket])

    def close(self) -> None:
        for event in self._events:
            self._calls.event_destroy(event)
        self._events = []
