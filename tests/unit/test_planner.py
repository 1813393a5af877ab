"""The planner: memory geometry for a budget, and the cost model's split between chunk and cache."""

import dataclasses

import pytest

from strata.config import PlannerConfig
from strata.engine.planning.planner import CacheState, Planner, WorkspaceCosts
from strata.engine.planning.prefill_cost import PrefillCostModel
from strata.errors import AllocationError
from strata.hooktypes import Geometry, PlannerBudget

MIB = 1 << 20
COSTS = WorkspaceCosts(bytes_per_chunk_token=256 * 1024, bytes_per_ring_slot=4 * MIB, target_ring_slots=64,
                       is_ring_in_cache=True, segment_bytes=64 * MIB)
QUANTUM = PlannerConfig().chunk_quantum_tokens


def _model(**rates) -> PrefillCostModel:
    base = dict(weight_flops_per_token=6e9, attention_flops_per_pair=2.4e7, num_expert_slots=6144,
                slot_bytes=4 * MIB, pcie_bytes_per_s=55e9, compute_flops_per_s=20e12, chunk_overhead_s=0.05)
    return PrefillCostModel(**{**base, **rates})


def test_plan_is_the_largest_geometry_and_reproducible():
    planner = Planner(COSTS, PlannerConfig())
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)
    geometry = planner.plan(budget)
    # 1024 MiB free and 4 segments of the cache beyond the ring's 256 MiB, at 256 KiB a token
    assert geometry == Geometry(chunk_tokens=5120, ring_slots=64)
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


def test_copy_bound_prefill_keeps_the_cache_the_chunk_would_evict():
    # slow PCIe and a cache of every expert: an evicted one streams in every later chunk, so the
    # chunk stops at what free memory holds
    model = _model(pcie_bytes_per_s=2e9, compute_flops_per_s=1e15, num_expert_slots=2048, attention_flops_per_pair=0)
    planner = Planner(COSTS, PlannerConfig(), cost_model=model)
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=4096 * MIB)
    cache = CacheState(num_slots=2048, num_cached=2048)
    geometry, weighed = planner.weigh(budget, unread_tokens=32768, cache=cache)
    assert geometry.chunk_tokens == 4096 and weighed[0].geometry.chunk_tokens > 4096
    best = min(weighed, key=lambda c: (c.predicted_seconds, -c.geometry.chunk_tokens))
    assert best.geometry == geometry and best.num_evicted == 64  # the ring's slots only
    # without the cache's state the cache counts as empty: nothing to evict, so the biggest chunk
    assert planner.plan(budget, 32768) == weighed[0].geometry
    # without the prompt: the longest the context holds, weighed as a prompt of that length
    in_context = Planner(COSTS, PlannerConfig(), context_tokens=32769, cost_model=model)
    assert in_context.weigh(budget, None, cache) == in_context.weigh(budget, 32768, cache)


def test_compute_bound_prefill_borrows_the_cache_for_the_biggest_chunk():
    planner = Planner(COSTS, PlannerConfig(), cost_model=_model(pcie_bytes_per_s=1e12))
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=4096 * MIB)
    geometry = planner.plan(budget, unread_tokens=32768, cache=CacheState(num_slots=2048, num_cached=2048))
    assert geometry.chunk_tokens == 16384  # planner.max_chunk_tokens, far past what free memory holds


def test_borrowing_empty_slots_evicts_nothing_and_restaging_is_counted():
    planner = Planner(COSTS, PlannerConfig(), cost_model=_model())
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=4096 * MIB)
    geometry = Geometry(chunk_tokens=8192, ring_slots=64)  # 1024 MiB beyond free: 16 segments, 256 slots
    empty = planner.predict(budget, geometry, 32768, CacheState(num_slots=2048, num_cached=1024))
    full = planner.predict(budget, geometry, 32768, CacheState(num_slots=2048, num_cached=2048))
    assert empty.num_evicted == 0 and full.num_evicted == 64 + 256
    model = planner.cost_model
    assert full.predicted_seconds == pytest.approx(model.cost(32768, 8192, 2048 - 320).total_seconds
                                                   + model.restage_seconds(320))


def test_explain_prints_memory_and_predicted_times():
    planner = Planner(COSTS, PlannerConfig(), cost_model=_model())
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)
    geometry = planner.plan(budget)
    text = planner.explain(budget, geometry, unread_tokens=8192, cache=CacheState(2048, 1000))
    assert "chunk 5,120" in text and "2 chunk(s)" in text and "GB/s" in text and "predicted" in text
    assert "predicted" not in planner.explain(budget, geometry)


def _reasons(planner: Planner, budget: PlannerBudget, unread_tokens: int | None = None,
             geometry: Geometry | None = None) -> str:
    geometry = geometry or planner.plan(budget, unread_tokens)
    return planner.explain(budget, geometry, unread_tokens)


