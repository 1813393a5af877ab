"""Decode attention rows: each query row of an R-row launch, at its own position, has the bits of a
one-token launch (the kernels a decode step runs, a block row per query row), and the reference's
values within the one-token tolerances.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize as gguf_quantize
from kernel_data import dev, host, reference_dequant

from strata.backend.ops import DECODE_MAX_ROWS
from strata.gpu.kernels import attention_decode, attention_decode_direct, attention_decode_mma
from strata.gpu.kernels.attention import attention, decode_config, decode_workspace_specs
from strata.gpu.kernels.packing import pack, to_device
from strata.model import reference_ops


def _x(num_rows, num_cols, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal((num_rows, num_cols)) * scale).astype(np.float32)


def _assert_rows_equal(rows, ones):
    """rows [R, N] of one launch against R one-row results, bit for bit."""
    for t, one in enumerate(ones):
        assert np.array_equal(rows[t], one), f"row {t} differs from its one-row launch"


# --- attention ------------------------------------------------------------------------------------

NUM_Q_HEADS, NUM_KV_HEADS = 2, 1
NUM_CELLS = 40  # a 32-key tile and a partial one
POSITIONS = np.array([39, 3, 20, 20, 0, 31, 32, 38, 1], np.int32)  # any order, repeats, tile edges
ATTENTION_TOLERANCE = dict(rtol=1e-5, atol=2e-6)
F16_TOLERANCE = dict(rtol=1e-2, atol=2e-3)  # the tensor-core kernels round Q, K, V and P to f16


def _cache(fmt, head_dim, seed):
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(2):
        values = rng.standard_normal((NUM_CELLS, NUM_KV_HEADS * head_dim)).astype(np.float32)
        raw = gguf_quantize(values, QType[fmt]).view(np.uint8).reshape(NUM_CELLS, -1)
        pairs.append((to_device(pack(raw, fmt)), reference_dequant(raw, fmt)))
    return pairs


def _decode_attention(q, k_cache, v_cache, positions, head_dim, num_splits, is_direct):
    group = NUM_Q_HEADS // NUM_KV_HEADS
    # as the decode step passes it: preallocated, the partials here full of NaN (the counters start at zero)
    specs = decode_workspace_specs(num_splits, q.shape[0], NUM_Q_HEADS, NUM_KV_HEADS, head_dim, is_direct)
    workspace = tuple(dev(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0, dtype))
                      for shape, dtype in specs)
    return host(attention(dev(q), k_cache, v_cache, dev(positions), num_q_heads=NUM_Q_HEADS,
                          num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, kv_len=NUM_CELLS, num_splits=num_splits,
                          is_len_from_positions=True, is_decode_rows=True, workspace=workspace,
                          config=decode_config(head_dim, group), use_direct_decode=is_direct))


@pytest.fixture(params=["attention_decode_direct", "attention_decode_mma", "attention_decode", "attention"])
def decode_kernel(request, monkeypatch):
    """Which kernel serves the rows: the direct decode kernel (its twin here; head dim 64), the tensor-core
    tile kernel (its twin; head dim 64, the direct kernel declined), the FFMA decode kernel (head dim 32),
    or attention.py's, which serves what none takes."""
    if request.param == "attention":
        monkeypatch.setattr(attention_decode, "is_supported", lambda *args: False)
    return request.param


@pytest.mark.parametrize("fmt, num_splits", [("F16", 3), ("Q8_0", 1), ("Q4_0", 2)])
def test_decode_attention_rows_have_the_bits_of_one_token_launches(fmt, num_splits, decode_kernel):
    is_direct = decode_kernel == "attention_decode_direct"
    head_dim = 64 if decode_kernel in ("attention_decode_direct", "attention_decode_mma") else 32
    group = NUM_Q_HEADS // NUM_KV_HEADS
    assert attention_decode_direct.is_supported(head_dim, group) == (head_dim == 64)
    assert attention_decode_mma.is_supported(head_dim, group) == (head_dim == 64)
    (k_cache, k_values), (v_cache, v_values) = _cache(fmt, head_dim, seed=640)
    q = _x(DECODE_MAX_ROWS, NUM_Q_HEADS * head_dim, seed=641)
    ones = [_decode_attention(q[t:t + 1], k_cache, v_cache, POSITIONS[t:t + 1], head_dim, num_splits, is_direct)[0]
            for t in range(DECODE_MAX_ROWS)]
    rows = _decode_attention(q, k_cache, v_cache, POSITIONS, head_dim, num_splits, is_direct)
    _assert_rows_equal(rows, ones)
    is_f16 = decode_kernel in ("attention_decode_direct", "attention_decode_mma")  # inputs rounded to f16
    for t, position in enumerate(POSITIONS):
        q3 = q[t].reshape(1, NUM_Q_HEADS, head_dim)
        k3, v3 = (a[:position + 1].reshape(-1, NUM_KV_HEADS, head_dim) for a in (k_values, v_values))
        ref = reference_ops.attention(q3, k3, v3, int(position)).reshape(-1)
        np.testing.assert_allclose(rows[t], ref, **(F16_TOLERANCE if is_f16 else ATTENTION_TOLERANCE))


def test_decode_rows_refuse_blocks_of_several_tokens():
    (k_cache, _), (v_cache, _) = _cache("F16", 32, seed=642)
    q = np.zeros((2, NUM_Q_HEADS * 32), np.float32)
    with pytest.raises(ValueError, match="one token per block"):
        attention(q, k_cache, v_cache, np.array([3, 4], np.int32), num_q_heads=NUM_Q_HEADS,
                  num_kv_heads=NUM_KV_HEADS, head_dim=32, is_decode_rows=True)
