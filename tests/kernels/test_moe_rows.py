"""moe_rows' expert products (weight rows on the mma's M) against the reference MoE and the tile path."""

import numpy as np
import pytest
from kernel_data import assert_close_to_scale, dev, host, random_matrix

from strata.gpu.kernels import moe, moe_rows, tensor_core
from strata.gpu.kernels.gemm_config import default_config, default_down_config
from strata.gpu.kernels.moe import moe_experts_prefill
from strata.gpu.kernels.moe_route import moe_group
from strata.model import reference_ops

needs_tensor_cores = pytest.mark.skipif(not tensor_core.is_available(), reason="needs a GPU with tensor cores")


def _experts(fmt, num_experts, dim, ffn, seed):
    gate, gate_v = random_matrix(fmt, num_experts * ffn, dim, seed)
    up, up_v = random_matrix(fmt, num_experts * ffn, dim, seed + 1)
    down, down_v = random_matrix(fmt, num_experts * dim, ffn, seed + 2)
    return (gate, up, down), (gate_v.reshape(num_experts, ffn, dim), up_v.reshape(num_experts, ffn, dim),
                              down_v.reshape(num_experts, dim, ffn))


def _routing(num_tokens, num_experts, top_k, seed):
    rng = np.random.default_rng(seed)
    ids, weights = reference_ops.route(rng.standard_normal((num_tokens, num_experts)), top_k)
    return ids.astype(np.int32), weights.astype(np.float32)


def test_the_shared_stages_fit_static_shared_memory():
    assert moe_rows.shared_bytes() == 38_400 <= 48 * 1024  # cuda/moe_rows.cu's 3 stages of 8 + 4 + 0.5 KiB


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_stage_x_rounds_to_float16_and_orders_each_column_quad_0_2_1_3(dtype):
    x = np.random.default_rng(90).standard_normal((5, 12)).astype(dtype)
    staged = host(moe_rows.stage_x(dev(x)))
    assert staged.dtype == np.float16
    np.testing.assert_array_equal(staged, x.astype(np.float16).reshape(5, 3, 4)[:, :, [0, 2, 1, 3]].reshape(5, 12))
    with pytest.raises(ValueError, match="multiple of 4"):
        moe_rows.stage_x(dev(np.zeros((2, 6), np.float32)))


def test_chunks_take_the_rows_kernels_tiles_where_they_serve_the_experts():
    q4_0 = ("Q4_0",) * 3
    for num_pairs in (512 * 8, 8192 * 8):
        tiles = moe.moe_block_m(num_pairs, 128)  # the tile kernels' choice
        served = moe_rows.TILE_ROWS if tensor_core.is_available() else tiles
        assert moe.prefill_tile_rows(num_pairs, 128, q4_0, 2048, 768) == served
        assert moe.prefill_tile_rows(num_pairs, 128, ("Q4_K", "Q4_K", "Q6_K"), 2048, 768) == tiles
        assert moe.prefill_tile_rows(num_pairs, 128, q4_0, 2048, 96) == tiles  # FFN not a multiple of STEP_K
        assert moe.prefill_tile_rows(num_pairs, 128) == tiles  # experts unknown
    assert moe.prefill_tile_row_choices(q4_0, 2048, 768) == ((moe_rows.TILE_ROWS,) if tensor_core.is_available()
                                                            else moe.DEFAULT_BLOCK_MS)
    assert moe.prefill_tile_row_choices() == moe.DEFAULT_BLOCK_MS


def test_groups_of_other_rows_or_no_tensor_cores_are_not_supported():
    (gate, up, down), _ = _experts("Q4_0", 2, 64, 64, seed=30)
    ids, weights = _routing(4, 2, 1, seed=31)
    groups = moe_group(dev(ids), dev(weights), 2, 128)
    assert not moe_rows.is_supported(groups, gate, up, down)  # 128-row tiles (and, off a GPU, no tensor cores)


@needs_tensor_cores
# ~35 rows an expert, both K loops past the 3-stage ring (4 and 5 steps); ~150 (3 tiles), down's second
# 64-row half partly past the hidden size; ~1 row
@pytest.mark.parametrize("num_tokens, num_experts, dim, ffn", [(70, 4, 256, 320), (150, 2, 192, 256), (3, 4, 128, 192)])
def test_rows_path_matches_reference_moe(num_tokens, num_experts, dim, ffn):
    top_k = 2
    (gate, up, down), values = _experts("Q4_0", num_experts, dim, ffn, seed=40 + num_tokens)
    ids, weights = _routing(num_tokens, num_experts, top_k, seed=41)
    rng = np.random.default_rng(42)
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    residual = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), num_experts, moe_rows.TILE_ROWS)
    assert moe_rows.is_supported(groups, gate, up, down)
    out = dev(residual)
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts)
    ref = residual + reference_ops.moe(x, ids, weights, *values)
    assert_close_to_scale(host(out), ref, 2e-3)  # X and hidden rounded to fp16


