"""Prefill's routed-expert sums in 64-bit fixed point: against the reference MoE, and the same bits whatever
order and batches the experts are added in (runtime.deterministic)."""

import numpy as np
import pytest
from kernel_data import assert_close_to_scale, dev, host, random_matrix
from numba import cuda

from strata.gpu.kernels import moe, tensor_core
from strata.gpu.kernels.fixed_sums import (
    MAX_PRODUCT,
    POISON,
    POISON_FLOOR,
    UNITS,
    add_fixed_sums,
    fixed_sums,
    to_units,
)
from strata.gpu.kernels.gemm_config import GemmConfig, default_config
from strata.gpu.kernels.moe import moe_experts_prefill
from strata.gpu.kernels.moe_route import moe_group
from strata.model import reference_ops

GEMM_TINY = GemmConfig(block_m=8, block_n=8, thread_m=2, thread_n=2)
needs_tensor_cores = pytest.mark.skipif(not tensor_core.is_available(), reason="needs a GPU with tensor cores")


def _experts(fmt, num_slots, dim, ffn, seed):
    gate, gate_v = random_matrix(fmt, num_slots * ffn, dim, seed, 1.0 / 128)
    up, up_v = random_matrix(fmt, num_slots * ffn, dim, seed + 1, 1.0 / 128)
    down, down_v = random_matrix(fmt, num_slots * dim, ffn, seed + 2, 1.0 / 128)
    return (gate, up, down), (gate_v.reshape(num_slots, ffn, dim), up_v.reshape(num_slots, ffn, dim),
                              down_v.reshape(num_slots, dim, ffn))


def test_fold_adds_the_units_and_zeroes_the_sums():
    residual = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]], np.float32)
    units = np.array([[2**32, -(2**31), 3], [-(2**33) - 1, 0, 2**40]], np.int64)
    sums = fixed_sums(units.shape, dev(residual))
    assert host(sums).dtype == np.int64 and not host(sums).any()
    sums = dev(units)
    y = dev(residual)
    add_fixed_sums(y, sums)
    expected = (residual.astype(np.float64) + units / UNITS).astype(np.float32)
    np.testing.assert_array_equal(host(y), expected)


@cuda.jit
def _units_kernel(values, units, total):  # units [n] = to_units(values [n]); total [1] += each
    i = cuda.grid(1)
    if i < values.shape[0]:
        units[i] = to_units(values[i])
        cuda.atomic.add(total, 0, units[i])


def _units(values):
    values = np.asarray(values, np.float32)
    units, total = dev(np.zeros(len(values), np.int64)), dev(np.zeros(1, np.int64))
    _units_kernel[1, 32](dev(values), units, total)
    return host(units), total


def test_products_become_units_rounded_half_to_even_and_poison_past_their_range():
    tiny = 2.0**-32
    units, _ = _units([1.5 * tiny, 2.5 * tiny, -1.5 * tiny, 1.0, -0.75, MAX_PRODUCT * 0.999, MAX_PRODUCT, np.inf,
                       -np.inf, np.nan])
    assert list(units[:5]) == [2, 2, -2, 2**32, -(3 << 30)]
    assert units[5] == round(np.float32(MAX_PRODUCT * 0.999) * 2.0**32) < POISON_FLOOR // 32
    assert list(units[6:]) == [POISON] * 4  # at the range's end, and every non-finite value


def test_a_poisoned_sum_folds_to_nan_and_the_others_add_up():
    for values, is_poisoned in (([0.25, -1.0, 3.0] * 10, False), ([0.25, np.nan, 3.0], True),
                                ([MAX_PRODUCT * 0.99] * 32, False), ([-MAX_PRODUCT * 0.99] * 31 + [np.inf], True)):
        _, total = _units(values)
        y = dev(np.array([0.5], np.float32))
        add_fixed_sums(y, total.reshape(1))
        if is_poisoned:
            assert np.isnan(host(y)[0])
        else:
            assert host(y)[0] == np.float32(0.5 + sum(float(np.float32(v)) for v in values))


def test_fold_checks_its_arrays():
    with pytest.raises(TypeError, match="sums must have dtype int64"):
        add_fixed_sums(dev(np.zeros((2, 3), np.float32)), dev(np.zeros((2, 3), np.float32)))
    with pytest.raises(ValueError, match="sums"):
        add_fixed_sums(dev(np.zeros((2, 3), np.float32)), dev(np.zeros((3, 2), np.int64)))


