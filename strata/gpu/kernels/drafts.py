"""Greedy speculation's small steps on the device: a draft chain's step, a verify step's acceptance, and a
one-row step's inputs spread over a wider step's.

All run inside captured segments, one thread each: what they read and write are a few ids, and
launching them keeps the host out of the loop between a verify step and the next draft.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ._common import ceil_div, check_array, check_power_of_two
from .launcher import jit


@jit
def _take_draft_kernel(token, window, place, row, drafts):  # one thread
    if cuda.grid(1) == 0:
        at = place[0]
        value = window[row[0] + at]
        if value >= 0:
            token[0] = value
        drafts[at] = token[0]
        place[0] = at + 1


def take_draft(token, window, place, row, drafts, *, stream=0):
    """The draft at place p = place[0] of a captured draft chain: token[0] = window[row[0] + p] where that is
    >= 0 (the bench's draft oracle; else kept), drafts[p] = token[0], then place[0] = p + 1. token, place and
    row [1], window [W] and drafts [n] int32 on the device; row[0] + p < W, p < n.

    Launch config: one block of one thread.
    """
    check_array("token", token, dtypes=np.int32, shape=(1,))
    check_array("window", window, dtypes=np.int32, ndim=1)
    check_array("place", place, dtypes=np.int32, shape=(1,))
    check_array("row", row, dtypes=np.int32, shape=(1,))
    check_array("drafts", drafts, dtypes=np.int32, ndim=1)
    _take_draft_kernel[1, 1, stream](token, window, place, row, drafts)
    return token


@jit
def _accept_drafts_kernel(drafts, targets, depth, vocab_size, step_tokens, step_positions, tok_in, pos_in,
                          chain, record):  # one thread
    if cuda.grid(1) != 0:
        return
    accepted = 0
    while accepted < depth and drafts[accepted] == targets[accepted]:
        accepted += 1
    record[0] = accepted
    for i in range(depth + 1):
        record[i + 1] = targets[i]
    start = step_positions[0]
    token = targets[accepted]
    # an id outside the vocabulary (no finite logit) is the host's to report; the next step must not read with it
    step_tokens[0] = token if 0 <= token < vocab_size else 0
    for i in range(depth + 1):
        step_positions[i] = start + accepted + 1 + i
        tok_in[i] = targets[i] if 0 <= targets[i] < vocab_size else 0
        pos_in[i] = start + i
    chain[0] = start + accepted + 1  # the chain's position
    chain[1] = 0  # its place
    chain[2] = accepted  # the row it starts from


def accept_drafts(drafts, targets, depth: int, vocab_size: int, step_inputs, draft_inputs, chain, record, *,
                  stream=0):
    """A greedy verify step of ``depth`` drafts at positions P.. (step_inputs' positions) has picked ``targets``
    [d + 1]: n = the longest prefix of ``drafts`` [d] equal to them, and the next step's inputs, as the host
    would write them once it had read n:

    - record [d + 2] = n, then targets [d + 1] (the step emits targets[:n + 1]);
    - step_inputs [2R] (R = d + 1: tokens, then positions): tokens[0] = targets[n], positions P + n + 1..;
    - draft_inputs [2M] (M >= R: tok_in, then pos_in): the verified rows' next tokens targets[i] at P + i;
    - chain [3]: the draft chain's position P + n + 1, its place 0 and the row it starts from, n.

    Ids outside [0, vocab_size) are written as 0 where a later launch reads them (the record keeps them).

    Launch config: one block of one thread.
    """
    num_rows = depth + 1
    check_array("drafts", drafts, dtypes=np.int32, ndim=1)
    check_array("targets", targets, dtypes=np.int32, ndim=1)
    check_array("step_inputs", step_inputs, dtypes=np.int32, shape=(2 * num_rows,))
    check_array("draft_inputs", draft_inputs, dtypes=np.int32, ndim=1)
    check_array("chain", chain, dtypes=np.int32, shape=(3,))
    check_array("record", record, dtypes=np.int32, ndim=1)
    max_rows = draft_inputs.shape[0] // 2
    if depth < 0 or num_rows > min(targets.shape[0], max_rows) or depth + 2 > record.shape[0] \
            or drafts.shape[0] < depth:
        raise ValueError(f"accept_drafts: depth {depth} does not fit targets {targets.shape[0]}, drafts "
                         f"{drafts.shape[0]}, draft inputs of {max_rows} rows and a record of {record.shape[0]}")
    _accept_drafts_kernel[1, 1, stream](drafts, targets, np.int32(depth), np.int32(vocab_size),
                                        step_inputs[:num_rows], step_inputs[num_rows:], draft_inputs[:max_rows],
                                        draft_inputs[max_rows:], chain, record)
    return record


@jit
def _spread_inputs_kernel(inputs, tokens, positions):  # one thread
    if cuda.grid(1) == 0:
        tokens[0] = inputs[0]
        for i in range(positions.shape[0]):
            positions[i] = inputs[1] + i


def spread_inputs(inputs, wide_inputs, *, stream=0):
    """A one-row step's inputs [2] (token, position P) as the first token and the positions of a step of R rows:
    wide_inputs [2R] (tokens, then positions) gets tokens[0] = the token and positions P..P + R - 1 (its
    other tokens are drafts, copied in by the step). int32 on the device.

    Launch config: one block of one thread.
    """
    check_array("inputs", inputs, dtypes=np.int32, shape=(2,))
    check_array("wide_inputs", wide_inputs, dtypes=np.int32, ndim=1)
    num_rows = wide_inputs.shape[0] // 2
    if wide_inputs.shape[0] != 2 * num_rows or num_rows < 1:
        raise ValueError(f"spread_inputs: wide_inputs holds the tokens and positions of R rows, "
                         f"got {wide_inputs.shape}")
    _spread_inputs_kernel[1, 1, stream](inputs, wide_inputs[:num_rows], wide_inputs[num_rows:])
    return wide_inputs


@jit
def _take_row_kernel(x, row, out):  # out [1, D] = x[row[0]]
    i = cuda.grid(1)
    if i < out.shape[1]:
        out[0, i] = x[row[0], i]


def take_row(x, row, out, *, threads: int = 256, stream=0):
    """out [1, D] = x [R, D] row row[0] (int32 [1] on the device, < R): the row a draft chain starts from,
    chosen by a verify step's acceptance.

    Launch config: grid ceil(D / threads), block `threads`; one element per thread.
    """
    check_array("x", x, dtypes=np.float32, ndim=2)
    check_array("row", row, dtypes=np.int32, shape=(1,))
    check_array("out", out, dtypes=np.float32, shape=(1, x.shape[1]))
    check_power_of_two("threads", threads)
    _take_row_kernel[ceil_div(x.shape[1], threads), threads, stream](x, row, out)
    return out
