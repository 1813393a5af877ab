import numpy as np
import pytest
from kernel_data import assert_close_to_scale, dev, host, random_matrix

from strata.gpu.kernels import moe
from strata.gpu.kernels.gemm_config import GemmConfig
from strata.gpu.kernels.gemv import GemvConfig
from strata.gpu.kernels.moe import moe_experts_decode, moe_experts_prefill
from strata.gpu.kernels.moe_route import moe_group, moe_route
from strata.model import reference_ops

GEMM_TINY = GemmConfig(block_m=8, block_n=8, thread_m=2, thread_n=2)
GEMV_TINY = GemvConfig(threads=32, lanes_per_row=4, rows_per_group=4)  # 32 rows per block


def _experts(fmts, num_experts, dim, ffn, seed):
    """Packed gate/up [E*F, H] and down [E*H, F] and their values as [E, F, H] / [E, H, F]."""
    gate, gate_v = random_matrix(fmts[0], num_experts * ffn, dim, seed)
    up, up_v = random_matrix(fmts[1], num_experts * ffn, dim, seed + 1)
    down, down_v = random_matrix(fmts[2], num_experts * dim, ffn, seed + 2)
    values = (gate_v.reshape(num_experts, ffn, dim), up_v.reshape(num_experts, ffn, dim),
              down_v.reshape(num_experts, dim, ffn))
    return (gate, up, down), values


def test_prefill_experts_over_grouped_tiles_match_reference_moe():
    num_tokens, num_experts, top_k, dim, ffn = 7, 4, 2, 32, 32
    (gate, up, down), values = _experts(("Q4_0", "Q4_1", "Q8_0"), num_experts, dim, ffn, seed=90)
    rng = np.random.default_rng(91)
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    residual = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    ids, weights = moe_route(dev(logits), top_k, threads=8)
    groups = moe_group(ids, weights, num_experts, GEMM_TINY.block_m, threads=8)
    out = dev(residual)
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts, config=GEMM_TINY)
    ref = residual + reference_ops.moe(x, host(ids), host(weights), *values)
    assert_close_to_scale(host(out), ref, 2e-6)


def test_prefill_float16_hidden_scratch():
    num_tokens, num_experts, top_k, dim, ffn = 5, 3, 2, 32, 32
    (gate, up, down), values = _experts(("F16", "Q8_0", "Q4_0"), num_experts, dim, ffn, seed=92)
    rng = np.random.default_rng(93)
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    ids, weights = reference_ops.route(rng.standard_normal((num_tokens, num_experts)), top_k)
    ids, weights = ids.astype(np.int32), weights.astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), num_experts, GEMM_TINY.block_m, threads=8)
    out = dev(np.zeros((num_tokens, dim), np.float32))
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts, hidden_dtype=np.float16,
                        config=GEMM_TINY)
    ref = reference_ops.moe(x, ids, weights, *values)
    assert_close_to_scale(host(out), ref, 1e-3)  # hidden rounded to fp16


def test_decode_experts_with_fused_norm_match_reference_moe():
    num_experts, dim, ffn = 4, 256, 32
    (gate, up, down), values = _experts(("Q4_K", "Q6_K", "Q8_0"), num_experts, dim, ffn, seed=94)
    rng = np.random.default_rng(95)
    x = (rng.standard_normal((1, dim)) * 2).astype(np.float32)
    norm_weight = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    ids = np.array([[3, 1]], np.int32)
    weights = np.array([[0.7, 0.3]], np.float32)
    residual = rng.standard_normal((1, dim)).astype(np.float32)
    out = dev(residual)
    moe_experts_decode(dev(x), dev(ids), dev(weights), gate, up, down, out, num_experts=num_experts,
                       norm_weight=dev(norm_weight), eps=1e-6, config=GEMV_TINY)
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6)
    ref = residual + reference_ops.moe(x_normed, ids, weights, *values)
    assert_close_to_scale(host(out), ref, 2e-6)


def test_experts_reject_inconsistent_stacks():
    (gate, up, down), _ = _experts(("Q8_0", "Q8_0", "Q8_0"), 2, 64, 32, seed=96)
    x, out = np.zeros((1, 64), np.float32), np.zeros((1, 64), np.float32)
    ids, weights = np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)
    with pytest.raises(ValueError, match="not a whole stack of 3 experts"):
        moe_experts_decode(x, ids, weights, gate, up, down, out, num_experts=3)
    with pytest.raises(ValueError, match="down must be"):
        moe_experts_decode(x, ids, weights, gate, up, gate, out, num_experts=2)
    groups = moe_group(ids, weights, 2, 16)
    with pytest.raises(ValueError, match="the groups' tiles are 16 pairs"):
        moe_experts_prefill(x, groups, gate, up, down, out, num_experts=2, config=GEMM_TINY)
    groups = moe_group(ids, weights, 2, GEMM_TINY.block_m)
    with pytest.raises(ValueError, match=r"8 \(config\) and 16 \(down_config\) rows"):
        moe_experts_prefill(x, groups, gate, up, down, out, num_experts=2, config=GEMM_TINY,
                            down_config=GEMM_TINY._replace(block_m=16))


