"""Freed device blocks kept for reuse, charged to the ledger as ``allocator_cache``.

A decode step allocates hundreds of small temporaries and a prefill chunk dozens of large ones,
each the same size as in the step before. ``cuMemAlloc`` costs host time and ``cuMemFree`` may
synchronize the device, which stalls the host's launches behind the GPU. The memory manager hands
a freed block to the pool instead, and the next allocation of the same rounded size takes it back.

Reuse is safe because every kernel and every allocation-backed copy runs on the same (legacy
default) stream: a block freed while a kernel still reads it is only written by work queued after
that kernel. Expert copies run on their own stream, but into the expert arena and the prefill
workspace, which are freed only after a synchronize.

A block is charged as the size asked for, not its size class (the driver rounds as well; the
ledger agrees with the device within that). Every pooled block stays in the ledger, charged to
``allocator_cache``: the ledger reclaims the
pool when a charge does not fit, and the engine trims it after each request so the ledger goes
back to its idle state.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from strata.errors import VramBudgetError
from strata.gpu.ledger import POOL_OWNER, Charge, VramLedger

_ROUND_BYTES = 512  # the driver's own allocation granularity for small blocks


def rounded_bytes(num_bytes: int) -> int:
    """The size class of a request: sizes that round alike share blocks."""
    return max(_ROUND_BYTES, -(-num_bytes // _ROUND_BYTES) * _ROUND_BYTES)


class BlockPool:
    """Free blocks by size class; ``free_block(pointer)`` returns one to the driver.

    The pool lives as long as its ledger (the ledger holds it as a reclaimer; it holds the ledger
    weakly): when the ledger goes, the pooled blocks go back to the driver, and so does every block
    of that ledger freed later."""

    def __init__(self, ledger: VramLedger, free_block: Callable[[object], None]):
        self._ledger = weakref.ref(ledger)
        self._free_block = free_block
        self._blocks: dict[int, list[tuple[object, Charge]]] = {}  # size class → [(pointer, charge)]
        self._lock = threading.RLock()  # a finalizer may return a block from inside a locked section
        self.num_bytes = 0
        ledger.add_reclaimer(self.reclaim)
        weakref.finalize(ledger, self.reclaim).atexit = False  # at exit the driver frees everything

    @property
    def ledger(self) -> VramLedger | None:
        return self._ledger()

    def take(self, size_class: int, owner: str, num_bytes: int) -> tuple[object, Charge] | None:
        """A pooled block of ``size_class`` bytes, now charged to ``owner`` as ``num_bytes`` (what was
        asked for, as without the pool); None when there is none, or when the difference does not fit."""
        with self._lock:
            blocks = self._blocks.get(size_class)
            if blocks is None:
                return None
            pointer, charge = blocks.pop()
            if not blocks:
                del self._blocks[size_class]  # no empty lists: reclaim picks among the keys
            self.num_bytes -= charge.num_bytes
        try:
            return pointer, self.ledger.transfer(charge, owner, num_bytes)
        except VramBudgetError:
            self._free_block(pointer)
            self.ledger.discharge(charge)
            return None

    def put(self, size_class: int, pointer, charge: Charge) -> None:
        """Keep a freed block; its charge moves to the pool."""
        ledger = self.ledger
        if ledger is None:  # its engine is gone
            self._free_block(pointer)
            return
        pooled = ledger.transfer(charge, POOL_OWNER)
        with self._lock:
            self._blocks.setdefault(size_class, []).append((pointer, pooled))
            self.num_bytes += pooled.num_bytes

    def reclaim(self, num_bytes: int | None = None) -> int:
        """Free pooled blocks back to the driver, largest first, until ``num_bytes`` are released
        (all of them when None). Returns the bytes released, as the ledger counts them."""
        released = 0
        while num_bytes is None or released < num_bytes:
            with self._lock:
                if not self._blocks:
                    break
                size_class = max(self._blocks)
                blocks = self._blocks[size_class]
                pointer, charge = blocks.pop()
                if not blocks:
                    del self._blocks[size_class]
                self.num_bytes -= charge.num_bytes
            self._free_block(pointer)
            ledger = self.ledger
            if ledger is not None:
                ledger.discharge(charge)
            released += charge.num_bytes
        return released
