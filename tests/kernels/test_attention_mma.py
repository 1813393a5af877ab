import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize as gguf_quantize
from kernel_data import dev, host, reference_dequant

from strata.backend.select import has_cuda_device
from strata.gpu.kernels import tensor_core
from strata.gpu.kernels._common import MAX_STATIC_SHARED_BYTES
from strata.gpu.kernels.attention import attention, uses_tensor_cores
from strata.gpu.kernels.attention_mma import (
    SERVING_CONFIG,
    MmaAttentionConfig,
    attention_mma,
    default_kv_tile,
    shared_bytes,
)
from strata.gpu.kernels.kvcache import empty_kv_layer
from strata.gpu.kernels.packing import pack, to_device
from strata.model import reference_ops

# Q (after scaling), K, V and P are rounded to f16 (relative error 2^-11 each), products and sums stay
# f32: outputs of O(1) inputs land within a few 1e-4 of the float64 reference.
F16_TOLERANCE = dict(rtol=1e-2, atol=2e-3)
TWIN = MmaAttentionConfig(kv_tile=16, use_tensor_cores=False)  # several tiles even at small kv lengths


def _cache(fmt, num_positions, width, seed):
    """A (K, V) cache pair on the device and the float values attention must see."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(2):
        values = rng.standard_normal((num_positions, width)).astype(np.float32)
        raw = gguf_quantize(values, QType[fmt]).view(np.uint8).reshape(num_positions, -1)
        pairs.append((to_device(pack(raw, fmt)), reference_dequant(raw, fmt)))
    return pairs


def _case(fmt, num_q_heads, num_kv_heads, head_dim, start_pos, num_tokens, seed):
    """(q, positions, caches, reference) for a chunk of num_tokens after start_pos cached tokens."""
    num_positions = start_pos + num_tokens + 3  # rows past kv_len exist and must stay unread
    (k_cache, k_values), (v_cache, v_values) = _cache(fmt, num_positions, num_kv_heads * head_dim, seed)
    q = np.random.default_rng(seed + 1).standard_normal((num_tokens, num_q_heads * head_dim)).astype(np.float32)
    positions = (start_pos + np.arange(num_tokens)).astype(np.int32)
    k3, v3 = (a.reshape(num_positions, num_kv_heads, head_dim) for a in (k_values, v_values))
    ref = reference_ops.attention(q.reshape(num_tokens, num_q_heads, head_dim), k3, v3, start_pos)
    return q, positions, (k_cache, v_cache), ref.reshape(num_tokens, -1)


def _run(q, positions, caches, num_q_heads, num_kv_heads, head_dim, config, f16_scratch=None):
    return host(attention_mma(dev(q), *caches, dev(positions), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, kv_len=int(positions[-1]) + 1, config=config,
                              f16_scratch=f16_scratch))


def _scratch(caches, extra_rows=5):
    """F16 matrices with rows to spare, NaN-filled: rows the dequantization skips stay NaN."""
    scratch = empty_kv_layer("F16", caches[0].num_rows + extra_rows, caches[0].num_cols)
    for matrix in scratch:
        matrix.quants.copy_to_device(np.full(matrix.quants.shape, np.nan, np.float16))
    return scratch


@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(2, 2), (4, 1)])
def test_twin_on_a_chunk_over_a_cache_with_history(fmt, num_q_heads, num_kv_heads):
    # 13 + 22 = 35 keys: two full 16-key tiles and a partial one; rows span two 64-row blocks when group > 1
    q, positions, caches, ref = _case(fmt, num_q_heads, num_kv_heads, 32, 13, 22, seed=80)
    out = _run(q, positions, caches, num_q_heads, num_kv_heads, 32, TWIN)
    np.testing.assert_allclose(out, ref, **F16_TOLERANCE)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_twin_over_a_dequantized_copy_equals_the_quantized_cache(fmt):
    # the copy holds the values the kernel stages from the quantized cache: the same sums, bit for bit
    _check_copy_equals_cache(fmt, 4, 2, 32, 13, 22, seed=81, config=TWIN)


def _check_copy_equals_cache(fmt, num_q_heads, num_kv_heads, head_dim, start_pos, num_tokens, seed, config):
    q, positions, caches, ref = _case(fmt, num_q_heads, num_kv_heads, head_dim, start_pos, num_tokens, seed)
    heads = (num_q_heads, num_kv_heads, head_dim)
    direct = _run(q, positions, caches, *heads, config)
    scratch = _scratch(caches)
    copied = _run(q, positions, caches, *heads, config, f16_scratch=scratch)
    np.testing.assert_array_equal(copied, direct)
    np.testing.assert_allclose(copied, ref, **F16_TOLERANCE)
    kv_len = int(positions[-1]) + 1
    for matrix in scratch:  # the copy holds the rows up to kv_len, and no further
        rows = matrix.quants.copy_to_host()
        assert not np.isnan(rows[:kv_len]).any() and np.isnan(rows[kv_len:]).all()


@pytest.mark.parametrize("start_pos, num_tokens", [(0, 1), (0, 17), (47, 2), (3, 70)])
def test_twin_at_tile_boundaries(start_pos, num_tokens):
    # group 2: 70 tokens are 140 rows, three 64-row blocks, the last mostly padding
    q, positions, caches, ref = _case("Q8_0", 2, 1, 32, start_pos, num_tokens, seed=81)
    out = _run(q, positions, caches, 2, 1, 32, TWIN)
    np.testing.assert_allclose(out, ref, **F16_TOLERANCE)


def test_twin_with_a_custom_scale_and_a_wide_tile():
    q, positions, caches, _ = _case("F16", 2, 1, 16, 4, 9, seed=82)
    k3, v3 = (host(c.quants).view(np.float16).astype(np.float32).reshape(-1, 1, 16) for c in caches)
    ref = reference_ops.attention(q.reshape(9, 2, 16) * (0.3 * math.sqrt(16)), k3, v3, 4).reshape(9, -1)
    out = attention_mma(q, *caches, positions, num_q_heads=2, num_kv_heads=1, head_dim=16, scale=0.3,
                        config=MmaAttentionConfig(kv_tile=32, use_tensor_cores=False))
    np.testing.assert_allclose(out, ref, **F16_TOLERANCE)


@pytest.mark.parametrize("fmt", ["F16", "Q4_0"])
def test_twin_with_eight_warps(fmt):
    # group 4, 40 tokens: 160 rows, one full 128-row block and one mostly padding
    q, positions, caches, ref = _case(fmt, 4, 1, 32, 9, 40, seed=87)
    out = _run(q, positions, caches, 4, 1, 32, TWIN._replace(warps=8))
    np.testing.assert_allclose(out, ref, **F16_TOLERANCE)


@pytest.mark.parametrize("warps, stages", [(4, 1), (4, 2), (8, 2)])
def test_fused_config_runs_the_twin_in_the_simulator(warps, stages):
    # the fused loop has the per-tile step's numerics; without tensor cores the twin serves it
    q, positions, caches, ref = _case("Q8_0", 2, 1, 32, 20, 11, seed=88)
    config = MmaAttentionConfig(use_tensor_cores=False, warps=warps, fused=True, stages=stages)
    out = _run(q, positions, caches, 2, 1, 32, config)
    np.testing.assert_allclose(out, ref, **F16_TOLERANCE)


def test_fused_layouts_fit_static_shared_memory():
    # Q's shared memory is reused for the K/V buffers: 64-key tiles single-buffered, 32 double-buffered
    assert default_kv_tile(128, fused=True, stages=1) == 64
    assert default_kv_tile(128, fused=True, stages=2) == 32
    assert default_kv_tile(128, warps=8, fused=True, stages=2) == 32
    assert default_kv_tile(64, fused=True, stages=2) == 64
    assert default_kv_tile(128, warps=8) == 16
    for warps, stages, kv_tile in ((4, 1, 64), (4, 2, 32), (8, 1, 64), (8, 2, 32)):
        assert shared_bytes(128, kv_tile, False, warps, True, stages) <= 48 * 1024


def test_attention_routes_prefill_to_the_tensor_core_kernel():
    assert uses_tensor_cores(5, 1, 64, "Q4_0") and uses_tensor_cores(4096, 1, 128, "F16")
    assert not uses_tensor_cores(4, 1, 64, "F16")  # decode-sized
    assert not uses_tensor_cores(8, 2, 64, "F16")  # split KV
    assert not uses_tensor_cores(8, 1, 32, "F16")  # no C++ tile step at this head dim
    q, positions, caches, ref = _case("Q4_0", 2, 1, 64, 2, 6, seed=83)
    out = host(attention(dev(q), *caches, dev(positions), num_q_heads=2, num_kv_heads=1, head_dim=64, kv_len=8))
    np.testing.assert_allclose(out, ref, **F16_TOLERANCE)


def test_default_tiles_fit_static_shared_memory():
    assert default_kv_tile(128) == 48 and default_kv_tile(64) == 64
    assert shared_bytes(128, 48, is_twin=False) <= 48 * 1024


def test_attention_mma_rejects_bad_arguments():
    (k_cache, _), (v_cache, _) = _cache("F16", 8, 32, seed=84)
    q = np.zeros((1, 64), np.float32)
    positions = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        attention_mma(q, k_cache, v_cache, positions, num_q_heads=3, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        attention_mma(q, k_cache, v_cache, positions, num_q_heads=8, num_kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="no tensor-core tile step"):
        attention_mma(q, k_cache, v_cache, positions, num_q_heads=2, num_kv_heads=1, head_dim=32,
                      config=MmaAttentionConfig(use_tensor_cores=True))
    with pytest.raises(ValueError, match="kv_tile must be one of"):
        attention_mma(q, k_cache, v_cache, positions, num_q_heads=2, num_kv_heads=1, head_dim=32,
                      config=MmaAttentionConfig(kv_tile=24, use_tensor_cores=False))
    with pytest.raises(ValueError, match="warps must be one of"):
        attention_mma(q, k_cache, v_cache, positions, num_q_heads=2, num_kv_heads=1, head_dim=32,
                      config=MmaAttentionConfig(warps=6, use_tensor_cores=False))
    with pytest.raises(ValueError, match="stages must be one of"):
        attention_mma(q, k_cache, v_cache, positions, num_q_heads=2, num_kv_heads=1, head_dim=32,
                      config=MmaAttentionConfig(fused=True, stages=3, use_tensor_cores=False))
    with pytest.raises(ValueError, match="needs .* bytes of shared memory"):
        attention_mma(q, k_cache, v_cache, positions, num_q_heads=2, num_kv_heads=1, head_dim=128,
                      config=MmaAttentionConfig(kv_tile=48, fused=True, stages=2, use_tensor_cores=True))
    ffma = MmaAttentionConfig(use_tensor_cores=False)  # head_dim 32 has no tensor-core tile step on a GPU
    with pytest.raises(ValueError, match=r"kv_len must lie in \[0, 8\]"):
        attention_mma(q, k_cache, v_cache, positions, num_q_heads=2, num_kv_heads=1, head_dim=32, kv_len=9,
                      config=ffma)
    with pytest.raises(TypeError, match="q must have dtype float32"):
        attention_mma(q.astype(np.float64), k_cache, v_cache, positions, num_q_heads=2, num_kv_heads=1, head_dim=32,
                      config=ffma)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda_device(), reason="needs a real CUDA device (not the simulator)")
@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("head_dim, kv_tile", [(64, 64), (64, 16), (128, 48), (128, 32)])
def test_tensor_cores_equal_the_twin_and_the_reference(fmt, head_dim, kv_tile):
    assert tensor_core.is_available()
    q, positions, caches, ref = _case(fmt, 8, 2, head_dim, 37, 150, seed=85)
    cpp = _run(q, positions, caches, 8, 2, head_dim, MmaAttentionConfig(kv_tile=kv_tile, use_tensor_cores=True))
    np.testing.assert_allclose(cpp, ref, **F16_TOLERANCE)
    if shared_bytes(head_dim, kv_tile, is_twin=True) <= 48 * 1024:
        twin = _run(q, positions, caches, 8, 2, head_dim, MmaAttentionConfig(kv_tile=kv_tile, use_tensor_cores=False))
        # same roundings, but exp2 and the sum order differ, which can move a probability across an
        # f16 rounding step (2^-11 relative): a few outputs differ by ~1e-4 absolute
        np.testing.assert_allclose(cpp, twin, rtol=1e-3, atol=5e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda_device(), reason="needs a real CUDA device (not the simulator)")
def test_tensor_cores_with_link_time_optimization():
    q, positions, caches, ref = _case("Q4_0", 32, 4, 128, 100, 300, seed=86)
    out = _run(q, positions, caches, 32, 4, 128, MmaAttentionConfig(lto=True))
    np.testing.assert_allclose(out, ref, **F16_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda_device(), reason="needs a real CUDA device (not the simulator)")
@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("head_dim, kv_tile", [(128, 0), (128, 16), (64, 0)])
def test_eight_warps_on_tensor_cores(fmt, head_dim, kv_tile):
    q, positions, caches, ref = _case(fmt, 8, 2, head_dim, 37, 150, seed=89)
    out = _run(q, positions, caches, 8, 2, head_dim, MmaAttentionConfig(kv_tile=kv_tile, use_tensor_cores=True,
                                                                         warps=8))
    np.testing.assert_allclose(out, ref, **F16_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda_device(), reason="needs a real CUDA device (not the simulator)")
@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("head_dim, kv_tile, warps, stages", [
    (128, 32, 4, 2), (128, 64, 4, 1), (128, 32, 8, 2), (128, 16, 8, 1), (64, 64, 4, 2), (64, 16, 8, 2),
])
def test_fused_loop_equals_the_tile_step_and_the_reference(fmt, head_dim, kv_tile, warps, stages):
    q, positions, caches, ref = _case(fmt, 8, 2, head_dim, 37, 150, seed=90)
    fused = _run(q, positions, caches, 8, 2, head_dim, MmaAttentionConfig(
        kv_tile=kv_tile, use_tensor_cores=True, warps=warps, fused=True, stages=stages))
    np.testing.assert_allclose(fused, ref, **F16_TOLERANCE)
    # same fragments, same order of operations; only the staging code differs, and it rounds the same way
    # (the unfused kernel keeps Q beside one K/V tile pair, which a 64-row tile at head_dim 128 overflows)
    if shared_bytes(head_dim, kv_tile, False, warps) <= MAX_STATIC_SHARED_BYTES:
        step = _run(q, positions, caches, 8, 2, head_dim, MmaAttentionConfig(kv_tile=kv_tile, use_tensor_cores=True,
                                                                              warps=warps))
        np.testing.assert_allclose(fused, step, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda_device(), reason="needs a real CUDA device (not the simulator)")
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_serving_kernel_over_a_dequantized_copy_equals_the_quantized_cache(fmt):
    _check_copy_equals_cache(fmt, 32, 4, 128, 100, 300, seed=91, config=SERVING_CONFIG)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda_device(), reason="needs a real CUDA device (not the simulator)")
@pytest.mark.parametrize("fmt", ["F16", "Q4_0"])
def test_fused_loop_with_link_time_optimization_at_qwen3_shapes(fmt):
    q, positions, caches, ref = _case(fmt, 32, 4, 128, 100, 300, seed=91)
    out = _run(q, positions, caches, 32, 4, 128, MmaAttentionConfig(fused=True, lto=True, warps=8))
    np.testing.assert_allclose(out, ref, **F16_TOLERANCE)
