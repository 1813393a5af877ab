import numpy as np
import pytest
from kernel_data import dev, host

from strata.gpu.kernels.moe_route import BLOCK_ROUTE_MAX_TOKENS, moe_group, moe_route
from strata.model import reference_ops


@pytest.mark.parametrize("norm_weights", [True, False])
def test_route_matches_llama_softmax_top_k(norm_weights):
    rng = np.random.default_rng(80)
    logits = rng.standard_normal((7, 12)).astype(np.float32)
    logits[3, 4] = logits[3, 9] = logits[3].max() + 1  # a tie goes to the lower expert id
    ids, weights = moe_route(dev(logits), 4, norm_weights=norm_weights, threads=4)
    ref_ids, ref_weights = reference_ops.route(logits, 4, is_norm_weights=norm_weights)
    np.testing.assert_array_equal(host(ids), ref_ids)
    np.testing.assert_allclose(host(weights), ref_weights, rtol=2e-6, atol=1e-7)
    assert host(ids)[3, 0] == 4


def test_a_block_per_token_routes_to_the_same_bits_as_a_thread_per_token():
    # decode shapes (a block per token) against prefill shapes (a thread per token) on the same rows,
    # with ties inside the top-k and more experts than the block has threads
    rng = np.random.default_rng(81)
    num_tokens = BLOCK_ROUTE_MAX_TOKENS + 3
    logits = rng.standard_normal((num_tokens, 160)).astype(np.float32)
    logits[1, 7] = logits[1, 150] = logits[1, 3] = logits[1].max() + 0.5
    logits[2, :] = 0.25  # every expert tied: ids 0..k-1
    num_block = 4  # of up to BLOCK_ROUTE_MAX_TOKENS: the simulator is slow
    by_thread = [host(a) for a in moe_route(dev(logits), 8)]
    by_block = [host(a) for a in moe_route(dev(logits[:num_block]), 8)]
    np.testing.assert_array_equal(by_block[0], by_thread[0][:num_block])
    np.testing.assert_array_equal(by_block[1], by_thread[1][:num_block])
    assert list(by_block[0][1, :3]) == [3, 7, 150] and list(by_block[0][2]) == list(range(8))
    ref_ids, _ = reference_ops.route(logits, 8, is_norm_weights=True)
    np.testing.assert_array_equal(by_thread[0], ref_ids)


def test_block_and_thread_routing_agree_on_non_finite_logits():
    logits = np.random.default_rng(82).standard_normal((4, 40)).astype(np.float32)
    logits[0, [3, 17]] = np.nan  # never picked
    logits[1, [5, 6]] = np.inf
    logits[2, :] = -np.inf
    logits[3, [0, 1]] = -0.0, 0.0
    by_thread = [host(a) for a in moe_route(dev(np.concatenate([logits] * 5)), 6)]  # > 16 tokens: a thread each
    by_block = [host(a) for a in moe_route(dev(logits), 6)]
    np.testing.assert_array_equal(by_block[0], by_thread[0][:4])
    np.testing.assert_array_equal(by_block[1], by_thread[1][:4])
    assert 3 not in by_block[0][0] and 17 not in by_block[0][0]


def _reference_groups(ids, weights, num_experts, block_m):
    pair_expert = ids.reshape(-1)
    order = np.argsort(pair_expert, kind="stable")  # by expert, pair order within
    counts = np.bincount(pair_expert, minlength=num_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    tiles = [(e, offsets[e] + s, min(block_m, counts[e] - s)) for e in range(num_experts)
             for s in range(0, counts[e], block_m)]
    return counts, offsets, order // ids.shape[1], weights.reshape(-1)[order], np.array(tiles).reshape(-1, 3)


def test_group_makes_one_segment_per_expert_in_pair_order():
    rng = np.random.default_rng(81)
    num_tokens, top_k, num_experts, block_m = 13, 4, 6, 4
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
    ids[:8, 0] = 5  # one crowded expert spans several tiles
    weights = rng.uniform(size=(num_tokens, top_k)).astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), num_experts, block_m, threads=8)  # 52 pairs: two 32-pair chunks
    counts, offsets, pair_token, pair_weight, tiles = _reference_groups(ids, weights, num_experts, block_m)
    np.testing.assert_array_equal(host(groups.counts), counts)
    np.testing.assert_array_equal(host(groups.offsets), offsets)
    np.testing.assert_array_equal(host(groups.pair_token), pair_token)
    np.testing.assert_array_equal(host(groups.pair_weight), pair_weight)
    num_tiles = int(host(groups.num_tiles)[0])
    assert num_tiles == len(tiles) <= groups.max_tiles
    got_tiles = np.stack([host(a)[:num_tiles] for a in (groups.tile_expert, groups.tile_start, groups.tile_rows)], 1)
    np.testing.assert_array_equal(got_tiles, tiles)


def test_a_grouping_reuses_the_scratch_an_earlier_one_left():
    # a chunk's next layer groups into the previous layer's arrays where they fit, and its groups are its own
    rng = np.random.default_rng(82)
    num_tokens, top_k, num_experts, block_m = 13, 4, 6, 4
    scratch = {}
    for layer in range(3):
        ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
        weights = rng.uniform(size=(num_tokens, top_k)).astype(np.float32)
        before = dict(scratch)
        groups = moe_group(dev(ids), dev(weights), num_experts, block_m, threads=8, scratch=scratch)
        if layer:
            assert all(scratch[role] is array for role, array in before.items())  # nothing new was taken
        assert groups.pair_token is scratch["pair_token"] and groups.tile_rows is scratch["tile_rows"]
        counts, offsets, pair_token, pair_weight, tiles = _reference_groups(ids, weights, num_experts, block_m)
        np.testing.assert_array_equal(host(groups.pair_token), pair_token)
        np.testing.assert_array_equal(host(groups.pair_weight), pair_weight)
        num_tiles = int(host(groups.num_tiles)[0])
        got = np.stack([host(a)[:num_tiles] for a in (groups.tile_expert, groups.tile_start, groups.tile_rows)], 1)
        np.testing.assert_array_equal(got, tiles)
    fewer = moe_group(dev(ids[:5]), dev(weights[:5]), num_experts, block_m, threads=8, scratch=scratch)
    assert fewer.pair_token.shape == (20,) and scratch["pair_token"] is fewer.pair_token  # a new shape: new arrays
    np.testing.assert_array_equal(host(fewer.counts), _reference_groups(ids[:5], weights[:5], num_experts,
                                                                       block_m)[0])


def test_route_rejects_top_k_above_the_expert_count():
    with pytest.raises(ValueError, match="top_k 9 exceeds the 8 experts"):
        moe_route(np.zeros((2, 8), np.float32), 9)
    with pytest.raises(ValueError, match="weights must have shape"):
        moe_group(np.zeros((2, 4), np.int32), np.zeros((2, 3), np.float32), 8, 4)
