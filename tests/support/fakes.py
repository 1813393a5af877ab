"""Fakes with the engine's shapes that record every call, for hook-level tests without a GPU."""

from __future__ import annotations

from strata.gpu.ledger import VramLedger
from strata.hooktypes import Geometry

MIB = 1 << 20


class Faults:
    """Raise once (or always) at named points: ``faults.arm("restore:output_head", times=1)``."""

    def __init__(self):
        self._armed: dict[str, int] = {}
        self._errors: dict[str, type[Exception]] = {}

    def arm(self, point: str, times: int = 1, error: type[Exception] = RuntimeError) -> None:
        self._armed[point] = times
        self._errors[point] = error

    def check(self, point: str) -> None:
        left = self._armed.get(point, 0)
        if left:
            self._armed[point] = left - 1
            raise self._errors[point](f"injected fault at {point}")


class FakeResource:
    """Charges the ledger under its own name while resident; release/restore are atomic."""

    def __init__(self, name: str, num_bytes: int, ledger: VramLedger, history: list, faults: Faults):
        self.name = name
        self.num_bytes = num_bytes
        self._ledger = ledger
        self._history = history
        self._faults = faults
        self._charge = None

    @property
    def is_resident(self) -> bool:
        return self._charge is not None

    def release(self) -> None:
        if self._charge is None:
            return
        self._faults.check(f"release:{self.name}")
        self._ledger.discharge(self._charge)
        self._charge = None
        self._history.append(f"release:{self.name}")

    def restore(self) -> None:
        if self._charge is not None:
            return
        self._faults.check(f"restore:{self.name}")
        self._charge = self._ledger.charge(self.name, self.num_bytes)
        self._history.append(f"restore:{self.name}")


