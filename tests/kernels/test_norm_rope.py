import numpy as np
import pytest
from kernel_data import dev, host
from numba import cuda

from strata.gpu.kernels.block_reduce import (
    device_block_sum_serial,
    device_block_sum_tree,
)
from strata.gpu.kernels.norm import head_rms_norm, rms_norm
from strata.gpu.kernels.rope import head_norm_rope, rope_inv_freq
from strata.model import reference_ops

HEAD_DIM = 16


def _heads(x, head_dim=HEAD_DIM):
    return x.reshape(x.shape[0], -1, head_dim)


def test_rms_norm_rows_float32_and_float16():
    rng = np.random.default_rng(50)
    weight = rng.uniform(0.5, 1.5, 70).astype(np.float32)
    for dtype in (np.float32, np.float16):
        x = (rng.standard_normal((3, 70)) * 4).astype(dtype)
        out = host(rms_norm(dev(x), dev(weight), 1e-6, threads=32))
        np.testing.assert_allclose(out, reference_ops.rms_norm(x.astype(np.float32), weight, 1e-6),
                                   rtol=2e-6, atol=1e-6)


def test_head_rms_norm_in_place():
    rng = np.random.default_rng(51)
    x = rng.standard_normal((2, 3 * HEAD_DIM)).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, HEAD_DIM).astype(np.float32)
    x_dev = dev(x)
    head_rms_norm(x_dev, dev(weight), HEAD_DIM, eps=1e-6)
    ref = reference_ops.rms_norm(_heads(x), weight, 1e-6).reshape(x.shape)
    np.testing.assert_allclose(host(x_dev), ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["neox", "normal"])
