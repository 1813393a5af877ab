"""The prefill planner: the largest geometry (chunk tokens, staging ring slots) a budget holds.

Memory model, all in bytes:

    workspace(chunk, ring) = fixed_bytes + chunk * bytes_per_chunk_token + ring * bytes_per_ring_slot

``bytes_per_chunk_token`` covers activations, attention scratch and routing buffers of one
prompt token; a ring slot holds one expert's three matrices in flight from host to device.

Why bigger chunks: every chunk streams the non-resident experts its tokens route to, and with
top-k of many experts nearly all of a layer's experts are touched once a chunk holds a few
hundred tokens, so the streamed bytes per chunk are roughly fixed and a bigger chunk divides them
over more tokens. The ring is sized first (enough slots to keep the copy stream ahead of compute,
``target_ring_slots``), the chunk takes the rest, in multiples of ``chunk_quantum_tokens``.
"""

from __future__ import annotations

import dataclasses

from strata.config import PlannerConfig
from strata.errors import AllocationError
from strata.hooktypes import Geometry, PlannerBudget


@dataclasses.dataclass(frozen=True)
class WorkspaceCosts:
    bytes_per_chunk_token: int
    bytes_per_ring_slot: int
    fixed_bytes: int = 0
    target_ring_slots: int = 256

    def workspace_bytes(self, geometry: Geometry) -> int:
        return (self.fixed_bytes + geometry.chunk_tokens * self.bytes_per_chunk_token
                + geometry.ring_slots * self.bytes_per_ring_slot)


class Planner:
    def __init__(self, costs: WorkspaceCosts, config: PlannerConfig):
        self.costs = costs
        self.config = config

    def plan(self, budget: PlannerBudget, unread_tokens: int | None = None) -> Geometry:
        """The largest geometry that fits ``budget``; a chunk never exceeds the unread prompt.

        Raises ``AllocationError`` when not even one quantum with the smallest ring fits.
        """
        quantum = self.config.chunk_quantum_tokens
        costs = self.costs
        total = budget.total_bytes - costs.fixed_bytes
        smallest_chunk_bytes = quantum * costs.bytes_per_chunk_token
        ring_cap = min(self.config.max_ring_slots, max(self.config.min_ring_slots, costs.target_ring_slots))
        ring = min(ring_cap, max(0, total - smallest_chunk_bytes) // max(1, costs.bytes_per_ring_slot))
        if ring < self.config.min_ring_slots:
            need = costs.workspace_bytes(Geometry(quantum, self.config.min_ring_slots))
            raise AllocationError(
                f"the prefill budget of {budget.total_bytes / 2**20:.1f} MiB cannot hold the smallest geometry "
                f"({quantum} tokens, {self.config.min_ring_slots} ring slots: {need / 2**20:.1f} MiB); "
                "raise runtime.vram_budget or lower planner.chunk_quantum_tokens"
            )
        chunk_cap = self.config.max_chunk_tokens
        if unread_tokens is not None:
            chunk_cap = min(chunk_cap, _round_up(max(1, unread_tokens), quantum))
        room = total - ring * costs.bytes_per_ring_slot
        chunk = min(chunk_cap, room // max(1, costs.bytes_per_chunk_token)) // quantum * quantum
        return Geometry(chunk_tokens=max(quantum, chunk), ring_slots=int(ring))

    def smaller(self, geometry: Geometry) -> Geometry | None:
        """The next geometry to try after an allocation failure: one quantum less, then half the ring."""
        quantum = self.config.chunk_quantum_tokens
        if geometry.chunk_tokens > quantum:
            return dataclasses.replace(geometry, chunk_tokens=geometry.chunk_tokens - quantum)
        if geometry.ring_slots > self.config.min_ring_slots:
            return dataclasses.replace(geometry, ring_slots=max(self.config.min_ring_slots, geometry.ring_slots // 2))
        return None

    def explain(self, budget: PlannerBudget, geometry: Geometry) -> str:
        costs = self.costs
        return (
            f"budget {budget.total_bytes / 2**20:.1f} MiB (free {budget.free_bytes / 2**20:.1f}, borrowable cache "
            f"{budget.borrowable_cache_bytes / 2**20:.1f}, plugins {budget.adjust_bytes / 2**20:+.1f}) → ring "
            f"{geometry.ring_slots} × {costs.bytes_per_ring_slot / 2**20:.2f} MiB, chunk {geometry.chunk_tokens:,} × "
            f"{costs.bytes_per_chunk_token / 1024:.1f} KiB/token = {costs.workspace_bytes(geometry) / 2**20:.1f} MiB"
        )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
