"""The prompt workspace of one prefill: the staging ring and the activations of a chunk.

It borrows the expert cache's top slots first (the ring must live there: kernels address ring
slots and cached experts as one slot array), then, where the backend allows, more slots for the
activations; whatever does not fit is charged to ``prompt_workspace``. ``allocate`` is atomic: on failure nothing stays borrowed or charged.
"""

from __future__ import annotations

from strata.backend.ops import Ops
from strata.engine.memory.expert_cache import ExpertCache
from strata.engine.planning.planner import WorkspaceCosts
from strata.errors import AllocationError
from strata.hooktypes import Geometry

OWNER = "prompt_workspace"


def borrowed_bytes(costs: WorkspaceCosts, geometry: Geometry, borrowable_bytes: int) -> int:
    """Expert-cache storage the workspace of ``geometry`` borrows: the ring, and where the backend
    allows, as much of the activations as the borrowable slots hold (the rest is charged apart)."""
    if not costs.is_activation_borrowable:
        return geometry.ring_slots * costs.bytes_per_ring_slot
    slot_bytes = costs.bytes_per_ring_slot
    return min(costs.workspace_bytes(geometry), borrowable_bytes // slot_bytes * slot_bytes)


class PromptWorkspace:
    def __init__(self, ops: Ops, cache: ExpertCache | None, costs: WorkspaceCosts):
        self.ops = ops
        self.cache = cache
        self.costs = costs
        self.geometry: Geometry | None = None
        self.first_ring_slot = -1
        self.borrowed_bytes = 0
        self._extra = None

    def allocate(self, geometry: Geometry) -> None:
        need = self.costs.workspace_bytes(geometry)
        ring_bytes = geometry.ring_slots * self.costs.bytes_per_ring_slot
        borrowable = self.cache.borrowable_bytes() if self.cache else 0
        if ring_bytes > borrowable:
            raise AllocationError(f"the staging ring of {geometry.ring_slots} slots needs {ring_bytes >> 20} MiB of "
                                  f"expert-cache slots; {borrowable >> 20} MiB are borrowable")
        borrow = borrowed_bytes(self.costs, geometry, borrowable) if self.cache else 0
        if self.cache and not self.costs.is_activation_borrowable:
            need = ring_bytes  # activations are the backend's own allocations, charged as they are made
        first_slot = -1
        if borrow:
            first_slot, _ = self.cache.lend(borrow)
        try:
            self._extra = self.ops.alloc(OWNER, (need - borrow,), "uint8") if need > borrow else None
        except Exception:
            if self.cache:
                self.cache.take_back()
            raise
        self.geometry, self.first_ring_slot, self.borrowed_bytes = geometry, first_slot, borrow

    def free(self) -> None:
        if self._extra is not None:
            self.ops.free(self._extra)
            self._extra = None
        if self.borrowed_bytes and self.cache:
            self.cache.take_back()
        self.geometry, self.first_ring_slot, self.borrowed_bytes = None, -1, 0

    def ring_slot(self, index: int) -> int:
        return self.first_ring_slot + index