class FakeCache:
    """An elastic expert cache of whole segments over the ledger. A segment holds ``slots_per_segment``
    slots (default: as many 4 MiB ring slots as it has room for; fewer, as on the GPU, where each
    plane of a segment rounds up to the mapping granularity)."""

    def __init__(self, base_bytes: int, segment_bytes: int, ledger: VramLedger, history: list, faults: Faults,
                 slots_per_segment: int | None = None):
        self.segment_bytes = segment_bytes
        self.slots_per_segment = slots_per_segment or segment_bytes // (4 * MIB)
        self._ledger = ledger
        self._history = history
        self._faults = faults
        self._segments = [ledger.charge("expert_cache", segment_bytes) for _ in range(base_bytes // segment_bytes)]
        self.base_bytes = self.mapped_bytes
        self.reserved_bytes = self.base_bytes // 2  # hot experts the workspace may not borrow
        self.lent_bytes = 0

    @property
    def mapped_bytes(self) -> int:
        return len(self._segments) * self.segment_bytes

    @property
    def num_slots(self) -> int:
        return len(self._segments) * self.slots_per_segment

    @property
    def num_cached(self) -> int:
        return 0  # the fake holds no experts

    def borrowable_bytes(self, grown_bytes: int = 0) -> int:
        grown = grown_bytes // self.segment_bytes * self.segment_bytes
        return max(0, self.mapped_bytes + grown - self.reserved_bytes - self.lent_bytes)

    def growable_bytes(self, max_bytes: int) -> int:
        return max(0, max_bytes) // self.segment_bytes * self.segment_bytes

    def slots_after_growth(self, grown_bytes: int) -> int:
        return (len(self._segments) + self.growable_bytes(grown_bytes) // self.segment_bytes) * self.slots_per_segment

    def segments_for(self, num_slots: int) -> int:
        return -(-num_slots // self.slots_per_segment)

    def lend(self, num_bytes: int) -> int:
        lent = min(num_bytes, self.borrowable_bytes())
        self.lent_bytes += lent
        return lent

    def take_back(self, num_bytes: int) -> None:
        self.lent_bytes -= num_bytes

    def grow(self, max_bytes: int) -> int:
        self._faults.check("grow")
        count = max_bytes // self.segment_bytes
        self._segments += [self._ledger.charge("expert_cache", self.segment_bytes) for _ in range(count)]
        self._history.append(f"grow:{count * self.segment_bytes // MIB}MiB")
        return count * self.segment_bytes

    def shrink_to(self, num_bytes: int) -> None:
        self._faults.check("shrink")
        assert self.lent_bytes == 0, "the workspace must give borrowed cache back before the cache shrinks"
        while self.mapped_bytes > num_bytes:
            self._ledger.discharge(self._segments.pop())
        self._history.append(f"shrink:{num_bytes // MIB}MiB")


class FakeWorkspace:
    """Borrows expert-cache storage first, charges the rest; atomic; can be made to fail."""

    def __init__(self, costs, ledger: VramLedger, cache: FakeCache, history: list, faults: Faults):
        self._costs = costs
        self._ledger = ledger
        self._cache = cache
        self._history = history
        self._faults = faults
        self._charge = None
        self._borrowed = 0

    def allocate(self, geometry: Geometry) -> None:
        self._faults.check("allocate")
        need = self._costs.workspace_bytes(geometry)
        borrowed = self._cache.lend(need)
        try:
            self._charge = self._ledger.charge("prompt_workspace", need - borrowed)
        except Exception:
            self._cache.take_back(borrowed)
            raise
        self._borrowed = borrowed
        self._history.append(f"allocate:{geometry}")

    def free(self) -> None:
        if self._charge is not None:
            self._ledger.discharge(self._charge)
            self._cache.take_back(self._borrowed)
            self._charge, self._borrowed = None, 0
            self._history.append("free")


class FakeResidency:
    """Counts the cached experts a prefill evicted; restoring stages them back (once nothing is lent)."""

    def __init__(self, cache: FakeCache, history: list, faults: Faults):
        self._cache = cache
        self._history = history
        self._faults = faults
        self.evicted = 0

    def snapshot(self) -> int:
        return self.evicted

    def restore(self, snapshot: int) -> int:
        self._faults.check("residency")
        assert self._cache.lent_bytes == 0, "the workspace must give borrowed cache back before residency returns"
        restaged, self.evicted = self.evicted - snapshot, snapshot
        self._history.append(f"restage:{restaged}")
        return restaged * MIB


class FakeEngine:
    """The loan's collaborators wired together over one ledger, as the engine wires the real ones."""

    def __init__(self, config, host, resource_mib: dict[str, int], budget_mib: int = 8192,
                 cache_mib: int = 1024, resident_mib: int = 2048, costs=None, cost_model=None, rates=None,
                 cache_slots_per_segment: int | None = None):
        from strata.engine.loan.runtime_state import RuntimeState
        from strata.engine.loan.transaction import LoanTransaction
        from strata.engine.planning.planner import Planner, WorkspaceCosts

        self.history: list[str] = []
        self.faults = Faults()
        self.ledger = VramLedger(budget_mib * MIB)
        self.ledger.charge("dense_weights", resident_mib * MIB)
        self.resources = {name: FakeResource(name, mib * MIB, self.ledger, self.history, self.faults)
                          for name, mib in resource_mib.items()}
        self.cache = FakeCache(cache_mib * MIB, 64 * MIB, self.ledger, self.history, self.faults,
                               cache_slots_per_segment)
        self.costs = costs or WorkspaceCosts(bytes_per_chunk_token=512 * 1024, bytes_per_ring_slot=4 * MIB,
                                             target_ring_slots=128, is_ring_in_cache=True, segment_bytes=64 * MIB)
        self.planner = Planner(self.costs, config.planner, cost_model=cost_model, rates=rates)
        self.workspace = FakeWorkspace(self.costs, self.ledger, self.cache, self.history, self.faults)
        self.residency = FakeResidency(self.cache, self.history, self.faults)
        self.state = RuntimeState(residency=self.residency)
        self.loan = LoanTransaction(config=config, plugins=host, ledger=self.ledger, resources=self.resources,
                                    cache=self.cache, planner=self.planner, workspace=self.workspace, state=self.state)

    def prefill(self, prompt_tokens: int, unread_tokens: int | None = None):
        def run(geometry):
            self.faults.check("prefill")
            self.history.append(f"prefill:{geometry}")
            self.state.update(copy_overlap=False, logit_bias=((1, -5.0),))  # prefill changes settings
            self.residency.evicted += 3  # and the ring's borrowed slots evict cached experts
            return geometry

        unread = prompt_tokens if unread_tokens is None else unread_tokens
        with self.loan.lend(prompt_tokens, unread) as geometry:
            result = run(geometry)
        return result, self.loan.last_report
