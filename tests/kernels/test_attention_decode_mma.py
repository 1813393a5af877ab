import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize as gguf_quantize
from kernel_data import dev, host, reference_dequant

from strata.gpu.kernels import attention_decode_mma, tensor_core
from strata.gpu.kernels.attention import attention, split_partial_shapes
from strata.gpu.kernels.packing import pack, to_device
from strata.model import reference_ops

# Q (after scaling), K, V and P are rounded to f16, products and sums stay f32 (as test_attention_mma)
F16_TOLERANCE = dict(rtol=1e-2, atol=2e-3)


def _case(fmt, num_q_heads, num_kv_heads, head_dim, num_positions, seed):
    """(q [1, Hq * d], K and V caches on the device, their float values [P, Hkv, d])."""
    rng = np.random.default_rng(seed)
    caches, values = [], []
    for _ in range(2):
        x = rng.standard_normal((num_positions, num_kv_heads * head_dim)).astype(np.float32)
        raw = gguf_quantize(x, QType[fmt]).view(np.uint8).reshape(num_positions, -1)
        caches.append(to_device(pack(raw, fmt)))
        values.append(reference_dequant(raw, fmt).reshape(num_positions, num_kv_heads, head_dim))
    q = rng.standard_normal((1, num_q_heads * head_dim)).astype(np.float32)
    return q, caches, values


def _reference(q, values, position, num_q_heads, head_dim):
    return reference_ops.attention(q.reshape(1, num_q_heads, head_dim), *values, position).reshape(1, -1)


def _nan_workspace(num_splits, num_q_heads, head_dim):
    """Preallocated split partials full of NaN, as the engine's decode step passes them."""
    if num_splits == 1:
        return None
    return tuple(dev(np.full(shape, np.nan, np.float32))
                 for shape in split_partial_shapes(num_splits, 1, num_q_heads, head_dim))


def _attend(q, caches, position, num_q_heads, num_kv_heads, head_dim, num_splits, kv_len, **kwargs):
    out = attention(dev(q), *caches, dev(np.array([position], np.int32)), num_q_heads=num_q_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, kv_len=kv_len, num_splits=num_splits,
                    workspace=_nan_workspace(num_splits, num_q_heads, head_dim), use_direct_decode=False, **kwargs)
    return host(out)


@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_one_token_over_several_tiles_and_splits(fmt, num_splits):
    # a group of 8 query heads (Qwen3-30B-A3B's) in one block; 147 keys: whole tiles and a partial
    # one, splits that end inside the context and one cut by the position
    num_q_heads, num_kv_heads, head_dim, kv_len = 16, 2, 64, 147
    assert attention_decode_mma.is_supported(head_dim, num_q_heads // num_kv_heads)
    q, caches, values = _case(fmt, num_q_heads, num_kv_heads, head_dim, kv_len + 5, seed=90)
    out = _attend(q, caches, kv_len - 1, num_q_heads, num_kv_heads, head_dim, num_splits, kv_len + 5,
                  is_len_from_positions=True)
    np.testing.assert_allclose(out, _reference(q, values, kv_len - 1, num_q_heads, head_dim), **F16_TOLERANCE)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_one_token_replays_at_any_position(num_splits):
    # one set of launch arguments, the position only in device memory, as a captured decode step
    # replays it: splits rounded to whole tiles leave the last ones empty at short contexts
    num_q_heads, num_kv_heads, head_dim = 4, 2, 64
    q, caches, values = _case("Q4_0", num_q_heads, num_kv_heads, head_dim, 80, seed=91)
    for position in (0, 1, 30, 79):
        out = _attend(q, caches, position, num_q_heads, num_kv_heads, head_dim, num_splits, 80,
                      is_len_from_positions=True)
        np.testing.assert_allclose(out, _reference(q, values, position, num_q_heads, head_dim), **F16_TOLERANCE)


def test_split_length_from_the_host_is_rounded_to_whole_tiles():
    # kv_len from the host: attention() rounds the split length to its config's 32 keys (96 here),
    # the kernel to its own tile, which the simulator's twin makes 64 keys at head dim 128: a tile
    # past a split's end would otherwise add zero keys into the sum (on a GPU the fused loop's
    # 32-key tiles already divide 96)
    num_q_heads, num_kv_heads, head_dim, kv_len = 8, 1, 128, 200
    q, caches, values = _case("Q8_0", num_q_heads, num_kv_heads, head_dim, kv_len, seed=92)
    out = _attend(q, caches, kv_len - 1, num_q_heads, num_kv_heads, head_dim, 3, kv_len)
    np.testing.assert_allclose(out, _reference(q, values, kv_len - 1, num_q_heads, head_dim), **F16_TOLERANCE)


def test_a_group_of_more_than_one_warps_rows():
    # 24 query heads over one KV head: two warps hold real rows (16 + 8), the partials of both
    num_q_heads, num_kv_heads, head_dim, kv_len = 24, 1, 64, 70
    q, caches, values = _case("Q4_0", num_q_heads, num_kv_heads, head_dim, kv_len, seed=94)
    for num_splits in (1, 2):
        out = _attend(q, caches, kv_len - 1, num_q_heads, num_kv_heads, head_dim, num_splits, kv_len,
                      is_len_from_positions=True)
        np.testing.assert_allclose(out, _reference(q, values, kv_len - 1, num_q_heads, head_dim), **F16_TOLERANCE)


def test_serves_head_dims_the_tensor_core_loop_exports():
    assert attention_decode_mma.is_supported(128, 8)
    assert not attention_decode_mma.is_supported(32, 8)  # attention_decode.py's kernel serves it
    assert not attention_decode_mma.is_supported(128, 65)  # more heads than the fused block's 64 rows
    assert attention_decode_mma.launch_shape(128, 8, is_twin=False) == (4, 32)  # double-buffered 32-key tiles


@pytest.mark.skipif(not tensor_core.is_available(), reason="the C++ fused loop needs a tensor-core GPU")
@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
def test_fused_loop_at_the_served_shape_matches_the_reference(fmt):
    # Qwen3-30B-A3B's attention (32 query heads over 4 KV heads of 128) as the decode step runs it:
    # 66 splits of a larger cache, the length from the position, partials preallocated
    num_q_heads, num_kv_heads, head_dim, cells = 32, 4, 128, 3000
    q, caches, values = _case(fmt, num_q_heads, num_kv_heads, head_dim, cells, seed=93)
    for position in (5, 700, 2047, cells - 1):
        out = _attend(q, caches, position, num_q_heads, num_kv_heads, head_dim, 66, cells,
                      is_len_from_positions=True)
        np.testing.assert_allclose(out, _reference(q, values, position, num_q_heads, head_dim), **F16_TOLERANCE)
