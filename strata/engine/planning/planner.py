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

Where memory may go either to the expert cache or to the chunk (a loan's freed bytes, when
activations cannot borrow cache storage), ``growth_allowance`` asks the cost model
(``prefill_cost.py``: bytes streamed per chunk, measured PCIe and compute rates) which split
prefills the request fastest; ties go to the bigger chunk. ``explain`` prints the memory
arithmetic and the predicted times.
"""

from __future__ import annotations

import dataclasses

from strata.config import PlannerConfig
from strata.engine.planning.prefill_cost import PrefillCostModel
from strata.errors import AllocationError
from strata.hooktypes import Geometry, PlannerBudget

_TIE_SHARE = 0.005  # predictions within 0.5% count as equal: the bigger chunk wins


@dataclasses.dataclass(frozen=True)
class WorkspaceCosts:
    bytes_per_chunk_token: int
    bytes_per_ring_slot: int
    fixed_bytes: int = 0
    target_ring_slots: int = 256  # 0: a dense model, nothing to stream
    is_ring_in_cache: bool = False  # ring slots must be borrowed expert-cache slots
    is_activation_borrowable: bool = True  # activations may live in borrowed expert-cache storage

    def workspace_bytes(self, geometry: Geometry) -> int:
        return self.workspace_bytes_for(geometry.chunk_tokens, geometry.ring_slots)

    def workspace_bytes_for(self, chunk_tokens: int, ring_slots: int) -> int:
        return self.fixed_bytes + chunk_tokens * self.bytes_per_chunk_token + ring_slots * self.bytes_per_ring_slot


class Planner:
    def __init__(self, costs: WorkspaceCosts, config: PlannerConfig, context_tokens: int | None = None,
                 cost_model: PrefillCostModel | None = None):
        self.costs = costs
        self.config = config
        self.cost_model = cost_model
        self.max_chunk_tokens = config.max_chunk_tokens
        self.context_tokens = context_tokens
        if context_tokens:
            quantum = config.chunk_quantum_tokens
            self.max_chunk_tokens = min(self.max_chunk_tokens, max(quantum, _round_up(context_tokens, quantum)))

    def plan(self, budget: PlannerBudget, unread_tokens: int | None = None) -> Geometry:
        """The largest geometry that fits ``budget``; a chunk never exceeds the unread prompt.

        Raises ``AllocationError`` when not even one quantum with the smallest ring fits.
        """
        quantum = self.config.chunk_quantum_tokens
        costs = self.costs
        total = budget.total_bytes - costs.fixed_bytes
        ring = self._ring_slots(budget, self._ring_room(budget))
        activation_room = total if costs.is_activation_borrowable else \
            budget.free_bytes + budget.adjust_bytes - costs.fixed_bytes
        if ring < 0 or activation_room < quantum * costs.bytes_per_chunk_token:
            min_ring = self.config.min_ring_slots if costs.target_ring_slots else 0
            need = costs.workspace_bytes(Geometry(quantum, min_ring))
            raise AllocationError(
                f"the prefill budget of {budget.total_bytes / 2**20:.1f} MiB cannot hold the smallest geometry "
                f"({quantum} tokens, {min_ring} ring slots: {need / 2**20:.1f} MiB); "
                "raise runtime.vram_budget or lower planner.chunk_quantum_tokens"
            )
        chunk = min(limit.value for limit in self._chunk_limits(budget, ring, unread_tokens))
        return Geometry(chunk_tokens=max(quantum, chunk), ring_slots=int(ring))

    def _ring_room(self, budget: PlannerBudget) -> int:
        """The bytes the ring may take: the budget less the fixed workspace and one quantum's tokens."""
        costs = self.costs
        return budget.total_bytes - costs.fixed_bytes - self.config.chunk_quantum_tokens * costs.bytes_per_chunk_token

    def _chunk_limits(self, budget: PlannerBudget, ring_slots: int, unread_tokens: int | None) -> list[Limit]:
        """Every bound on the chunk, each already in whole quanta: the plan takes the smallest."""
        quantum, costs = self.config.chunk_quantum_tokens, self.costs
        limits = []
        if unread_tokens is not None:
            limits.append(Limit(_round_up(max(1, unread_tokens), quantum),
                                f"the unread prompt ({unread_tokens:,} tokens)"))
        if self.max_chunk_tokens < self.config.max_chunk_tokens:
            reason = f"the context ({self.context_tokens:,} tokens)"
        else:
            reason = f"planner.max_chunk_tokens ({self.config.max_chunk_tokens:,})"
        limits.append(Limit(self.max_chunk_tokens // quantum * quantum, reason))
        room = budget.total_bytes - costs.fixed_bytes - ring_slots * costs.bytes_per_ring_slot
        where = "left after the ring"
        if not costs.is_activation_borrowable:
            free_room = budget.free_bytes + budget.adjust_bytes - costs.fixed_bytes
            if free_room < room:
                room, where = free_room, "outside the expert cache, where activations must live"
        num_tokens = room // max(1, costs.bytes_per_chunk_token)
        limits.append(Limit(num_tokens // quantum * quantum,
                            f"the free memory {where} ({room / 2**20:.1f} MiB: {num_tokens:,} tokens)"))
        return limits

    def growth_allowance(self, free_bytes: int, unread_tokens: int | None, cached_slots: int = 0) -> int:
        """Free bytes the expert cache may grow into before planning: all of them when activations
        can borrow cache storage; else what the chunk leaves, the chunk being the largest useful
        one, or with a cost model and a known prompt the fastest predicted split."""
        if self.costs.is_activation_borrowable:
            return free_bytes
        chunk = self.max_chunk_tokens
        if unread_tokens is not None:
            chunk = min(chunk, _round_up(max(1, unread_tokens), self.config.chunk_quantum_tokens))
            if self.cost_model is not None and self.cost_model.num_expert_slots:
                chunk = self.fastest_chunk(free_bytes, unread_tokens, cached_slots, chunk)
        return max(0, free_bytes - self.costs.fixed_bytes - chunk * self.costs.bytes_per_chunk_token)

    def fastest_chunk(self, free_bytes: int, unread_tokens: int, cached_slots: int, max_chunk: int) -> int:
        """The chunk whose split of ``free_bytes`` (chunk activations vs cache growth) the cost model
        predicts fastest for ``unread_tokens``; the bigger chunk on a tie."""
        costs, quantum, model = self.costs, self.config.chunk_quantum_tokens, self.cost_model
        best_chunk, best_s = max(quantum, max_chunk // quantum * quantum), None
        for chunk in range(max(quantum, max_chunk // quantum * quantum), quantum - 1, -quantum):
            room = free_bytes - costs.fixed_bytes - chunk * costs.bytes_per_chunk_token
            if room < 0:
                continue
            grown = room // max(1, costs.bytes_per_ring_slot) if model.is_growth_cached else 0
            seconds = model.cost(unread_tokens, chunk, cached_slots + grown).total_seconds
            if best_s is None or seconds < best_s * (1 - _TIE_SHARE):
                best_chunk, best_s = chunk, seconds
        return best_chunk

    def _ring_slots(self, budget: PlannerBudget, room_bytes: int) -> int:
        """Ring slots for this budget, or -1 when not even the smallest ring fits."""
        if not self.costs.target_ring_slots:
            return 0
        ring = min(limit.value for limit in self._ring_limits(budget, room_bytes))
        return ring if ring >= self.config.min_ring_slots else -1

    def _ring_limits(self, budget: PlannerBudget, room_bytes: int) -> list[Limit]:
        """Every bound on the ring of a model with experts to stream; the plan takes the smallest.
        ``room_bytes``: the budget less the fixed workspace and the smallest chunk."""
        costs, config = self.costs, self.config
        target = costs.target_ring_slots
        if config.max_ring_slots < max(config.min_ring_slots, target):
            reason = f"planner.max_ring_slots ({config.max_ring_slots:,})"
        elif target < config.min_ring_slots:
            reason = f"planner.min_ring_slots ({config.min_ring_slots:,}), above one layer's {target:,} experts"
        else:
            reason = f"the target of one layer's experts ({target:,})"
        limits = [Limit(largest_ring_slots(config, target), reason)]
        room_reason = f"the free memory left after the smallest chunk ({max(0, room_bytes) / 2**20:.1f} MiB)"
        if costs.is_ring_in_cache and budget.borrowable_cache_bytes < room_bytes:
            room_bytes = budget.borrowable_cache_bytes
            room_reason = f"the borrowable expert cache ({room_bytes / 2**20:.1f} MiB)"
        limits.append(Limit(max(0, room_bytes) // max(1, costs.bytes_per_ring_slot), room_reason))
        return limits

    def smaller(self, geometry: Geometry) -> Geometry | None:
        """The next geometry to try after an allocation failure: one quantum less, then half the ring."""
        quantum = self.config.chunk_quantum_tokens
        if geometry.chunk_tokens > quantum:
            return dataclasses.replace(geometry, chunk_tokens=geometry.chunk_tokens - quantum)
        if self.costs.target_ring_slots and geometry.ring_slots > self.config.min_ring_slots:
            return dataclasses.replace(geometry, ring_slots=max(self.config.min_ring_slots, geometry.ring_slots // 2))
        return None

    def explain(self, budget: PlannerBudget, geometry: Geometry, unread_tokens: int | None = None,
                cached_slots: int | None = None, predicted_tokens: int | None = None) -> str:
        """The memory arithmetic of ``geometry`` (planned for ``budget`` and ``unread_tokens``), the
        limits that bound its chunk and ring, and with a cost model the predicted prefill time of
        ``predicted_tokens`` (default: the unread tokens) with ``cached_slots`` cached experts."""
        costs = self.costs
        text = (
            f"budget {budget.total_bytes / 2**20:.1f} MiB (free {budget.free_bytes / 2**20:.1f}, borrowable cache "
            f"{budget.borrowable_cache_bytes / 2**20:.1f}, plugins {budget.adjust_bytes / 2**20:+.1f}) → ring "
            f"{geometry.ring_slots} × {costs.bytes_per_ring_slot / 2**20:.2f} MiB, chunk {geometry.chunk_tokens:,} × "
            f"{costs.bytes_per_chunk_token / 1024:.1f} KiB/token"
            + (f" + fixed {costs.fixed_bytes / 2**20:.1f} MiB" if costs.fixed_bytes else "")
            + f" = {costs.workspace_bytes(geometry) / 2**20:.1f} MiB"
        )
        text += "; " + self._explain_limits(budget, geometry, unread_tokens)
        predicted_tokens = predicted_tokens or unread_tokens
        if self.cost_model is not None and predicted_tokens and cached_slots is not None:
            cost = self.cost_model.cost(predicted_tokens, geometry.chunk_tokens, cached_slots - geometry.ring_slots)
            text += (f"; {predicted_tokens:,} tokens with {cached_slots:,} cached experts: "
                     + self.cost_model.describe(cost))
        return text

    def _explain_limits(self, budget: PlannerBudget, geometry: Geometry, unread_tokens: int | None) -> str:
        quantum, costs = self.config.chunk_quantum_tokens, self.costs
        if costs.target_ring_slots:
            ring_text = "ring " + _bound_by(self._ring_limits(budget, self._ring_room(budget)), geometry.ring_slots)
        else:
            ring_text = "no ring (no experts to stream)"
        limits = self._chunk_limits(budget, geometry.ring_slots, unread_tokens)
        if min(limit.value for limit in limits) < quantum:  # the plan's floor: one quantum
            limits = [Limit(quantum, f"planner.chunk_quantum_tokens ({quantum:,}), the smallest chunk")]
        return f"chunk {_bound_by(limits, geometry.chunk_tokens)}, {ring_text}"


@dataclasses.dataclass(frozen=True)
class Limit:
    """One bound on a plan's chunk tokens or ring slots: the most it allows, and what it is."""

    value: int
    reason: str


def _bound_by(limits: list[Limit], chosen: int) -> str:
    """The limits that hold ``chosen`` where it is: every one that allows no more than the smallest."""
    planned = min(limit.value for limit in limits)
    if chosen != planned:
        return f"{chosen:,} set outside the planner (for this budget it plans {planned:,})"
    return "bound by " + " and ".join(limit.reason for limit in limits if limit.value == planned)


def largest_ring_slots(config: PlannerConfig, target_ring_slots: int) -> int:
    """The most ring slots a plan takes: the target (a layer's experts), within the configured bounds."""
    return min(config.max_ring_slots, max(config.min_ring_slots, target_ring_slots))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
