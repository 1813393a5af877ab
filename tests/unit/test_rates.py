"""The cost model's rates: the PCIe probe's fit, a configured rate winning, and the compute rate
calibrated from chunk timings (fakes made from a known rate), which later plans then use."""

import numpy as np
import pytest

from strata.config import PlannerConfig
from strata.engine.planning.planner import CacheState, Planner, WorkspaceCosts
from strata.engine.planning.prefill_cost import PrefillCostModel
from strata.engine.planning.rates import (
    ASSUMED_COMPUTE_FLOPS_PER_S,
    ASSUMED_PCIE_BYTES_PER_S,
    ChunkTiming,
    PrefillRates,
    Rate,
    pcie_rate,
    probed_pcie,
)
from strata.hooktypes import PlannerBudget

MIB = 1 << 20
COSTS = WorkspaceCosts(bytes_per_chunk_token=256 * 1024, bytes_per_ring_slot=4 * MIB, target_ring_slots=64,
                       is_ring_in_cache=True, segment_bytes=64 * MIB)
MODEL = PrefillCostModel(weight_flops_per_token=6e9, attention_flops_per_pair=2.4e7, num_expert_slots=2048,
                         slot_bytes=4 * MIB, pcie_bytes_per_s=55e9, compute_flops_per_s=20e12, chunk_overhead_s=0.05)


def _timed(model: PrefillCostModel, num_tokens: int, start: int, streamed_bytes: int, pcie: float,
           compute: float, rng: np.random.Generator, noise: float = 0.0) -> ChunkTiming:
    """A chunk as the cost model says a device of these rates runs it, with relative noise."""
    seconds = max(streamed_bytes / pcie, model.chunk_flops(num_tokens, start) / compute) + model.chunk_overhead_s
    return ChunkTiming(num_tokens, start, streamed_bytes, seconds * (1 + noise * rng.standard_normal()))


def test_the_probe_rate_is_the_slope_so_a_fixed_latency_per_copy_does_not_lower_it():
    rng = np.random.default_rng(0)
    sizes = [4 * MIB, 16 * MIB, 64 * MIB] * 4
    samples = [(b, 20e-6 + b / 48e9 * (1 + 0.002 * rng.standard_normal())) for b in sizes]
    assert pcie_rate(samples) == pytest.approx(48e9, rel=0.01)
    assert sum(b for b, _ in samples) / sum(s for _, s in samples) < 47.5e9  # what bytes over seconds would say
    assert pcie_rate([(64 * MIB, 64 * MIB / 30e9)] * 3) == pytest.approx(30e9)  # one size: bytes over seconds


def test_a_probe_is_labelled_measured_and_no_device_is_labelled_assumed():
    measured = probed_pcie([(4 * MIB, 4 * MIB / 25e9), (64 * MIB, 64 * MIB / 25e9)], "cuda", 0.12)
    assert measured.value == pytest.approx(25e9) and measured.source.startswith("measured at load: 2 pinned copies")
    assert "4-64 MiB in 0.12 s" in measured.source
    for backend in ("numpy", "cudasim"):
        assumed = probed_pcie(None, backend)
        assert assumed.value == ASSUMED_PCIE_BYTES_PER_S and f"assumed: {backend} backend, no GPU" in assumed.source


def test_a_configured_rate_wins_over_the_probe_and_over_every_chunk():
    probe = Rate(25e9, "measured at load")
    rates = PrefillRates.from_config(PlannerConfig(pcie_bytes_per_s=40e9, compute_flops_per_s=90e12), probe)
    assert rates.pcie == Rate(40e9, "configured by planner.pcie_bytes_per_s")
    assert rates.compute == Rate(90e12, "configured by planner.compute_flops_per_s")
    rates.record(MODEL, [ChunkTiming(4096, 0, 0, 0.01)] * 3)
    assert rates.compute.value == 90e12 and rates.num_chunks == 0
    measured = PrefillRates.from_config(PlannerConfig(), probe)
    assert measured.pcie is probe and measured.compute.value == ASSUMED_COMPUTE_FLOPS_PER_S
    assert "assumed until a prefill chunk" in measured.compute.source


