"""Greedy token selection on the device: the output head, the logit bias and the argmax of
``CudaOps.greedy_token`` against the host's logits and sampler, and the 4-byte readback."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from kernel_data import dev, host, random_gguf_bytes
from numba import config as numba_config

from strata.backend.select import has_cuda_device, make_ops
from strata.engine import sampling
from strata.gpu.kernels.drafts import accept_drafts, spread_inputs, take_draft, take_row
from strata.gpu.kernels.elementwise import increment
from strata.gpu.kernels.sample import add_logit_bias
from strata.gpu.ledger import VramLedger

BACKEND = "cuda" if has_cuda_device() else "cudasim"
pytestmark = pytest.mark.skipif(BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                                reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")


def test_logit_bias_adds_in_list_order_in_float32_like_the_host():
    rng = np.random.default_rng(40)
    logits = rng.standard_normal(300).astype(np.float32)
    logits[7] = 1.0
    # 7 twice (the state's bias, then the request's), where the order changes the float32 sum:
    # (1 + 3 * 2^-24) rounds to 1 + 2^-22, minus 1 leaves 2^-22; the other order leaves 3 * 2^-24
    ids = np.array([7, 299, 7, 0, 150], np.int32)
    values = np.array([3 * 2.0**-24, -np.inf, -1.0, 2.5, -7.25], np.float32)
    expected = logits.copy()
    for token, value in zip(ids, values):
        expected[token] += value
    got = host(add_logit_bias(dev(logits), dev(ids), dev(values)))
    np.testing.assert_array_equal(got, expected)
    assert got[7] == np.float32(2.0**-22) != (np.float32(1.0) - np.float32(1.0)) + np.float32(3 * 2.0**-24)


def test_increment_steps_every_element():
    assert host(increment(dev(np.array([0, 41, -1], np.int32)), threads=2)).tolist() == [1, 42, 0]


def test_take_draft_replaces_where_asked_records_and_steps_its_place():
    token, place, row = dev(np.array([7], np.int32)), dev(np.zeros(1, np.int32)), dev(np.array([2], np.int32))
    window, drafts = dev(np.array([30, 31, -1, 12, 0, -1], np.int32)), dev(np.full(4, -5, np.int32))
    seen = []
    for _ in range(3):  # place p reads window[row + p]
        take_draft(token, window, place, row, drafts)
        seen.append(int(host(token)[0]))
    assert seen == [7, 12, 0] and int(host(place)[0]) == 3  # -1 keeps the draft; 0 is a token id
    assert host(drafts).tolist() == [7, 12, 0, -5]


def test_take_row_copies_the_row_the_device_names():
    x = np.arange(3 * 300, dtype=np.float32).reshape(3, 300)  # more columns than a block of 256 threads
    out = dev(np.zeros((1, 300), np.float32))
    take_row(dev(x), dev(np.array([1], np.int32)), out)
    np.testing.assert_array_equal(host(out), x[1:2])


@pytest.mark.parametrize(("drafts", "targets", "accepted"), [
    ([4, 5, 6], [4, 5, 6, 7], 3),  # every draft taken
    ([4, 9, 6], [4, 5, 6, 7], 1),  # the first refusal ends it, though a later draft agrees
    ([8, 5, 6], [4, 5, 6, 7], 0),
])
def test_accept_drafts_takes_the_agreeing_prefix_and_writes_the_next_steps_inputs(drafts, targets, accepted):
    depth, max_rows, start = 3, 5, 40
    step_inputs = dev(np.array([1, 4, 9, 6, start, start + 1, start + 2, start + 3], np.int32))
    draft_inputs, chain = dev(np.full(2 * max_rows, -3, np.int32)), dev(np.full(3, -3, np.int32))
    record = dev(np.full(max_rows + 1, -3, np.int32))
    accept_drafts(dev(np.array([*drafts, 99], np.int32)), dev(np.array([*targets, 99], np.int32)), depth, 10,
                  step_inputs, draft_inputs, chain, record)
    assert host(record).tolist() == [accepted, *targets, -3]
    next_start = start + accepted + 1  # the step after emits targets[:n + 1] from start + 1 on
    assert host(step_inputs).tolist() == [targets[accepted], 4, 9, 6, *range(next_start, next_start + 4)]
    # every verified row's next token (rows past n draft nothing the chain reads), at its position
    assert host(draft_inputs).tolist() == [*targets, -3, *range(start, start + 4), -3]
    assert host(chain).tolist() == [next_start, 0, accepted]


def test_accept_drafts_writes_no_id_outside_the_vocabulary_where_a_later_launch_reads_it():
    step_inputs, draft_inputs = dev(np.array([1, 0, 7, 8], np.int32)), dev(np.zeros(4, np.int32))
    record, chain = dev(np.zeros(3, np.int32)), dev(np.zeros(3, np.int32))
    accept_drafts(dev(np.array([3], np.int32)), dev(np.array([-1, 12], np.int32)), 1, 10, step_inputs, draft_inputs,
                  chain, record)
    assert host(record).tolist() == [0, -1, 12]  # the host sees what the argmax wrote, and refuses it
    assert host(step_inputs)[0] == 0 and host(draft_inputs)[:2].tolist() == [0, 0]
    with pytest.raises(ValueError, match="does not fit"):
        accept_drafts(dev(np.zeros(2, np.int32)), dev(np.zeros(3, np.int32)), 2, 10, dev(np.zeros(6, np.int32)),
                      draft_inputs, chain, record)  # a record of 3 holds depth 1's


@pytest.mark.parametrize("num_rows", [1, 3])
def test_spread_inputs_gives_a_wider_step_the_token_and_consecutive_positions(num_rows):
    wide = dev(np.array([*range(-1, -1 - num_rows, -1), *[-9] * num_rows], np.int32))
    spread_inputs(dev(np.array([17, 40], np.int32)), wide)
    # the first token and every position; the other tokens (the drafts') untouched
    assert host(wide).tolist() == [17, *range(-2, -1 - num_rows, -1), *range(40, 40 + num_rows)]
    with pytest.raises(ValueError, match="tokens and positions of R rows"):
        spread_inputs(dev(np.array([17, 40], np.int32)), dev(np.zeros(5, np.int32)))


def test_greedy_token_is_the_hosts_pick_from_the_same_biased_logits():
    num_rows, num_cols = 300, 256  # both argmax blocks' slices in the simulator; a Q4_0 row of 8 blocks
    rng = np.random.default_rng(41)
    ops = make_ops(BACKEND, VramLedger(1 << 30))
    head = ops.upload_qtensor("dense_weights", random_gguf_bytes("Q4_0", num_rows, num_cols, rng), QType.Q4_0,
                              (num_rows, num_cols))
    norm = dev(rng.uniform(0.5, 1.5, num_cols).astype(np.float32))
    x = dev(rng.standard_normal((2, num_cols)).astype(np.float32))  # the last row is the one that counts
    logits = ops.logits(x, norm, head, 1e-6)  # [V] host
    # ban the host's pick and lift the last token to (about) the best of the rest
    top = int(np.argmax(logits))
    rest = np.delete(np.arange(num_rows), top)
    second, lifted = int(rest[np.argmax(logits[rest])]), int(rest[-1])
    bias_map = {top: -np.inf, lifted: float(logits[second] - logits[lifted])}
    expected = sampling.sample(logits, sampling.SamplingParams(temperature=0, logit_bias=bias_map), None)
    assert expected in (second, lifted)
    bias = (dev(np.array(list(bias_map), np.int32)), dev(np.array(list(bias_map.values()), np.float32)))
    token = dev(np.array([-1], np.int32))
    ops.greedy_token(x, norm, head, 1e-6, bias, token)
    readback = ops.readback()
    try:
        assert readback.read(readback.queue(token)) == expected
    finally:
        readback.close()


def test_readback_now_reads_small_arrays_at_once_and_passes_none_through():
    ops = make_ops(BACKEND, VramLedger(1 << 30))
    ids = np.array([[5, 1, 7, 3]], np.int32)
    weights = np.array([[0.5, 0.25, 0.125, 0.125]], np.float32)
    readback = ops.readback()
    try:
        got_ids, nothing, got_weights = readback.now(dev(ids), None, dev(weights))
        with pytest.raises(ValueError, match="contiguous arrays"):
            readback.now(dev(np.zeros(2048, np.float32)))  # 8 KiB: more than the pinned scratch
    finally:
        readback.close()
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_weights, weights)
    assert nothing is None and got_ids.dtype == np.int32 and got_ids.shape == (1, 4)
