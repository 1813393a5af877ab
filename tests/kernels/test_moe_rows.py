"""moe_rows' expert products (weight rows on the mma's M) against the reference MoE and the tile path."""

import numpy as np
import pytest
from kernel_data import assert_close_to_scale, dev, host, random_matrix

from strata.gpu.kernels import moe, moe_rows, tensor_core
from strata.gpu.kernels.gemm_config import default_config, default_down_config
from strata.gpu.kernels.moe import moe_experts_prefill
from strata.gpu.kernels.moe_route import moe_group
from strata.gpu.kernels.packing import plane_shapes
from strata.model import reference_ops

needs_tensor_cores = pytest.mark.skipif(not tensor_core.is_available(), reason="needs a GPU with tensor cores")
# the experts' fp16 scale magnitudes: at kernel_data's (1/8, 1/64) Q8_0 and Q4_K weights reach 16, and
# silu(gate) * up of x ~ N(0, 1) passes float16's 65,504 in the float16 hidden (Inf, then NaN in down); these keep
# every format's weights within 4 (Q5_K: 63 x 31 / 512, Q6_K: 128 x 32 / 1024, IQ4_XS: 32 x 127 / 1024, IQ3_XXS:
# 7.75 x 62 / 128)
_MAGNITUDES = {"Q8_0": 1.0 / 128, "Q4_K": 1.0 / 256, "Q5_K": 1.0 / 512, "Q6_K": 1.0 / 1024, "IQ4_XS": 1.0 / 1024,
               "IQ3_XXS": 1.0 / 128}
_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS")  # rows of whole 256-element super-blocks


@pytest.fixture(autouse=True)
def _every_built_format_served(monkeypatch):
    """These tests run every built format through the kernels, served or not yet (moe_rows.FORMATS)."""
    monkeypatch.setattr(moe_rows, "FORMATS", moe_rows.BUILT_FORMATS)


def _matrix(fmt, num_rows, num_cols, seed):
    return random_matrix(fmt, num_rows, num_cols, seed, _MAGNITUDES.get(fmt))


def _experts(fmt, num_experts, dim, ffn, seed):
    gate, gate_v = _matrix(fmt, num_experts * ffn, dim, seed)
    up, up_v = _matrix(fmt, num_experts * ffn, dim, seed + 1)
    down, down_v = _matrix(fmt, num_experts * dim, ffn, seed + 2)
    return (gate, up, down), (gate_v.reshape(num_experts, ffn, dim), up_v.reshape(num_experts, ffn, dim),
                              down_v.reshape(num_experts, dim, ffn))


def _routing(num_tokens, num_experts, top_k, seed):
    rng = np.random.default_rng(seed)
    ids, weights = reference_ops.route(rng.standard_normal((num_tokens, num_experts)), top_k)
    return ids.astype(np.int32), weights.astype(np.float32)


def test_the_shared_stages_fit_static_shared_memory():
    for fmt in ("Q4_0", "IQ3_XXS"):  # cuda/moe_rows.cu's 3 stages of 8 + 4 + 0.5 KiB (a scale word a row)
        assert moe_rows.shared_bytes(fmt) == 38_400 <= 48 * 1024
    assert moe_rows.shared_bytes("Q8_0") == 33_792  # 2 stages of 8 + 8 + 0.5 KiB (3 would pass 48 KiB)
    for fmt in ("Q4_K", "IQ4_XS"):  # 3 stages of 8 + 4 + 2 KiB (a 16-byte record of d and scale bytes a row)
        assert moe_rows.shared_bytes(fmt) == 43_008
    for fmt in ("Q5_K", "Q6_K"):  # 2 stages of 8 + 8 + 2 KiB (nibbles and high bits; a 16-byte record a row)
        assert moe_rows.shared_bytes(fmt) == 36_864


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
        for fmts in (("Q8_0",) * 3, ("Q4_K",) * 3, ("Q4_K", "Q4_K", "Q8_0"),  # down of its own format
                     ("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q6_K"), ("Q6_K",) * 3):  # Q4_K_M's, Q5_K_M's, Q6_K's
            assert moe.prefill_tile_rows(num_pairs, 128, fmts, 2048, 768) == served
        assert moe.prefill_tile_rows(num_pairs, 128, ("Q4_K", "Q4_K", "Q4_1"), 2048, 768) == tiles
        assert moe.prefill_tile_rows(num_pairs, 128, ("Q4_K", "Q8_0", "Q4_K"), 2048, 768) == tiles  # gate, up differ
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


