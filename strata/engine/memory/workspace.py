"""The prompt workspace of one prefill: the staging ring and room for a chunk's activations.

The ring lives in the expert cache's top slots (kernels address ring slots and cached experts as
one slot array). The activations are the backend's own allocations; where free memory cannot
hold them, the workspace unmaps the cache's top segments first, so their memory is free for the
prefill, and maps them again in ``free``. What either evicted is staged back by the loan
transaction's residency restore before decode. Where the backend does not charge activations as
they are made (numpy), the workspace charges them to ``prompt_workspace``. ``allocate`` is
atomic: on failure nothing stays lent, unmapped or charged.
"""

from __future__ import annotations

from strata.backend.ops import Ops
from strata.engine.memory.expert_cache import ExpertCache
from strata.engine.planning.planner import WorkspaceCosts
from strata.errors import AllocationError, LoanRestoreError
from strata.hooktypes import Geometry

OWNER = "prompt_workspace"


class PromptWorkspace:
    def __init__(self, ops: Ops, cache: ExpertCache | None, costs: WorkspaceCosts):
        self.ops = ops
        self.cache = cache
        self.costs = costs
        self.geometry: Geometry | None = None
        self.first_ring_slot = -1
        self.unmapped_bytes = 0  # cache segments unmapped for the activations
        self._reservation = None

    @property
    def borrowed_bytes(self) -> int:
        """Expert-cache memory the workspace holds now: the ring's slots and the unmapped segments."""
        ring_bytes = self.geometry.ring_slots * self.costs.bytes_per_ring_slot if self.geometry else 0
        return ring_bytes + self.unmapped_bytes

    def allocate(self, geometry: Geometry) -> None:
        ring_bytes = geometry.ring_slots * self.costs.bytes_per_ring_slot
        activation_bytes = self.costs.workspace_bytes(Geometry(geometry.chunk_tokens, 0))
        unmapped = self._unmap_for(activation_bytes) if self.cache else 0
        try:
            borrowable = self.cache.borrowable_bytes() if self.cache else 0
            if ring_bytes > borrowable:
                raise AllocationError(f"the staging ring of {geometry.ring_slots} slots needs {ring_bytes >> 20} MiB "
                                      f"of expert-cache slots; {borrowable >> 20} MiB are borrowable")
            first_slot = self.cache.lend(ring_bytes)[0] if ring_bytes else -1
            try:
                self._reservation = None if self.ops.is_activation_charged else \
                    self.ops.alloc(OWNER, (activation_bytes,), "uint8")
            except Exception:
                if self.cache:
                    self.cache.take_back()
                raise
        except Exception:
            self._map_back(unmapped)
            raise
        self.geometry, self.first_ring_slot, self.unmapped_bytes = geometry, first_slot, unmapped

    def free(self) -> None:
        """Give everything back, each step also when one before it raised; maps the unmapped segments
        again (their experts are restaged by the transaction). ``unmapped_bytes`` stays set while
        they are not mapped again."""
        try:
            if self._reservation is not None:
                reservation, self._reservation = self._reservation, None
                self.ops.free(reservation)
        finally:
            try:
                if self.geometry is not None and self.cache:
                    self.cache.take_back()
            finally:
                self.geometry, self.first_ring_slot = None, -1
                self._map_back(self.unmapped_bytes)
                self.unmapped_bytes = 0

    def ring_slot(self, index: int) -> int:
        return self.first_ring_slot + index

    def _unmap_for(self, activation_bytes: int) -> int:
        """Unmap the cache's top segments that free memory lacks for ``activation_bytes``; returns
        the bytes unmapped."""
        short = activation_bytes - self.ops.ledger.free_bytes
        if short <= 0:
            return 0
        unmapped = self.cache.unmap_top(short)
        if not unmapped:
            raise AllocationError(f"the chunk's activations need {short >> 20} MiB more than is free, more than "
                                  f"the expert cache can lend ({self.cache.borrowable_bytes() >> 20} MiB)")
        return unmapped

    def _map_back(self, num_bytes: int) -> None:
        """Map ``num_bytes`` of unmapped segments again. Not an ``AllocationError``: a smaller geometry
        cannot help a cache that stays short, so the transaction must not retry past it."""
        if not num_bytes:
            return
        self.ops.trim_memory()  # pooled activation blocks go back to the budget before the segments return
        try:
            mapped = self.cache.grow(num_bytes)
        except AllocationError as exc:
            raise LoanRestoreError(f"the expert cache could not map back the {num_bytes >> 20} MiB it lent to the "
                                   f"prompt's activations: {exc}") from exc
        if mapped < num_bytes:
            raise LoanRestoreError(f"the expert cache mapped back {mapped >> 20} of the {num_bytes >> 20} MiB it "
                                   "lent to the prompt's activations")