@needs_tensor_cores
def test_every_number_of_token_groups_a_tile_matches_reference_moe():
    # one expert for each tile size 1 .. 8 groups of 8 tokens (a full group and a partial one each), a full tile,
    # and 70 tokens (a full tile and one of 6); dim 192: down's second 128-column block has no second half
    rows_per_expert = np.array([1, 9, 17, 25, 33, 41, 49, 57, 64, 70])
    num_experts, dim, ffn = len(rows_per_expert), 192, 128
    rng = np.random.default_rng(80)
    ids = rng.permutation(np.repeat(np.arange(num_experts), rows_per_expert)).astype(np.int32).reshape(-1, 1)  # [T, 1]
    weights = rng.uniform(0.5, 1.5, ids.shape).astype(np.float32)
    num_tokens = ids.shape[0]
    (gate, up, down), values = _experts("Q4_0", num_experts, dim, ffn, seed=81)
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), num_experts, moe_rows.TILE_ROWS)
    assert moe_rows.is_supported(groups, gate, up, down)
    out = dev(np.zeros((num_tokens, dim), np.float32))
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts)
    assert_close_to_scale(host(out), reference_ops.moe(x, ids, weights, *values), 2e-3)  # X and hidden in fp16


@needs_tensor_cores
def test_rows_path_agrees_with_the_tile_path_and_is_the_default(monkeypatch):
    num_tokens, num_experts, top_k, dim, ffn = 96, 8, 4, 256, 128
    (gate, up, down), _ = _experts("Q4_0", num_experts, dim, ffn, seed=50)
    ids, weights = _routing(num_tokens, num_experts, top_k, seed=51)
    x = dev(np.random.default_rng(52).standard_normal((num_tokens, dim)).astype(np.float32))
    groups = moe_group(dev(ids), dev(weights), num_experts, moe_rows.TILE_ROWS)
    calls = []
    real = moe_rows.rows_launches
    monkeypatch.setattr(moe_rows, "rows_launches", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows_out = dev(np.zeros((num_tokens, dim), np.float32))
    moe_experts_prefill(x, groups, gate, up, down, rows_out, num_experts=num_experts)
    assert calls == [1]
    tile_out = dev(np.zeros((num_tokens, dim), np.float32))
    moe_experts_prefill(x, groups, gate, up, down, tile_out, num_experts=num_experts,
                        config=default_config("Q4_0", "Q4_0", "Q4_0", block_m=64),
                        down_config=default_down_config("Q4_0", "Q4_0", "Q4_0", block_m=64))
    assert calls == [1]  # explicit tiles keep the tile path
    assert_close_to_scale(host(rows_out), host(tile_out), 2e-3)


@needs_tensor_cores
def test_rows_path_reads_mapped_slots_and_skips_absent_experts():
    num_tokens, num_experts, top_k, dim, ffn = 40, 4, 2, 64, 128
    (gate, up, down), values = _experts("Q4_0", num_experts, dim, ffn, seed=60)
    ids, weights = _routing(num_tokens, num_experts, top_k, seed=61)
    x = np.random.default_rng(62).standard_normal((num_tokens, dim)).astype(np.float32)
    slot_of_expert = np.array([2, -1, 0, 1], np.int32)  # expert 1 is not in this batch
    groups = moe_group(dev(ids), dev(weights), num_experts, moe_rows.TILE_ROWS)
    out = dev(np.zeros((num_tokens, dim), np.float32))
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts, slot_of_expert=dev(slot_of_expert))
    kept = np.where(slot_of_expert[ids] >= 0, weights, 0).astype(np.float32)
    slot_values = tuple(v[np.maximum(slot_of_expert, 0)] for v in values)
    ref = reference_ops.moe(x, ids, kept, *slot_values)
    assert_close_to_scale(host(out), ref, 2e-3)


@needs_tensor_cores
def test_other_formats_keep_the_tile_path(monkeypatch):
    (gate, up, down), _ = _experts("Q8_0", 2, 64, 64, seed=70)
    ids, weights = _routing(8, 2, 1, seed=71)
    groups = moe_group(dev(ids), dev(weights), 2, moe_rows.TILE_ROWS)
    assert not moe_rows.is_supported(groups, gate, up, down)
    monkeypatch.setattr(moe, "_rows_launches", lambda *a, **k: pytest.fail("Q8_0 took the rows path"))
    moe_experts_prefill(dev(np.ones((8, 64), np.float32)), groups, gate, up, down,
                        dev(np.zeros((8, 64), np.float32)), num_experts=2)