# (num_tokens, num_experts, dim, ffn) per format: ~35 rows an expert, both K loops past the 3-stage ring (4 and 5
# steps); ~150 (3 tiles), down's second 64-row half partly past the hidden size; ~1 row. The K-quants' rows are
# whole 256-element super-blocks: 1, 2 and 3 of them (every step's sub-blocks, super-blocks past the first; Q6_K's
# one f16 d a super-block at odd and even halves of its plane)
_K_SHAPES = [(70, 4, 512, 768), (150, 2, 256, 512), (3, 4, 256, 256)]
_SHAPES = {"Q4_0": [(70, 4, 256, 320), (150, 2, 192, 256), (3, 4, 128, 192)],
           "Q8_0": [(70, 4, 256, 320), (150, 2, 192, 256), (3, 4, 128, 192)],
           **{fmt: _K_SHAPES for fmt in _K_QUANTS}}
_WIDER = {"quants": 4, "scales": 2, "extra": 4}  # columns added to each plane: a pitch past the format's rows


def _mixed_down(fmt):  # gate/up of fmt, down of another served format: the two launches' formats apart
    return {"Q4_0": "Q8_0", "Q8_0": "Q4_K", "Q4_K": "Q6_K", "Q5_K": "Q6_K", "Q6_K": "IQ4_XS", "IQ4_XS": "IQ3_XXS",
            "IQ3_XXS": "Q4_0"}[fmt]


@needs_tensor_cores
@pytest.mark.parametrize("fmt, num_tokens, num_experts, dim, ffn",
                         [(fmt, *shape) for fmt, shapes in _SHAPES.items() for shape in shapes])
def test_rows_path_matches_reference_moe(fmt, num_tokens, num_experts, dim, ffn):
    top_k = 2
    (gate, up, down), values = _experts(fmt, num_experts, dim, ffn, seed=40 + num_tokens)
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
@pytest.mark.parametrize("fmt", moe_rows.BUILT_FORMATS)
def test_every_number_of_token_groups_a_tile_matches_reference_moe(fmt):
    # one expert for each tile size 1 .. 8 groups of 8 tokens (a full group and a partial one each), a full tile,
    # and 70 tokens (a full tile and one of 6); dim 192 (K-quants 768): down's second 128-column block has no
    # second half
    rows_per_expert = np.array([1, 9, 17, 25, 33, 41, 49, 57, 64, 70])
    is_k = fmt in _K_QUANTS
    num_experts, dim, ffn = len(rows_per_expert), (768 if is_k else 192), (256 if is_k else 128)
    rng = np.random.default_rng(80)
    ids = rng.permutation(np.repeat(np.arange(num_experts), rows_per_expert)).astype(np.int32).reshape(-1, 1)  # [T, 1]
    weights = rng.uniform(0.5, 1.5, ids.shape).astype(np.float32)
    num_tokens = ids.shape[0]
    (gate, up, down), values = _experts(fmt, num_experts, dim, ffn, seed=81)
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), num_experts, moe_rows.TILE_ROWS)
    assert moe_rows.is_supported(groups, gate, up, down)
    out = dev(np.zeros((num_tokens, dim), np.float32))
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts)
    assert_close_to_scale(host(out), reference_ops.moe(x, ids, weights, *values), 2e-3)  # X and hidden in fp16


@needs_tensor_cores
@pytest.mark.parametrize("fmt", moe_rows.BUILT_FORMATS)
def test_rows_path_agrees_with_the_tile_path_and_is_the_default(monkeypatch, fmt):
    num_tokens, num_experts, top_k, dim, ffn = 96, 8, 4, 256, (256 if fmt in _K_QUANTS else 128)
    (gate, up, down), _ = _experts(fmt, num_experts, dim, ffn, seed=50)
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
                        config=default_config(fmt, fmt, fmt, block_m=64),
                        down_config=default_down_config(fmt, fmt, fmt, block_m=64))
    assert calls == [1]  # explicit tiles keep the tile path
    assert_close_to_scale(host(rows_out), host(tile_out), 2e-3)