def test_qk_norm_then_rope_matches_reference(mode):
    rng = np.random.default_rng(52)
    num_tokens, num_q_heads, num_k_heads = 3, 4, 2
    q = rng.standard_normal((num_tokens, num_q_heads * HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((num_tokens, num_k_heads * HEAD_DIM)).astype(np.float32)
    q_w, k_w = (rng.uniform(0.5, 1.5, HEAD_DIM).astype(np.float32) for _ in range(2))
    positions = np.array([0, 4093, 120001], dtype=np.int32)  # far positions check the angle precision
    q_dev, k_dev = dev(q), dev(k)
    head_norm_rope(q_dev, k_dev, dev(positions), head_dim=HEAD_DIM, q_norm_weight=dev(q_w), k_norm_weight=dev(k_w),
                   eps=1e-6, rope_mode=mode, freq_base=10000.0)
    cos, sin = reference_ops.rope_angles(positions, HEAD_DIM, 10000.0)
    for got, x, w in ((q_dev, q, q_w), (k_dev, k, k_w)):
        ref = reference_ops.rope(reference_ops.rms_norm(_heads(x), w, 1e-6), cos, sin, is_neox=mode == "neox")
        np.testing.assert_allclose(host(got), ref.reshape(x.shape), rtol=1e-5, atol=2e-6)


def test_partial_rope_with_frequency_factors_passes_the_tail_through():
    rng = np.random.default_rng(53)
    q = rng.standard_normal((2, 2 * HEAD_DIM)).astype(np.float32)
    positions = np.array([3, 70000], dtype=np.int32)
    factors = np.array([1.0, 2.0, 8.0, 32.0], np.float32)  # llama's rope_freqs
    q_dev = dev(q)
    head_norm_rope(q_dev, None, dev(positions), head_dim=HEAD_DIM, rope_mode="neox", rope_dims=8,
                   inv_freq=dev(rope_inv_freq(1e6, 8, factors)))
    cos, sin = reference_ops.rope_angles(positions, 8, 1e6, factors)
    ref = reference_ops.rope(_heads(q), cos, sin, is_neox=True).reshape(q.shape)
    np.testing.assert_allclose(host(q_dev), ref, rtol=1e-5, atol=2e-6)
    assert not np.allclose(ref, q)  # the rotation did something to compare against


def test_rope_rejects_bad_arguments():
    q = np.zeros((2, 32), np.float32)
    with pytest.raises(ValueError, match="positions are required"):
        head_norm_rope(q, head_dim=16)
    with pytest.raises(ValueError, match="rope_mode"):
        head_norm_rope(q, positions=np.zeros(2, np.int32), head_dim=16, rope_mode="yarn")
    with pytest.raises(ValueError, match="whole number of 12-wide heads"):
        head_norm_rope(q, positions=np.zeros(2, np.int32), head_dim=12)
    with pytest.raises(ValueError, match="k_norm_weight is required"):
        head_norm_rope(q, q, np.zeros(2, np.int32), head_dim=16, q_norm_weight=np.ones(16, np.float32))


def test_host_arrays_work_too():
    # NumPy inputs are copied to the device and back around the launch: nothing may come back stale
    rng = np.random.default_rng(54)
    q = rng.standard_normal((2, 2 * HEAD_DIM)).astype(np.float32)
    positions = np.array([5, 9], dtype=np.int32)
    out = q.copy()
    head_norm_rope(out, None, positions, head_dim=HEAD_DIM, rope_mode="normal", freq_base=1e4)
    cos, sin = reference_ops.rope_angles(positions, HEAD_DIM, 1e4)
    ref = reference_ops.rope(_heads(q), cos, sin, is_neox=False).reshape(q.shape)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)


@cuda.jit
def _block_sum_kernel(values, is_tree, out):
    red = cuda.shared.array(64, np.float32)
    tid = cuda.threadIdx.x
    if is_tree:
        out[tid] = device_block_sum_tree(values[tid], red, tid, cuda.blockDim.x)
    else:
        out[tid] = device_block_sum_serial(values[tid], red, tid, cuda.blockDim.x)


@pytest.mark.parametrize("is_tree", [True, False])
@pytest.mark.parametrize("num_threads", [1, 5, 40, 64])
def test_block_sum_gives_every_thread_the_same_total_at_any_thread_count(num_threads, is_tree):
    values = np.random.default_rng(56).standard_normal(num_threads).astype(np.float32)
    out = dev(np.zeros(num_threads, np.float32))
    _block_sum_kernel[1, num_threads](dev(values), is_tree, out)
    totals = host(out)
    assert np.all(totals == totals[0])
    np.testing.assert_allclose(totals[0], values.astype(np.float64).sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("rope_mode", ["neox", "normal"])
def test_the_fused_cache_write_equals_the_head_kernel_then_append_kv(fmt, rope_mode):
    from strata.gpu.kernels.kvcache import append_kv, empty_kv_layer
    from strata.gpu.kernels.packing import unpack

    head_dim, num_q, num_k, cells = 64, 4, 2, 9  # two 32-element blocks a head
    rng = np.random.default_rng(52)
    q = rng.standard_normal((3, num_q * head_dim)).astype(np.float32)
    k = (rng.standard_normal((3, num_k * head_dim)) * 3).astype(np.float32)
    v = (rng.standard_normal((3, num_k * head_dim)) * 2).astype(np.float32)
    q_w, k_w = (rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2))
    positions = np.array([7, -1, 2], np.int32)  # a row outside the caches is skipped, as append_kv skips it
    args = dict(head_dim=head_dim, q_norm_weight=dev(q_w), k_norm_weight=dev(k_w), rope_mode=rope_mode,
                rope_dims=48, freq_base=1e4)

    q1, k1 = dev(q), dev(k)
    head_norm_rope(q1, k1, dev(positions), **args)
    caches1 = empty_kv_layer(fmt, cells, num_k * head_dim)
    append_kv(*caches1, k1, dev(v), dev(positions))

    q2, k2 = dev(q), dev(k)
    caches2 = empty_kv_layer(fmt, cells, num_k * head_dim)
    head_norm_rope(q2, k2, dev(positions), v=dev(v), k_cache=caches2[0], v_cache=caches2[1], **args)

    np.testing.assert_array_equal(host(q2), host(q1))
    np.testing.assert_array_equal(host(k2), host(k1))
    for fused, separate in zip(caches2, caches1):
        np.testing.assert_array_equal(unpack(fused), unpack(separate))
    assert unpack(caches2[0])[7].any() and not unpack(caches2[0])[[0, 1, 3, 4, 5, 6, 8]].any()


def test_the_fused_cache_write_refuses_what_append_kv_refuses():
    from strata.gpu.kernels.kvcache import empty_kv_layer

    q, k = dev(np.zeros((1, 64), np.float32)), dev(np.zeros((1, 64), np.float32))
    k_cache, v_cache = empty_kv_layer("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="k, v and positions"):
        head_norm_rope(q, k, dev(np.zeros(1, np.int32)), head_dim=64, k_cache=k_cache, v_cache=v_cache)
    _, wide = empty_kv_layer("Q4_0", 4, 128)
    with pytest.raises(ValueError, match="caches must be"):
        head_norm_rope(q, k, dev(np.zeros(1, np.int32)), head_dim=64, v=k, k_cache=k_cache, v_cache=wide)
