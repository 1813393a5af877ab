"""The VRAM ledger: every device byte the engine holds, charged to a named owner, under one budget.

The ledger is pure bookkeeping; the backends charge it for each allocation they make (the CUDA
backend from its memory manager, the numpy backend for host buffers standing in for VRAM), so
the same accounting holds on the GPU, in the simulator and on the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import threading
from types import MappingProxyType
from typing import Callable, Iterator, Mapping

from strata.errors import VramBudgetError

UNCHARGED_OWNER = "unattributed"
ACTIVATIONS_OWNER = "activations"  # temporaries of a computation in flight
DECODE_GRAPHS_OWNER = "decode_graphs"  # captured decode segments kept across requests, and their buffers
POOL_OWNER = "allocator_cache"  # freed blocks an allocator keeps for reuse (block_pool.py)
TRANSIENT_OWNERS = frozenset({ACTIVATIONS_OWNER, POOL_OWNER})  # not resident state: no loan restores them
# the ledger whose ``owner`` block is in effect: a memory manager serving several engines in one
# process (tests) charges the engine that is allocating
_ACTIVE_LEDGER: contextvars.ContextVar[VramLedger | None] = contextvars.ContextVar("strata_ledger", default=None)


def active_ledger() -> VramLedger | None:
    return _ACTIVE_LEDGER.get()


@dataclasses.dataclass(frozen=True)
class Charge:
    """One allocation: the receipt that ``discharge`` takes back."""

    charge_id: int
    owner: str
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class LedgerSnapshot:
    budget_bytes: int
    by_owner: Mapping[str, int]

    @property
    def used_bytes(self) -> int:
        return sum(self.by_owner.values())

    @property
    def free_bytes(self) -> int:
        """The unused budget and the blocks an allocator keeps only for reuse (reclaimable)."""
        return max(0, self.budget_bytes - self.used_bytes + self.by_owner.get(POOL_OWNER, 0))

    def diff(self, other: LedgerSnapshot) -> dict[str, int]:
        """Owners whose bytes differ, as ``other - self``."""
        owners = set(self.by_owner) | set(other.by_owner)
        deltas = {o: other.by_owner.get(o, 0) - self.by_owner.get(o, 0) for o in owners}
        return {o: d for o, d in sorted(deltas.items()) if d}


class VramLedger:
    """Thread-safe: device allocations may be made from any thread (a memory manager's callback).

    Totals are kept per owner as charges come and go, so a charge costs the same however many
    allocations are resident (a decode step makes hundreds).
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"a VRAM budget must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._charges: dict[int, Charge] = {}
        self._owner_bytes: dict[str, int] = {}
        self._used_bytes = 0
        self._ids = itertools.count(1)
        self._lock = threading.RLock()  # a finalizer may return a block from inside a locked section
        self._owner: contextvars.ContextVar[str] = contextvars.ContextVar("vram_owner", default=UNCHARGED_OWNER)
        self._reclaimers: list[Callable[[int], int]] = []

    def add_reclaimer(self, reclaim: Callable[[int], int]) -> None:
        """Register ``reclaim(num_bytes) -> bytes released``: memory held only for reuse (an
        allocator's cache) that a charge which does not fit may have back. It is called without the
        ledger's lock and releases by discharging its own charges."""
        self._reclaimers.append(reclaim)

    def charge(self, owner: str, num_bytes: int) -> Charge:
        """Record an allocation, or raise ``VramBudgetError`` naming owner, request and residents.

        When the charge does not fit, reclaimable memory is released first."""
        if num_bytes < 0:
            raise ValueError(f"{owner}: cannot charge {num_bytes} bytes")
        for reclaim in self._reclaimers:
            with self._lock:
                shortfall = num_bytes - (self.budget_bytes - self._used_bytes)
                if shortfall <= 0:
                    return self._add_locked(owner, num_bytes)
            reclaim(shortfall)
        with self._lock:
            free = self.budget_bytes - self._used_bytes
            if num_bytes > free:
                raise VramBudgetError(owner, num_bytes, max(0, free), self._by_owner_locked())
            return self._add_locked(owner, num_bytes)

    def discharge(self, charge: Charge) -> None:
        with self._lock:
            self._remove_locked(charge)

    def transfer(self, charge: Charge, owner: str, num_bytes: int | None = None) -> Charge:
        """An allocation handed on without being freed: ``charge`` replaced by one of ``owner`` for
        ``num_bytes`` (default: the same bytes). Raises ``VramBudgetError`` (and keeps ``charge``)
        when the new amount does not fit."""
        num_bytes = charge.num_bytes if num_bytes is None else num_bytes
        with self._lock:
            free = self.budget_bytes - self._used_bytes + charge.num_bytes
            if num_bytes > free:
                raise VramBudgetError(owner, num_bytes, max(0, free), self._by_owner_locked())
            self._remove_locked(charge)
            return self._add_locked(owner, num_bytes)

    def _add_locked(self, owner: str, num_bytes: int) -> Charge:
        charge = Charge(next(self._ids), owner, num_bytes)
        self._charges[charge.charge_id] = charge
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + num_bytes
        self._used_bytes += num_bytes
        return charge

    def _remove_locked(self, charge: Charge) -> None:
        if self._charges.pop(charge.charge_id, None) is None:
            raise ValueError(f"charge {charge.charge_id} of {charge.owner} was already discharged")
        self._owner_bytes[charge.owner] -= charge.num_bytes
        self._used_bytes -= charge.num_bytes

    def can_charge(self, num_bytes: int) -> bool:
        return num_bytes <= self.free_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    @property
    def free_bytes(self) -> int:
        """What a charge can get: the unused budget and the blocks an allocator keeps only for reuse
        (reclaimed when a charge needs them)."""
        with self._lock:
            reclaimable = self._owner_bytes.get(POOL_OWNER, 0)
            return max(0, self.budget_bytes - self._used_bytes + reclaimable)

    def live_charges(self, owner: str) -> list[Charge]:
        """The charges of ``owner`` not yet discharged, oldest first."""
        with self._lock:
            return [c for c in self._charges.values() if c.owner == owner]

    def owner_bytes(self, owner: str) -> int:
        return self.snapshot().by_owner.get(owner, 0)

    def snapshot(self) -> LedgerSnapshot:
        with self._lock:
            return LedgerSnapshot(self.budget_bytes, MappingProxyType(self._by_owner_locked()))

    @contextlib.contextmanager
    def owner(self, name: str) -> Iterator[None]:
        """Charge allocations made inside this block (by a memory manager) to ``name``."""
        token = self._owner.set(name)
        active = _ACTIVE_LEDGER.set(self)
        try:
            yield
        finally:
            _ACTIVE_LEDGER.reset(active)
            self._owner.reset(token)

    @property
    def current_owner(self) -> str:
        return self._owner.get()

    def _by_owner_locked(self) -> dict[str, int]:
        return {k: v for k, v in sorted(self._owner_bytes.items()) if v}

    def format(self) -> str:
        """A table of what is resident, by owner, in MiB and as a share of the budget."""
        snap = self.snapshot()
        rows = [f"  {'owner':<24}{'MiB':>12}{'share':>9}"]
        for owner, num_bytes in snap.by_owner.items():
            rows.append(f"  {owner:<24}{num_bytes / 2**20:>12.1f}{num_bytes / snap.budget_bytes:>9.1%}")
        rows.append(f"  {'free':<24}{snap.free_bytes / 2**20:>12.1f}{snap.free_bytes / snap.budget_bytes:>9.1%}")
        rows.append(f"  {'budget':<24}{snap.budget_bytes / 2**20:>12.1f}")
        return "\n".join(rows)