def test_prefill_down_launch_on_tiles_of_its_own(monkeypatch):
    # the down launch's tiles 8 x 32 (one block covers the whole hidden width, 32 threads), gate/up's 8 x 8
    launches = []  # (grid, threads) of each launch, as launched
    real_launch = moe.launch

    def recording_launch(kernel, grid, threads, num_dynamic_bytes, *args):
        launches.append((grid, threads))
        real_launch(kernel, grid, threads, num_dynamic_bytes, *args)

    monkeypatch.setattr(moe, "launch", recording_launch)
    (gate, up, down), values = _experts(("Q4_0", "Q4_0", "Q8_0"), 3, 32, 64, seed=98)
    rng = np.random.default_rng(99)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    ids, weights = reference_ops.route(rng.standard_normal((6, 3)), 2)
    ids, weights = ids.astype(np.int32), weights.astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), 3, GEMM_TINY.block_m, threads=8)
    out = dev(np.zeros((6, 32), np.float32))
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=3, config=GEMM_TINY,
                        down_config=GemmConfig(block_m=8, block_n=32, thread_m=2, thread_n=4))
    assert_close_to_scale(host(out), reference_ops.moe(x, ids, weights, *values), 2e-6)
    (gate_up_grid, gate_up_threads), (down_grid, down_threads) = launches
    assert (gate_up_grid[0], gate_up_threads) == (64 // 8, GEMM_TINY.threads)  # ffn 64 in columns of 8
    assert (down_grid[0], down_threads) == (1, 32)


def test_prefill_one_grouping_serves_launches_over_slot_tables():
    # experts 0..3 grouped once by id; two launches, each computing the experts its table maps to
    # slots of a 6-slot stack (the others skipped), add up to the whole MoE
    num_tokens, num_experts, num_slots, top_k, dim, ffn = 9, 4, 6, 2, 32, 32
    (gate, up, down), values = _experts(("Q4_0", "Q8_0", "Q4_1"), num_slots, dim, ffn, seed=96)
    rng = np.random.default_rng(97)
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    ids, weights = reference_ops.route(rng.standard_normal((num_tokens, num_experts)), top_k)
    ids, weights = ids.astype(np.int32), weights.astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), num_experts, GEMM_TINY.block_m, threads=8)
    out = dev(np.zeros((num_tokens, dim), np.float32))
    slot_of = {0: 5, 1: 2, 2: 0, 3: 3}
    for batch in ((0, 2), (1, 3)):
        table = np.full(num_experts, -1, np.int32)
        for expert in batch:
            table[expert] = slot_of[expert]
        moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_slots, config=GEMM_TINY,
                            slot_of_expert=dev(table))
    slots = [slot_of[e] for e in range(num_experts)]
    expert_values = tuple(v[slots] for v in values)  # expert e's weights sit in slot slot_of[e]
    assert_close_to_scale(host(out), reference_ops.moe(x, ids, weights, *expert_values), 2e-6)


def test_prefill_staged_once_serves_every_launch_of_a_layer():
    # stage_prefill's X and hidden scratch, shared by two launches over slot tables, give the unstaged launches'
    # output bit for bit (the default tiles: what the engine's layers run)
    num_tokens, num_experts, num_slots, top_k, dim, ffn = 9, 4, 6, 2, 32, 32
    (gate, up, down), _ = _experts(("Q4_0", "Q4_0", "Q4_0"), num_slots, dim, ffn, seed=98)
    rng = np.random.default_rng(99)
    x = dev(rng.standard_normal((num_tokens, dim)).astype(np.float32))
    ids, weights = reference_ops.route(rng.standard_normal((num_tokens, num_experts)), top_k)
    block_m = moe.prefill_tile_rows(num_tokens * top_k, num_experts, ("Q4_0",) * 3, dim, ffn)
    groups = moe_group(dev(ids.astype(np.int32)), dev(weights.astype(np.float32)), num_experts, block_m)
    staged = moe.stage_prefill(x, groups, gate, up, down, num_experts=num_slots)
    tables = (np.array([5, -1, 0, -1], np.int32), np.array([-1, 2, -1, 3], np.int32))
    outs = []
    for use_staged in (False, True):
        out = dev(np.zeros((num_tokens, dim), np.float32))
        for table in tables:
            moe_experts_prefill(x, groups, gate, up, down, out, num_experts=num_slots, slot_of_expert=dev(table),
                                staged=staged if use_staged else None)
        outs.append(host(out))
    np.testing.assert_array_equal(outs[1], outs[0])
    assert np.abs(outs[0]).max() > 0
    again = moe.stage_prefill(x, groups, gate, up, down, num_experts=num_slots, reuse=staged)  # the next layer's
    assert again.hidden is staged.hidden and again.is_rows == staged.is_rows
    fewer = moe_group(dev(ids[:4].astype(np.int32)), dev(weights[:4].astype(np.float32)), num_experts, block_m)
    assert moe.stage_prefill(x[:4], fewer, gate, up, down, num_experts=num_slots, reuse=staged).hidden is not \
        staged.hidden  # another shape: a buffer of its own
    with pytest.raises(ValueError, match="staged comes with the default configs"):
        moe_experts_prefill(x, groups, gate, up, down, out, num_experts=num_slots, config=GEMM_TINY, staged=staged)
