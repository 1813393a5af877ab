"""Decode MoE rows: each token of a few-token launch has the bits of a one-token launch (blocks of
one token each, no atomics), and the reference's values.
"""

import numpy as np
import pytest
from kernel_data import assert_close_to_scale, dev, host, random_matrix

from strata.gpu.kernels.gemv import GemvConfig
from strata.gpu.kernels.moe import moe_experts_decode
from strata.model import reference_ops


def _x(num_rows, num_cols, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal((num_rows, num_cols)) * scale).astype(np.float32)


def _assert_rows_equal(rows, ones):
    """rows [R, N] of one launch against R one-row results, bit for bit."""
    for t, one in enumerate(ones):
        assert np.array_equal(rows[t], one), f"row {t} differs from its one-row launch"


# --- MoE ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmts", [("Q4_0", "Q4_1", "Q8_0"), ("Q8_0", "Q4_0", "F16")])
def test_decode_experts_rows_have_the_bits_of_one_token_launches(fmts):
    num_experts, top_k, dim, ffn = 4, 2, 64, 32
    gate, gate_v = random_matrix(fmts[0], num_experts * ffn, dim, 650)
    up, up_v = random_matrix(fmts[1], num_experts * ffn, dim, 651)
    down, down_v = random_matrix(fmts[2], num_experts * dim, ffn, 652)
    rng = np.random.default_rng(653)
    num_tokens = 4
    x = _x(num_tokens, dim, seed=654)
    ids = np.array([[0, 3], [3, 0], [2, -1], [3, 1]], np.int32)  # shared experts, a missing one
    weights = rng.uniform(0.1, 1.0, (num_tokens, top_k)).astype(np.float32)
    norm_weight = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    residual = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    config = GemvConfig(threads=32, lanes_per_row=4, rows_per_group=4)
    args = dict(num_experts=num_experts, norm_weight=dev(norm_weight), eps=1e-6, config=config)
    ones = []
    for t in range(num_tokens):
        out = dev(residual[t:t + 1])
        moe_experts_decode(dev(x[t:t + 1]), dev(ids[t:t + 1]), dev(weights[t:t + 1]), gate, up, down, out, **args)
        ones.append(host(out)[0])
    out = dev(residual)
    moe_experts_decode(dev(x), dev(ids), dev(weights), gate, up, down, out, **args)
    _assert_rows_equal(host(out), ones)
    values = (gate_v.reshape(num_experts, ffn, dim), up_v.reshape(num_experts, ffn, dim),
              down_v.reshape(num_experts, dim, ffn))
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6)
    ref_ids, ref_weights = np.where(ids < 0, 0, ids), np.where(ids < 0, 0, weights)
    assert_close_to_scale(host(out), residual + reference_ops.moe(x_normed, ref_ids, ref_weights, *values), 2e-6)