def test_explain_names_the_limit_that_bound_the_chunk():
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)
    text = _reasons(Planner(COSTS, PlannerConfig()), budget)
    assert "chunk bound by the free memory and the expert cache's segments left after the ring (1280.0 MiB: " \
           "5,120 tokens)" in text
    text = _reasons(Planner(COSTS, PlannerConfig()), budget, unread_tokens=300)
    assert "chunk bound by the unread prompt (300 tokens)" in text
    assert "chunk bound by planner.max_chunk_tokens (1,024)" in _reasons(
        Planner(COSTS, PlannerConfig(max_chunk_tokens=1024)), budget)
    assert "chunk bound by the context (1,000 tokens)" in _reasons(Planner(COSTS, PlannerConfig(), 1000), budget)
    whole_segments = dataclasses.replace(COSTS, segment_bytes=192 * MIB)  # one of 192 MiB in the 256 spare
    assert "(1216.0 MiB: 4,864 tokens)" in _reasons(Planner(whole_segments, PlannerConfig()), budget)


def test_explain_names_every_limit_that_binds_and_a_geometry_set_elsewhere():
    planner = Planner(COSTS, PlannerConfig(max_chunk_tokens=5120))
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)
    assert "chunk bound by planner.max_chunk_tokens (5,120) and the free memory and" in _reasons(planner, budget)
    text = _reasons(planner, budget, geometry=Geometry(chunk_tokens=1024, ring_slots=64))
    assert "chunk 1,024 set outside the planner (for this budget it plans 5,120)" in text


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


def test_fixed_chunk_and_ring_give_one_geometry_whatever_the_budget_or_the_cost_model():
    fixed = PlannerConfig(chunk_tokens=1024, ring_slots=32)
    planner = Planner(COSTS, fixed, cost_model=_model(pcie_bytes_per_s=1e12))
    cache = CacheState(num_slots=2048, num_cached=2048)
    for free in (1024, 4096):  # the loan's larger budget does not change it
        budget = PlannerBudget(free_bytes=free * MIB, borrowable_cache_bytes=4096 * MIB)
        assert planner.weigh(budget, unread_tokens=32768, cache=cache) == (Geometry(1024, 32), [])
    # one of the two fixed: the other is the largest that fits
    only_chunk = Planner(COSTS, PlannerConfig(chunk_tokens=1024))
    assert only_chunk.plan(PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=512 * MIB)) == Geometry(1024, 64)
    with pytest.raises(AllocationError, match=r"planner.chunk_tokens = 16384 and planner.ring_slots = 0 ask for"):
        Planner(COSTS, PlannerConfig(chunk_tokens=16384)).plan(PlannerBudget(free_bytes=1024 * MIB,
                                                                              borrowable_cache_bytes=512 * MIB))


def test_the_largest_dense_matrix_prefill_stages_as_float16_is_reserved():
    # gemm stages a dense matrix of a format its fused loop does not read (the I-quants' attention projections of
    # an IQ3_XXS mix) as float16: the planner keeps room for the largest; fused formats, routers, the routed
    # experts, the embedding and the heads (the MTP block's too) stage nothing, nor an MTP block that does not run
    from types import SimpleNamespace

    from strata.backend.cuda_ops import weight_scratch_bytes
    from strata.model.quants import QType

    def ref(qtype, *shape):
        return SimpleNamespace(qtype=qtype, shape=shape)

    tensors = {"blk.0.attn_q.weight": ref(QType.IQ2_S, 4096, 2048), "blk.0.attn_k.weight": ref(QType.IQ2_S, 512, 2048),
               "blk.0.attn_output.weight": ref(QType.Q4_K, 2048, 8192),
               "blk.0.ffn_gate_inp.weight": ref(QType.F32, 128, 8192),
               "blk.0.ffn_down_exps.weight": ref(QType.IQ3_XXS, 128, 2048, 768),
               "token_embd.weight": ref(QType.IQ3_S, 151936, 2048), "output.weight": ref(QType.Q5_K, 151936, 2048),
               "blk.2.nextn.embed_tokens.weight": ref(QType.IQ3_S, 151936, 2048),
               "blk.2.nextn.shared_head_head.weight": ref(QType.Q5_K, 151936, 2048)}
    model = SimpleNamespace(tensors=tensors)
    assert weight_scratch_bytes(model, 2, has_tensor_cores=True) == 2 * 4096 * 2048
    assert weight_scratch_bytes(model, 2, has_tensor_cores=False) == 0
    tensors["blk.1.attn_output.weight"] = ref(QType.Q5_K, 2048, 8192)
    assert weight_scratch_bytes(model, 2, has_tensor_cores=True) == 2 * 2048 * 8192
    tensors["blk.2.nextn.eh_proj.weight"] = ref(QType.BF16, 2048, 8192)  # the MTP block's projection of [x; h]
    assert weight_scratch_bytes(model, 2, has_tensor_cores=True) == 2 * 2048 * 8192
    tensors["blk.2.nextn.eh_proj.weight"] = ref(QType.BF16, 4096, 8192)
    assert weight_scratch_bytes(model, 3, has_tensor_cores=True) == 2 * 4096 * 8192