def _run(x, groups, experts, tables, num_tokens, dim, num_slots, is_fixed, config=None):
    """The MoE of every table's experts, launch after launch, into the float32 residual or fixed sums."""
    residual = np.linspace(-1.0, 1.0, num_tokens * dim, dtype=np.float32).reshape(num_tokens, dim)
    out = dev(residual)
    sums = fixed_sums((num_tokens, dim), out) if is_fixed else out
    for table in tables:
        moe_experts_prefill(x, groups, *experts, sums, num_experts=num_slots, slot_of_expert=dev(table),
                            config=config)
    if is_fixed:
        add_fixed_sums(out, sums)
    return host(out), residual


@pytest.mark.parametrize("use_tensor_cores", [False, pytest.param(True, marks=needs_tensor_cores)])
def test_fixed_sums_match_the_reference_and_do_not_depend_on_the_batches(use_tensor_cores):
    # experts 0..3 in slots 5, 2, 0, 3: all in one launch, or two batches in either order
    num_tokens, num_experts, num_slots, top_k = (150, 4, 6, 3) if use_tensor_cores else (11, 4, 6, 3)
    dim, ffn = (128, 128) if use_tensor_cores else (32, 32)
    fmt = "Q4_0"
    experts, values = _experts(fmt, num_slots, dim, ffn, seed=311)
    rng = np.random.default_rng(312)
    x_host = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    ids, weights = reference_ops.route(rng.standard_normal((num_tokens, num_experts)), top_k)
    ids, weights = ids.astype(np.int32), weights.astype(np.float32)
    config = None if use_tensor_cores else GEMM_TINY
    block_m = moe.prefill_tile_rows(num_tokens * top_k, num_experts, (fmt,) * 3, dim, ffn) if use_tensor_cores \
        else GEMM_TINY.block_m
    groups = moe_group(dev(ids), dev(weights), num_experts, block_m)
    x = dev(x_host)
    every = np.array([5, 2, 0, 3], np.int32)
    first, second = np.array([5, -1, 0, -1], np.int32), np.array([-1, 2, -1, 3], np.int32)
    runs = [_run(x, groups, experts, tables, num_tokens, dim, num_slots, True, config)[0]
            for tables in ((every,), (first, second), (second, first))]
    np.testing.assert_array_equal(runs[1], runs[0])
    np.testing.assert_array_equal(runs[2], runs[0])
    floats, residual = _run(x, groups, experts, (first, second), num_tokens, dim, num_slots, False, config)
    if not use_tensor_cores:  # the control: float sums of these batches in the other order differ (in 1 entry)
        other_order, _ = _run(x, groups, experts, (second, first), num_tokens, dim, num_slots, False, config)
        assert np.any(other_order != floats)
    slots = [5, 2, 0, 3]
    expected = residual + reference_ops.moe(x_host, ids, weights, *(v[slots] for v in values))
    tolerance = 5e-3 if use_tensor_cores else 2e-6  # tensor cores: float16 X and hidden
    assert_close_to_scale(runs[0], expected, tolerance)
    assert_close_to_scale(floats, expected, tolerance)


@needs_tensor_cores
def test_fixed_sums_on_the_tile_kernels_with_tensor_cores():
    # moe.py's mma tiles (add_pairs' fixed-point call), not moe_rows
    num_tokens, num_experts, top_k, dim, ffn = 70, 4, 2, 128, 128
    experts, values = _experts("Q8_0", num_experts, dim, ffn, seed=321)
    rng = np.random.default_rng(322)
    x_host = 0.5 * rng.standard_normal((num_tokens, dim)).astype(np.float32)
    ids, weights = reference_ops.route(rng.standard_normal((num_tokens, num_experts)), top_k)
    config = default_config("Q8_0", "Q8_0", "Q8_0", block_m=64)
    groups = moe_group(dev(ids.astype(np.int32)), dev(weights.astype(np.float32)), num_experts, config.block_m)
    table = np.arange(num_experts, dtype=np.int32)
    fixed, residual = _run(dev(x_host), groups, experts, (table,), num_tokens, dim, num_experts, True, config)
    expected = residual + reference_ops.moe(x_host, ids, weights, *values)
    assert_close_to_scale(fixed, expected, 5e-3)
