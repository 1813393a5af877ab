"""The prefill planner: the geometry (chunk tokens, staging ring slots) that prefills a request fastest.

Memory model, all in bytes:

    workspace(chunk, ring) = fixed_bytes + chunk * bytes_per_chunk_token + ring * bytes_per_ring_slot

``bytes_per_chunk_token`` covers activations, attention scratch and routing buffers of one
prompt token; a ring slot holds one expert's three matrices in flight from host to device.

Why bigger chunks: every chunk streams the non-resident experts its tokens route to, and with
top-k of many experts nearly all of a layer's experts are touched once a chunk holds a few
hundred tokens, so the streamed bytes per chunk are roughly fixed and a bigger chunk divides them
over more tokens. The ring is sized first (enough slots to keep the copy stream ahead of compute,
``target_ring_slots``), the chunk takes the rest, in multiples of ``chunk_quantum_tokens``.

The expert cache is borrowable memory: the ring lives in its top slots, and activations that free
memory cannot hold take the memory of cache segments unmapped for the prefill
(``WorkspaceCosts.borrowed_bytes``); what they evicted is staged back before decode. Borrowing
is not free: each evicted expert streams in every later chunk and is staged back once. With a
cost model (``prefill_cost.py``; every model with experts has one), ``plan`` weighs every chunk
that fits (``candidates``) for the prompt (unknown: the longest the context holds) and the
cache's state (unknown: empty), and takes the fastest predicted; ties go to the bigger chunk. The
cost model predicts with the rates of ``rates.py`` (measured at load, calibrated from the chunks
the engine runs, or configured), read at every plan. A dense model streams nothing: its chunk is
the largest that fits. ``explain`` prints the memory arithmetic and the prediction.
"""

from __future__ import annotations

import dataclasses

from strata.config import PlannerConfig
from strata.engine.planning.prefill_cost import PrefillCostModel
from strata.engine.planning.rates import ChunkTiming, PrefillRates
from strata.errors import AllocationError
from strata.hooktypes import Geometry, PlannerBudget

_TIE_SHARE = 0.005  # predictions within 0.5% count as equal: the bigger chunk wins


@dataclasses.dataclass(frozen=True)
class WorkspaceCosts:
    bytes_per_chunk_token: int
    bytes_per_ring_slot: int
    fixed_bytes: int = 0
    target_ring_slots: int = 256  # 0: a dense model, nothing to stream
    is_ring_in_cache: bool = False  # the ring and the activations free memory lacks borrow the expert cache
    segment_bytes: int = 1  # the cache unmaps whole segments of this many bytes for activations

    def workspace_bytes(self, geometry: Geometry) -> int:
        return self.workspace_bytes_for(geometry.chunk_tokens, geometry.ring_slots)

    def workspace_bytes_for(self, chunk_tokens: int, ring_slots: int) -> int:
        return self.fixed_bytes + chunk_tokens * self.bytes_per_chunk_token + ring_slots * self.bytes_per_ring_slot

    def borrowed_bytes(self, geometry: Geometry, free_bytes: int) -> int:
        """Expert-cache memory the workspace of ``geometry`` takes: the ring's slots, and the whole
        segments unmapped for what of the activations ``free_bytes`` cannot hold."""
        if not self.is_ring_in_cache:
            return 0
        short = self.workspace_bytes(Geometry(geometry.chunk_tokens, 0)) - free_bytes
        return geometry.ring_slots * self.bytes_per_ring_slot + _round_up(max(0, short), self.segment_bytes)

    def activation_room(self, budget: PlannerBudget, ring_slots: int) -> int:
        """Bytes a chunk's activations may take: free memory, and the whole cache segments the
        borrowable cache holds beyond the ring."""
        free = budget.free_bytes + budget.adjust_bytes - self.fixed_bytes
        if not self.is_ring_in_cache:
            return free
        spare = budget.borrowable_cache_bytes - ring_slots * self.bytes_per_ring_slot
        return free + max(0, spare) // self.segment_bytes * self.segment_bytes


