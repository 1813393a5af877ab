"""The planner: memory geometry for a budget, and the cost model's split between chunk and cache."""

import dataclasses

import pytest

from strata.config import PlannerConfig
from strata.engine.planning.planner import Planner, WorkspaceCosts
from strata.engine.planning.prefill_cost import PrefillCostModel
from strata.errors import AllocationError
from strata.hooktypes import Geometry, PlannerBudget

MIB = 1 << 20
COSTS = WorkspaceCosts(bytes_per_chunk_token=256 * 1024, bytes_per_ring_slot=4 * MIB, target_ring_slots=64,
                       is_ring_in_cache=True, is_activation_borrowable=False)
QUANTUM = PlannerConfig().chunk_quantum_tokens


def _model(**rates) -> PrefillCostModel:
    base = dict(weight_flops_per_token=6e9, attention_flops_per_pair=2.4e7, num_expert_slots=6144,
                slot_bytes=4 * MIB, pcie_bytes_per_s=55e9, compute_flops_per_s=20e12, chunk_overhead_s=0.05)
    return PrefillCostModel(**{**base, **rates})


def test_plan_is_the_largest_geometry_and_reproducible():
    planner = Planner(COSTS, PlannerConfig())
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)
    geometry = planner.plan(budget)
    assert geometry == Geometry(chunk_tokens=4096, ring_slots=64)  # 1024 MiB / 256 KiB per token
    assert planner.plan(budget) == geometry
    assert planner.plan(budget, unread_tokens=300) == Geometry(chunk_tokens=2 * QUANTUM, ring_slots=64)


def test_plan_refuses_a_budget_below_the_smallest_geometry():
    planner = Planner(COSTS, PlannerConfig())
    with pytest.raises(AllocationError, match="raise runtime.vram_budget"):
        planner.plan(PlannerBudget(free_bytes=MIB, borrowable_cache_bytes=0))


def test_cost_model_counts_chunks_copies_and_causal_attention():
    model = _model()
    cost = model.cost(unread_tokens=1000, chunk_tokens=512, cached_slots=6144 - 100)
    assert cost.num_chunks == 2
    assert cost.copy_seconds == pytest.approx(100 * 4 * MIB / 55e9)
    pairs = 1000 * 1001 / 2
    assert cost.compute_seconds == pytest.approx((1000 * 6e9 + pairs * 2.4e7) / 20e12)
    assert model.cost(1000, 512, cached_slots=0).copy_seconds > cost.copy_seconds
    serial = dataclasses.replace(model, is_overlapped=False).cost(1000, 512, 6144 - 100)
    assert serial.total_seconds > cost.total_seconds


def test_copy_bound_prefill_gives_free_memory_to_the_cache():
    # slow PCIe and fast compute: every chunk is a full stream of the uncached experts, so fewer
    # chunks win, unless a smaller chunk leaves enough memory to cache many more experts
    slow_copies = _model(pcie_bytes_per_s=2e9, compute_flops_per_s=1e15, is_growth_cached=True)
    planner = Planner(COSTS, PlannerConfig(), cost_model=slow_copies)
    free = 8192 * MIB
    chunk = planner.fastest_chunk(free, unread_tokens=32768, cached_slots=0, max_chunk=16384)
    fixed = Planner(COSTS, PlannerConfig()).growth_allowance(free, unread_tokens=32768)
    assert fixed == max(0, free - 16384 * 256 * 1024)  # without a model: room for the largest chunk
    times = {c: slow_copies.cost(32768, c, (free - c * 256 * 1024) // (4 * MIB)).total_seconds
             for c in range(QUANTUM, 16384 + 1, QUANTUM) if free >= c * 256 * 1024}
    assert chunk == min(times, key=lambda c: (times[c], -c))  # the model's own optimum
    allowance = planner.growth_allowance(free, unread_tokens=32768, cached_slots=0)
    assert allowance == free - chunk * 256 * 1024


def test_compute_bound_prefill_takes_the_biggest_chunk():
    planner = Planner(COSTS, PlannerConfig(), cost_model=_model(pcie_bytes_per_s=1e12))
    free = 2048 * MIB
    assert planner.fastest_chunk(free, unread_tokens=32768, cached_slots=0, max_chunk=16384) == 8192
    assert planner.growth_allowance(free, unread_tokens=32768) == 0


def test_explain_prints_memory_and_predicted_times():
    planner = Planner(COSTS, PlannerConfig(), cost_model=_model())
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)
    geometry = planner.plan(budget)
    text = planner.explain(budget, geometry, unread_tokens=8192, cached_slots=1000)
    assert "chunk 4,096" in text and "2 chunk(s)" in text and "GB/s" in text and "predicted" in text
    assert "predicted" not in planner.explain(budget, geometry)


def test_growth_that_prefill_does_not_fill_never_beats_the_bigger_chunk():
    planner = Planner(COSTS, PlannerConfig(), cost_model=_model(pcie_bytes_per_s=2e9, compute_flops_per_s=1e15))
    assert planner.fastest_chunk(8192 * MIB, unread_tokens=32768, cached_slots=0, max_chunk=16384) == 16384


def _reasons(planner: Planner, budget: PlannerBudget, unread_tokens: int | None = None,
             geometry: Geometry | None = None) -> str:
    geometry = geometry or planner.plan(budget, unread_tokens)
    return planner.explain(budget, geometry, unread_tokens)


def test_explain_names_the_limit_that_bound_the_chunk():
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)
    text = _reasons(Planner(COSTS, PlannerConfig()), budget)
    assert "chunk bound by the free memory outside the expert cache, where activations must live (1024.0 MiB: " \
           "4,096 tokens)" in text
    text = _reasons(Planner(COSTS, PlannerConfig()), budget, unread_tokens=300)
    assert "chunk bound by the unread prompt (300 tokens)" in text
    assert "chunk bound by planner.max_chunk_tokens (1,024)" in _reasons(
        Planner(COSTS, PlannerConfig(max_chunk_tokens=1024)), budget)
    assert "chunk bound by the context (1,000 tokens)" in _reasons(Planner(COSTS, PlannerConfig(), 1000), budget)
    borrowing = dataclasses.replace(COSTS, is_activation_borrowable=True)
    assert "chunk bound by the free memory left after the ring (1280.0 MiB: 5,120 tokens)" in _reasons(
        Planner(borrowing, PlannerConfig()), budget)


def test_explain_names_every_limit_that_binds_and_a_geometry_set_elsewhere():
    planner = Planner(COSTS, PlannerConfig(max_chunk_tokens=4096))
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)
    assert "chunk bound by planner.max_chunk_tokens (4,096) and the free memory outside" in _reasons(planner, budget)
    text = _reasons(planner, budget, geometry=Geometry(chunk_tokens=1024, ring_slots=64))
    assert "chunk 1,024 set outside the planner (for this budget it plans 4,096)" in text


def test_explain_names_the_limit_that_bound_the_ring():
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)
    assert "ring bound by the target of one layer's experts (64)" in _reasons(Planner(COSTS, PlannerConfig()), budget)
    assert "ring bound by planner.max_ring_slots (16)" in _reasons(
        Planner(COSTS, PlannerConfig(max_ring_slots=16)), budget)
    small_cache = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=40 * MIB)
    text = _reasons(Planner(COSTS, PlannerConfig()), small_cache)
    assert "ring bound by the borrowable expert cache (40.0 MiB)" in text and "ring 10 ×" in text
    dense = dataclasses.replace(COSTS, target_ring_slots=0, is_ring_in_cache=False)
    assert "no ring (no experts to stream)" in _reasons(Planner(dense, PlannerConfig()), budget)