@needs_tensor_cores
@pytest.mark.parametrize("fmt", moe_rows.BUILT_FORMATS)
def test_rows_path_reads_mapped_slots_and_skips_absent_experts(fmt):
    num_tokens, num_experts, top_k, dim, ffn = 40, 4, 2, (256 if fmt in _K_QUANTS else 64), 256
    (gate, up, down), values = _experts(fmt, num_experts, dim, ffn, seed=60)
    ids, weights = _routing(num_tokens, num_experts, top_k, seed=61)
    x = np.random.default_rng(62).standard_normal((num_tokens, dim)).astype(np.float32)
    slot_of_expert = np.array([2, -1, 0, 1], np.int32)  # expert 1 is not in this batch
    groups = moe_group(dev(ids), dev(weights), num_experts, moe_rows.TILE_ROWS)
    out = dev(np.zeros((num_tokens, dim), np.float32))
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts,
                        slot_of_expert=dev(slot_of_expert))
    kept = np.where(slot_of_expert[ids] >= 0, weights, 0).astype(np.float32)
    slot_values = tuple(v[np.maximum(slot_of_expert, 0)] for v in values)
    ref = reference_ops.moe(x, ids, kept, *slot_values)
    assert_close_to_scale(host(out), ref, 2e-3)


@needs_tensor_cores
def test_other_formats_keep_the_tile_path(monkeypatch):
    (gate, up, down), _ = _experts("Q4_1", 2, 256, 256, seed=70)
    ids, weights = _routing(8, 2, 1, seed=71)
    groups = moe_group(dev(ids), dev(weights), 2, moe_rows.TILE_ROWS)
    assert not moe_rows.is_supported(groups, gate, up, down)
    monkeypatch.setattr(moe, "_rows_launches", lambda *a, **k: pytest.fail("Q4_1 took the rows path"))
    moe_experts_prefill(dev(np.ones((8, 256), np.float32)), groups, gate, up, down,
                        dev(np.zeros((8, 256), np.float32)), num_experts=2)


@needs_tensor_cores
@pytest.mark.parametrize("fmt", moe_rows.BUILT_FORMATS)
def test_a_down_of_another_format_and_planes_of_a_wider_pitch_match_reference_moe(fmt):
    # gate/up and down launches each of its own format; every plane of a pitch wider than its rows, as an expert
    # cache of types that change between layers holds them (packing.shared_plane_shapes)
    num_tokens, num_experts, top_k, dim, ffn = 70, 4, 2, 256, 256
    gate, gate_v = _matrix(fmt, num_experts * ffn, dim, 90)
    up, up_v = _matrix(fmt, num_experts * ffn, dim, 91)
    down, down_v = _matrix(_mixed_down(fmt), num_experts * dim, ffn, 92)
    wide = [w._replace(**{p: dev(np.pad(host(getattr(w, p)), ((0, 0), (0, n))))
                          for p, n in _WIDER.items() if p in plane_shapes(w.fmt, w.num_rows, w.num_cols)})
            for w in (gate, up, down)]
    ids, weights = _routing(num_tokens, num_experts, top_k, seed=93)
    x = np.random.default_rng(94).standard_normal((num_tokens, dim)).astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), num_experts, moe_rows.TILE_ROWS)
    assert moe_rows.is_supported(groups, *wide) and wide[0].quants.shape[1] > gate.quants.shape[1]
    out = dev(np.zeros((num_tokens, dim), np.float32))
    moe_experts_prefill(dev(x), groups, *wide, out, num_experts=num_experts)
    values = (gate_v.reshape(num_experts, ffn, dim), up_v.reshape(num_experts, ffn, dim),
              down_v.reshape(num_experts, dim, ffn))
    assert_close_to_scale(host(out), reference_ops.moe(x, ids, weights, *values), 2e-3)