@dataclasses.dataclass(frozen=True)
class CacheState:
    """What the expert cache holds when a request plans: mapped slots, and the experts cached in them."""

    num_slots: int
    num_cached: int


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A geometry the planner weighed: the cache slots it evicts and the prefill time it predicts."""

    geometry: Geometry
    num_evicted: int
    predicted_seconds: float


class Planner:
    def __init__(self, costs: WorkspaceCosts, config: PlannerConfig, context_tokens: int | None = None,
                 cost_model: PrefillCostModel | None = None, rates: PrefillRates | None = None):
        self.costs = costs
        self.config = config
        self._cost_model = cost_model
        self.rates = rates  # None: the cost model's own rates
        self.max_chunk_tokens = config.max_chunk_tokens
        self.context_tokens = context_tokens
        if context_tokens:
            quantum = config.chunk_quantum_tokens
            self.max_chunk_tokens = min(self.max_chunk_tokens, max(quantum, _round_up(context_tokens, quantum)))

    @property
    def cost_model(self) -> PrefillCostModel | None:
        """The cost model with the rates as they are now (measured, calibrated or configured)."""
        model, rates = self._cost_model, self.rates
        if model is None or rates is None:
            return model
        return dataclasses.replace(model, pcie_bytes_per_s=rates.pcie.value, compute_flops_per_s=rates.compute.value)

    def calibrate(self, chunks: list[ChunkTiming]) -> None:
        """Learn the compute rate from chunks a prefill ran (``rates.py``)."""
        if self.rates is not None and self._cost_model is not None:
            self.rates.record(self._cost_model, chunks)

    def plan(self, budget: PlannerBudget, unread_tokens: int | None = None,
             cache: CacheState | None = None) -> Geometry:
        """The fastest predicted geometry that fits ``budget`` for a prompt of ``unread_tokens``
        (None: the longest) and a cache holding ``cache`` (None: empty); without a cost model (a
        dense model), the largest. A chunk never exceeds the unread prompt.

        Raises ``AllocationError`` when not even one quantum with the smallest ring fits.
        """
        return self.weigh(budget, unread_tokens, cache)[0]

    def weigh(self, budget: PlannerBudget, unread_tokens: int | None = None,
              cache: CacheState | None = None) -> tuple[Geometry, list[Candidate]]:
        """``plan``'s choice and the candidates it weighed (none without a cost model, or with a fixed geometry)."""
        quantum = self.config.chunk_quantum_tokens
        costs = self.costs
        ring = self._ring_slots(budget, self._ring_room(budget))
        if ring < 0 or costs.activation_room(budget, max(0, ring)) < quantum * costs.bytes_per_chunk_token:
            min_ring = self.config.min_ring_slots if costs.target_ring_slots else 0
            need = costs.workspace_bytes(Geometry(quantum, min_ring))
            raise AllocationError(
                f"the prefill budget of {budget.total_bytes / 2**20:.1f} MiB cannot hold the smallest geometry "
                f"({quantum} tokens, {min_ring} ring slots: {need / 2**20:.1f} MiB); "
                "raise runtime.vram_budget or lower planner.chunk_quantum_tokens"
            )
        if self.config.chunk_tokens or self.config.ring_slots:
            return self._forced(budget, int(ring), unread_tokens), []
        limits = self._chunk_limits(budget, ring, unread_tokens)
        largest = Geometry(max(quantum, min(limit.value for limit in limits)), int(ring))
        weighed = self.candidates(budget, largest, self.predicted_tokens(unread_tokens), cache)
        if not weighed:
            return largest, weighed
        best = weighed[0]
        for candidate in weighed[1:]:  # biggest chunk first: a smaller one must be clearly faster
            if candidate.predicted_seconds < best.predicted_seconds * (1 - _TIE_SHARE):
                best = candidate
        return best.geometry, weighed

    def _forced(self, budget: PlannerBudget, ring_fit: int, unread_tokens: int | None) -> Geometry:
        """The geometry ``planner.chunk_tokens`` / ``planner.ring_slots`` fix (the other one the largest
        that fits), or an AllocationError naming them when the budget cannot hold it."""
        costs, config = self.costs, self.config
        ring = config.ring_slots if config.ring_slots and costs.target_ring_slots else max(0, ring_fit)
        chunk = config.chunk_tokens
        if not chunk:
            limits = self._chunk_limits(budget, ring, unread_tokens)
            chunk = max(config.chunk_quantum_tokens, min(limit.value for limit in limits))
        forced = Geometry(chunk, ring)
        if ring > max(0, ring_fit) or costs.activation_room(budget, ring) < chunk * costs.bytes_per_chunk_token:
            raise AllocationError(
                f"planner.chunk_tokens = {config.chunk_tokens} and planner.ring_slots = {config.ring_slots} ask for "
                f"{forced} ({costs.workspace_bytes(forced) / 2**20:.1f} MiB of prefill workspace), more than the "
                f"prefill budget of {budget.total_bytes / 2**20:.1f} MiB holds; lower them, set them to 0 (the "
                "planner decides), or raise runtime.vram_budget")
        return forced

    def predicted_tokens(self, unread_tokens: int | None) -> int:
        """The prompt a plan is predicted for: ``unread_tokens``, or unknown, the longest the context
        holds (without a context, the largest chunk)."""
        if unread_tokens:
            return unread_tokens
        return self.context_tokens - 1 if self.context_tokens and self.context_tokens > 1 else self.max_chunk_tokens

    def candidates(self, budget: PlannerBudget, largest: Geometry, unread_tokens: int,
                   cache: CacheState | None) -> list[Candidate]:
        """Every chunk from ``largest`` down by quanta with its ring, the cache slots its workspace
        evicts and the predicted prefill of ``unread_tokens`` (restaging the evicted experts
        included) from a cache holding ``cache`` (None: empty); empty without a cost model or
        experts to stream."""
        if self.cost_model is None or not self.cost_model.num_expert_slots:
            return []
        quantum, cache = self.config.chunk_quantum_tokens, cache or CacheState(0, 0)
        return [self.predict(budget, Geometry(chunk, largest.ring_slots), unread_tokens, cache)
                for chunk in range(largest.chunk_tokens, quantum - 1, -quantum)]

    def predict(self, budget: PlannerBudget, geometry: Geometry, unread_tokens: int, cache: CacheState) -> Candidate:
        """``geometry``'s evicted cache slots and predicted prefill time (the cost model's, plus restaging)."""
        model, slot_bytes = self.cost_model, max(1, self.costs.bytes_per_ring_slot)
        borrowed = self.costs.borrowed_bytes(geometry, budget.free_bytes + budget.adjust_bytes)
        kept = min(cache.num_cached, max(0, cache.num_slots - -(-borrowed // slot_bytes)))
        num_evicted = cache.num_cached - kept
        seconds = model.cost(unread_tokens, geometry.chunk_tokens, kept).total_seconds
        return Candidate(geometry, num_evicted, seconds + model.restage_seconds(num_evicted))

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
        room = costs.activation_room(budget, ring_slots)
        num_tokens = room // max(1, costs.bytes_per_chunk_token)
        limits.append(Limit(num_tokens // quantum * quantum,
                            f"the free memory and the expert cache's segments left "
                            f"after the ring ({room / 2**20:.1f} MiB: {num_tokens:,} tokens)"))
        return limits

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

    def capped(self, geometry: Geometry, unread_tokens: int) -> Geometry:
        """``geometry`` with its chunk no longer than the unread prompt (in quanta): a workspace for
        more tokens than a prompt has would only borrow the expert cache for nothing."""
        quantum = self.config.chunk_quantum_tokens
        return dataclasses.replace(geometry, chunk_tokens=min(geometry.chunk_tokens,
                                                              _round_up(max(1, unread_tokens), quantum)))

    def smaller(self, geometry: Geometry) -> Geometry | None:
        """The next geometry to try after an allocation failure: one quantum less, then half the ring."""
        quantum = self.config.chunk_quantum_tokens
        if geometry.chunk_tokens > quantum:
            return dataclasses.replace(geometry, chunk_tokens=geometry.chunk_tokens - quantum)
        if self.costs.target_ring_slots and geometry.ring_slots > self.config.min_ring_slots:
            return dataclasses.replace(geometry, ring_slots=max(self.config.min_ring_slots, geometry.ring_slots // 2))
        return None

    def explain(self, budget: PlannerBudget, geometry: Geometry, unread_tokens: int | None = None,
                cache: CacheState | None = None, predicted_tokens: int | None = None) -> str:
        """The memory arithmetic of ``geometry`` (planned for ``budget`` and ``unread_tokens``), the
        limits that bound its chunk and ring, and with a cost model and the cache's state the
        predicted prefill of ``predicted_tokens`` (default: the unread tokens)."""
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
        if self.cost_model is not None and predicted_tokens and cache is not None:
            predicted = self.predict(budget, geometry, predicted_tokens, cache)
            kept = cache.num_cached - predicted.num_evicted
            cost = self.cost_model.cost(predicted_tokens, geometry.chunk_tokens, kept)
            text += (f"; {predicted_tokens:,} tokens with {kept:,} cached experts kept ({predicted.num_evicted:,} "
                     f"evicted, restaged in {self.cost_model.restage_seconds(predicted.num_evicted):.2f} s): "
                     + self.cost_model.describe(cost))
        return text

    def describe_candidates(self, candidates: list[Candidate], chosen: Geometry, num_shown: int = 6) -> str:
        """A few of the weighed geometries, evenly spread from the largest chunk down, and the chosen one."""
        if not candidates:
            if self.config.chunk_tokens or self.config.ring_slots:
                return "nothing weighed: planner.chunk_tokens / planner.ring_slots fix the geometry"
            return "nothing weighed: no experts to stream, so the largest chunk is the fastest"
        step = max(1, len(candidates) // num_shown)
        shown = [c for i, c in enumerate(candidates) if i % step == 0 or c.geometry == chosen]
        picked = next((c for c in candidates if c.geometry == chosen), None)
        verdict = f"; chose {chosen} ({picked.predicted_seconds:.2f} s)" if picked \
            else f"; {chosen} set outside the cost model"
        return (f"{len(candidates)} chunks weighed with a ring of {candidates[0].geometry.ring_slots} (chunk: "
                "predicted prefill, cached experts evicted): " + ", ".join(
                    f"{'[' if c.geometry == chosen else ''}{c.geometry.chunk_tokens:,}: {c.predicted_seconds:.2f} s, "
                    f"{c.num_evicted:,} evicted{']' if c.geometry == chosen else ''}" for c in shown) + verdict)

    def _explain_limits(self, budget: PlannerBudget, geometry: Geometry, unread_tokens: int | None) -> str:
        quantum, costs = self.config.chunk_quantum_tokens, self.costs
        if costs.target_ring_slots:
            ring_text = "ring " + _bound_by(self._ring_limits(budget, self._ring_room(budget)), geometry.ring_slots)
        else:
            ring_text = "no ring (no experts to stream)"
        limits = self._chunk_limits(budget, geometry.ring_slots, unread_tokens)
        if min(limit.value for limit in limits) < quantum:  # the plan's floor: one quantum
            limits = [Limit(quantum, f"planner.chunk_quantum_tokens ({quantum:,}), the smallest chunk")]
        largest = min(limit.value for limit in limits)
        if geometry.chunk_tokens < largest and self.cost_model is not None:
            return (f"chunk {geometry.chunk_tokens:,} chosen by the cost model (the largest that fits, {largest:,}, "
                    f"is predicted slower), {ring_text}")
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
