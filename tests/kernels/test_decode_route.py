import numpy as np
import pytest
from kernel_data import dev, host

from strata.gpu.kernels import packing
from strata.gpu.kernels._common import IS_SIMULATOR
from strata.gpu.kernels.decode_route import decode_route, is_supported
from strata.gpu.kernels.moe_route import moe_route
from strata.gpu.kernels.norm import rms_norm
from strata.model import reference_ops

EPS = 1e-6


def _case(seed, num_tokens, num_cols, num_experts, fmt="F32"):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((num_tokens, num_cols)) * 3).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, num_cols).astype(np.float32)
    w = (rng.standard_normal((num_experts, num_cols)) * 0.1).astype(np.float16 if fmt == "F16" else np.float32)
    return x, norm_w, packing.to_device(packing.pack(w, fmt, num_cols)), w.astype(np.float32)


@pytest.mark.parametrize(("num_tokens", "num_cols", "num_experts", "top_k", "fmt"), [
    (1, 64, 8, 2, "F32"),  # fewer columns than a row's threads unrolled: the tail loop alone
    (2, 300, 12, 4, "F32"),  # columns past the unrolled steps (8 loads of a row's threads): both loops
    (5, 96, 33, 8, "F16"),  # an expert count that is no multiple of the rows a block takes
])
def test_route_in_one_launch_equals_norm_router_and_routing(num_tokens, num_cols, num_experts, top_k, fmt):
    x, norm_w, router, w = _case(num_tokens * 100 + num_cols, num_tokens, num_cols, num_experts, fmt)
    counters = dev(np.zeros(8, np.int32))
    h, ids, weights, slots = decode_route(dev(x), dev(norm_w), EPS, router, top_k, counters)
    assert slots is None
    np.testing.assert_array_equal(host(h), host(rms_norm(dev(x), dev(norm_w), EPS)))  # the experts' input, unchanged
    logits = host(h).astype(np.float64) @ w.T.astype(np.float64)
    ref_ids, ref_weights = reference_ops.route(logits.astype(np.float32), top_k, is_norm_weights=True)
    np.testing.assert_array_equal(host(ids), ref_ids)
    np.testing.assert_allclose(host(weights), ref_weights, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(host(counters), 0)  # ready for the next launch


def test_each_token_has_the_bits_of_its_one_token_launch_and_a_second_launch_repeats_them():
    # a verify step's rows against one-token steps, and the counters' reset between launches
    x, norm_w, router, _ = _case(7, 5, 128, 16)
    counters = dev(np.zeros(5, np.int32))
    together = [host(a) for a in decode_route(dev(x), dev(norm_w), EPS, router, 4, counters)[:3]]
    again = [host(a) for a in decode_route(dev(x), dev(norm_w), EPS, router, 4, counters)[:3]]
    for a, b in zip(together, again):
        np.testing.assert_array_equal(a, b)
    for t in range(5):
        alone = [host(a) for a in decode_route(dev(x[t:t + 1]), dev(norm_w), EPS, router, 4, counters)[:3]]
        for a, b in zip(alone, together):
            np.testing.assert_array_equal(a[0], b[t])


@pytest.mark.parametrize("norm_weights", [False, True])
def test_routing_has_the_bits_of_the_block_router_and_maps_slots(norm_weights):
    # the picks and weights of moe_route's block kernel on the kernel's own logits, bit for bit; slots
    # through the table
    x, norm_w, router, w = _case(9, 3, 64, 10)
    x[1] = 0.0  # every logit 0: a tie over all experts picks ids 0..k-1
    table = np.full(10, -1, np.int32)
    table[[0, 2, 5, 7]] = [40, 41, 42, 43]
    counters, logits = dev(np.zeros(3, np.int32)), dev(np.zeros((3, 10), np.float32))
    h, ids, weights, slots = decode_route(dev(x), dev(norm_w), EPS, router, 3, counters, norm_weights=norm_weights,
                                          slot_table=dev(table), logits=logits)
    assert list(host(ids)[1]) == [0, 1, 2]
    reference = (host(h).astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(host(logits), reference, rtol=1e-5, atol=1e-6)
    block_ids, block_weights = (host(a) for a in moe_route(logits, 3, norm_weights=norm_weights))
    np.testing.assert_array_equal(host(ids), block_ids)
    np.testing.assert_array_equal(host(weights), block_weights)
    expected = np.where(table[host(ids)] >= 0, table[host(ids)], -1)
    np.testing.assert_array_equal(host(slots), expected)


def test_what_the_kernel_cannot_take_is_refused():
    _, norm_w, router, _ = _case(3, 1, 64, 8)
    q8 = packing.to_device(packing.pack(np.zeros((8, 2 * 34), np.uint8), "Q8_0", 64))
    assert is_supported(router, 1, 8) and not is_supported(q8, 1, 8) and not is_supported(router, 1, 9)
    x = dev(np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="F32/F16 router"):
        decode_route(x, dev(norm_w), EPS, q8, 2, dev(np.zeros(2, np.int32)))
    with pytest.raises(ValueError, match="counters holds 1 tokens' counts, the launch has 2"):
        decode_route(x, dev(norm_w), EPS, router, 2, dev(np.zeros(1, np.int32)))


@pytest.mark.skipif(IS_SIMULATOR, reason="the simulator runs blocks one after another: no race to find")
def test_many_launches_of_many_tokens_route_alike_on_the_gpu():
    # blocks finishing in any order, rows sharing cache lines (60 experts), the counters back at zero each time
    x, norm_w, router, w = _case(11, 9, 2048, 60)
    counters = dev(np.zeros(9, np.int32))
    args = (dev(x), dev(norm_w), EPS, router, 8, counters)
    first = [host(a) for a in decode_route(*args)[:3]]
    for _ in range(50):
        again = [host(a) for a in decode_route(*args)[:3]]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(host(counters), 0)
    logits = first[0].astype(np.float64) @ w.T.astype(np.float64)
    ref_ids, _ = reference_ops.route(logits.astype(np.float32), 8, is_norm_weights=True)
    assert (first[1] == ref_ids).mean() > 0.99  # near ties aside
