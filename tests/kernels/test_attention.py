import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize as gguf_quantize
from kernel_data import dev, host, reference_dequant

from strata.gpu.kernels import attention_decode
from strata.gpu.kernels.attention import (
    AttentionConfig,
    attention,
    decode_config,
    split_partial_shapes,
)
from strata.gpu.kernels.packing import pack, to_device
from strata.model import reference_ops

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32
WIDTH = NUM_KV_HEADS * HEAD_DIM
TINY = AttentionConfig(tokens_per_block=2, threads_per_row=4, kv_tile=8)  # 2 tokens x 2 heads x 4 = 16 threads
TOLERANCE = dict(rtol=1e-5, atol=2e-6)


def _cache(fmt, num_positions, seed):
    """A (K, V) cache pair on the device and the float values attention must see."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(2):
        values = rng.standard_normal((num_positions, WIDTH)).astype(np.float32)
        raw = gguf_quantize(values, QType[fmt]).view(np.uint8).reshape(num_positions, -1)
        pairs.append((to_device(pack(raw, fmt)), reference_dequant(raw, fmt)))
    return pairs


def _reference(q, k_values, v_values, start_pos):
    q3 = q.reshape(q.shape[0], NUM_Q_HEADS, HEAD_DIM)
    k3, v3 = (a.reshape(a.shape[0], NUM_KV_HEADS, HEAD_DIM) for a in (k_values, v_values))
    return reference_ops.attention(q3, k3, v3, start_pos).reshape(q.shape[0], -1)


@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
def test_prefill_chunk_over_a_cache_with_history(fmt):
    start_pos, num_tokens = 5, 6  # keys 0..10: two 8-key tiles, the last one partly masked
    (k_cache, k_values), (v_cache, v_values) = _cache(fmt, 16, seed=70)
    q = np.random.default_rng(71).standard_normal((num_tokens, NUM_Q_HEADS * HEAD_DIM)).astype(np.float32)
    positions = (start_pos + np.arange(num_tokens)).astype(np.int32)
    out = attention(dev(q), k_cache, v_cache, dev(positions), num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
                    head_dim=HEAD_DIM, kv_len=start_pos + num_tokens, config=TINY)
    np.testing.assert_allclose(host(out), _reference(q, k_values, v_values, start_pos), **TOLERANCE)


@pytest.fixture(params=["attention_decode", "attention"])
def one_token_kernel(request, monkeypatch):
    """Which kernel serves a one-token call: attention_decode's, where it applies, or attention.py's
    (which serves the head dims and groups attention_decode does not take)."""
    if request.param == "attention":
        monkeypatch.setattr(attention_decode, "is_supported", lambda *args: False)
    return request.param


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_one_token_split_over_the_context(num_splits, one_token_kernel):
    kv_len = 38
    (k_cache, k_values), (v_cache, v_values) = _cache("Q8_0", 40, seed=72)
    q = np.random.default_rng(73).standard_normal((1, NUM_Q_HEADS * HEAD_DIM)).astype(np.float32)
    config = AttentionConfig(tokens_per_block=1, threads_per_row=8, kv_tile=8)
    out = attention(dev(q), k_cache, v_cache, np.array([kv_len - 1], np.int32), num_q_heads=NUM_Q_HEADS,
                    num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, num_splits=num_splits, config=config)
    np.testing.assert_allclose(host(out), _reference(q, k_values, v_values, kv_len - 1), **TOLERANCE)


@pytest.mark.parametrize("num_splits", [2, 7])
def test_decode_with_the_serving_config_combines_any_number_of_splits(num_splits, one_token_kernel):
    # decode_config (attention.py's launch shape): a warp per query head; 7 splits: one unrolled step
    # of the combine and a remainder
    kv_len = 70
    (k_cache, k_values), (v_cache, v_values) = _cache("Q4_0", 72, seed=74)
    q = np.random.default_rng(75).standard_normal((1, NUM_Q_HEADS * HEAD_DIM)).astype(np.float32)
    config = decode_config(HEAD_DIM)
    assert config.threads_per_row == 32
    out = attention(dev(q), k_cache, v_cache, np.array([kv_len - 1], np.int32), num_q_heads=NUM_Q_HEADS,
                    num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, kv_len=kv_len, num_splits=num_splits,
                    config=config)
    np.testing.assert_allclose(host(out), _reference(q, k_values, v_values, kv_len - 1), **TOLERANCE)
    assert decode_config(48).threads_per_row == 16
    assert decode_config(64, group=48).threads_per_row == 16  # at most 1,024 threads a block


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_with_the_length_from_the_positions_replays_at_any_position(num_splits, one_token_kernel):
    # one set of launch arguments (kv_len = the cache size), the position only in device memory,
    # as a captured decode step replays it: split ranges shorter than a tile, empty splits
    (k_cache, k_values), (v_cache, v_values) = _cache("Q4_0", 48, seed=76)
    q = np.random.default_rng(77).standard_normal((1, NUM_Q_HEADS * HEAD_DIM)).astype(np.float32)
    config = AttentionConfig(tokens_per_block=1, threads_per_row=8, kv_tile=8)
    q_dev, positions = dev(q), dev(np.zeros(1, np.int32))
    for position in (0, 3, 9, 30, 47):
        positions.copy_to_device(np.array([position], np.int32))
        out = attention(q_dev, k_cache, v_cache, positions, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
                        head_dim=HEAD_DIM, kv_len=48, num_splits=num_splits, config=config,
                        is_len_from_positions=True)
        np.testing.assert_allclose(host(out), _reference(q, k_values, v_values, position), **TOLERANCE)


@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_token_over_several_key_tiles(fmt, num_splits):
    # attention_decode's kernel: a key a thread (64-key tiles at this group), V in 32-row steps; the
    # last tile and V step of each split partial
    group = NUM_Q_HEADS // NUM_KV_HEADS
    assert attention_decode.is_supported(HEAD_DIM, group)
    kv_len = 4 * group * attention_decode.WARP + 37
    (k_cache, k_values), (v_cache, v_values) = _cache(fmt, kv_len + 3, seed=78)
    q = np.random.default_rng(79).standard_normal((1, NUM_Q_HEADS * HEAD_DIM)).astype(np.float32)
    workspace = None  # as the engine's decode step passes it: preallocated, here full of NaN
    if num_splits > 1:
        shapes = split_partial_shapes(num_splits, 1, NUM_Q_HEADS, HEAD_DIM)
        workspace = tuple(dev(np.full(shape, np.nan, np.float32)) for shape in shapes)
    out = attention(dev(q), k_cache, v_cache, dev(np.array([kv_len - 1], np.int32)), num_q_heads=NUM_Q_HEADS,
                    num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, kv_len=kv_len + 3, num_splits=num_splits,
                    is_len_from_positions=True, workspace=workspace)
    np.testing.assert_allclose(host(out), _reference(q, k_values, v_values, kv_len - 1), **TOLERANCE)


def test_decode_kernel_serves_the_groups_whose_scores_fit_shared_memory():
    assert attention_decode.is_supported(128, 8)  # Qwen3-30B-A3B: 32 query heads over 4 KV heads
    assert not attention_decode.is_supported(128, 16)  # 58 KiB of static shared memory: attention.py's kernel
    assert not attention_decode.is_supported(80, 2)  # lanes own head_dim / 32 dims


def test_split_prefill_with_custom_scale_equals_unsplit():
    (k_cache, _), (v_cache, _) = _cache("Q4_0", 16, seed=74)
    q = np.random.default_rng(75).standard_normal((3, NUM_Q_HEADS * HEAD_DIM)).astype(np.float32)
    positions = np.array([11, 12, 13], np.int32)  # 14 keys: two splits of one 8-key tile each
    args = dict(num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scale=0.3, config=TINY)
    whole = host(attention(dev(q), k_cache, v_cache, positions, **args))
    split = host(attention(dev(q), k_cache, v_cache, positions, num_splits=2, **args))
    np.testing.assert_allclose(split, whole, **TOLERANCE)


def test_attention_rejects_bad_shapes():
    (k_cache, _), (v_cache, _) = _cache("F16", 8, seed=76)
    q = np.zeros((1, NUM_Q_HEADS * HEAD_DIM), np.float32)
    args = dict(num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        attention(q, k_cache, v_cache, np.zeros(1, np.int32), num_q_heads=3, **args)
    with pytest.raises(ValueError, match=r"kv_len must lie in \[0, 8\]"):
        attention(q, k_cache, v_cache, np.zeros(1, np.int32), num_q_heads=NUM_Q_HEADS, kv_len=9, **args)
    with pytest.raises(ValueError, match="kv_len is required"):
        attention(q, k_cache, v_cache, dev(np.zeros(1, np.int32)), num_q_heads=NUM_Q_HEADS, **args)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        attention(q, k_cache, v_cache, np.zeros(1, np.int32), num_q_heads=NUM_Q_HEADS,
                  config=AttentionConfig(tokens_per_block=64, threads_per_row=4, kv_tile=64), **args)
    with pytest.raises(ValueError, match="num_splits 513 exceeds 512"):
        attention(q, k_cache, v_cache, np.zeros(1, np.int32), num_q_heads=NUM_Q_HEADS, num_splits=513, **args)


def test_attention_writes_host_outputs():
    (k_cache, k_values), (v_cache, v_values) = _cache("F16", 8, seed=77)
    q = np.random.default_rng(78).standard_normal((2, NUM_Q_HEADS * HEAD_DIM)).astype(np.float32)
    out = np.zeros_like(q)  # a host output is copied back after the launch: no stand-in may clobber it
    attention(q, k_cache, v_cache, np.array([3, 4], np.int32), out, num_q_heads=NUM_Q_HEADS,
              num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, config=TINY)
    np.testing.assert_allclose(out, _reference(q, k_values, v_values, 3), **TOLERANCE)