def test_compute_bound_chunks_calibrate_the_rate_they_ran_at():
    rng = np.random.default_rng(1)
    rates = PrefillRates(Rate(50e9, "measured"), Rate(ASSUMED_COMPUTE_FLOPS_PER_S, "assumed"), is_calibrated=True)
    chunks = [_timed(MODEL, 4096, start, 100 * 4 * MIB, 50e9, 150e12, rng, noise=0.02)
              for start in range(0, 32768, 4096)]
    rates.record(MODEL, chunks)
    assert rates.compute.value == pytest.approx(150e12, rel=0.05)
    assert rates.num_chunks == 8 and rates.compute.source == "calibrated from 8 compute-bound prefill chunk(s)"
    # the machine slows down: later chunks outweigh earlier ones (each halves the weight before it)
    rates.record(MODEL, [_timed(MODEL, 4096, 0, 0, 50e9, 60e12, rng)] * 10)
    assert rates.compute.value == pytest.approx(60e12, rel=0.05)


def test_a_copy_bound_chunk_only_raises_the_rate_to_the_floor_it_shows():
    rates = PrefillRates(Rate(10e9, "measured"), Rate(1e12, "assumed"), is_calibrated=True)
    # 2048 slots of 4 MiB at 10 GB/s: 0.86 s of copies; 1024 tokens of compute at 100 TFLOP/s: 0.07 s
    chunk = _timed(MODEL, 1024, 0, 2048 * 4 * MIB, 10e9, 100e12, np.random.default_rng(2))
    rates.record(MODEL, [chunk])
    floor = MODEL.chunk_flops(1024, 0) / (chunk.seconds - MODEL.chunk_overhead_s)
    assert rates.num_chunks == 0 and rates.compute.value == pytest.approx(floor)
    assert "floored by 1 copy-bound" in rates.compute.source
    rates.record(MODEL, [chunk])  # a floor below the rate changes nothing
    assert rates.compute.value == pytest.approx(floor) and rates.num_bound_chunks == 1
    # copies not overlapped (a ring of one slot): the chunk's compute is what its copies leave
    serial = ChunkTiming(1024, 0, 2048 * 4 * MIB, 2048 * 4 * MIB / 10e9 + MODEL.chunk_flops(1024, 0) / 5e12
                         + MODEL.chunk_overhead_s, is_overlapped=False)
    rates.record(MODEL, [serial])
    assert rates.num_chunks == 1 and rates.compute.value == pytest.approx(5e12)


def test_the_planner_plans_with_the_calibrated_rate_for_later_requests():
    # slow PCIe and a full cache: the faster the compute, the less a chunk hides the experts its
    # workspace evicts, so the calibrated rate moves the plan to where a planner told the true rate puts it
    model = PrefillCostModel(**{**MODEL.__dict__, "attention_flops_per_pair": 0.0})
    rates = PrefillRates(Rate(2e9, "measured"), Rate(1e12, "assumed"), is_calibrated=True)
    planner = Planner(COSTS, PlannerConfig(), cost_model=model, rates=rates)
    budget = PlannerBudget(free_bytes=1024 * MIB, borrowable_cache_bytes=4096 * MIB)
    cache = CacheState(num_slots=2048, num_cached=2048)
    before = planner.plan(budget, 32768, cache)
    rng = np.random.default_rng(3)
    # an earlier request whose experts were all cached: nothing streamed, its chunks compute-bound
    planner.calibrate([_timed(model, 4096, start, 0, 2e9, 1e15, rng, noise=0.01) for start in range(0, 16384, 4096)])
    assert planner.cost_model.compute_flops_per_s == pytest.approx(1e15, rel=0.05)
    told = Planner(COSTS, PlannerConfig(), cost_model=PrefillCostModel(**{**model.__dict__, "pcie_bytes_per_s": 2e9,
                                                                          "compute_flops_per_s": 1e15}))
    after = planner.plan(budget, 32768, cache)
    assert after == told.plan(budget, 32768, cache) and after.chunk_tokens == 4096 < before.chunk_tokens
