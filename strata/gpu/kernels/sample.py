"""Token selection on the GPU: greedy argmax, or a draw with temperature, top-k and top-p.

The chain is the engine's (strata.engine.sampling, llama.cpp's default order): keep the top_k
highest logits (ties to the lower id); keep the smallest prefix of those, by probability, whose
softmax (untempered) sums to >= top_p; divide the kept logits by the temperature, softmax, and
draw with one given uniform number u by inverse CDF over the kept tokens in token-id order.
Temperature 0 is greedy.

Two launches. `candidates`: each of `num_blocks` blocks takes a slice of the vocabulary and
finds its top_k by top_k rounds of a block-wide argmax over the elements that rank after the
previous pick (order: logit down, id up), so no sort and no extra buffer. `select`: one block
takes the top_k of all candidates the same way, then one thread does the top-p cut, the tempered
softmax and the draw on at most MAX_TOP_K values. The per-call numbers (temperature, top_p, u)
are read from a small device array, so a captured graph replays with fresh ones.

top_k must lie in [1, MAX_TOP_K] (llama.cpp's default is 40); a request without a top-k
(top_k = 0, the whole vocabulary) is not served here: the engine samples those on the host.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._common import (
    ceil_div,
    check_array,
    check_power_of_two,
    empty,
    is_device_array,
    is_finite_number,
)
from .block_reduce import NEG_INF
from .launcher import jit

MAX_TOP_K = 64
_POS_INF = np.float32(np.inf)


@functools.cache
def _block_best_device(threads: int, has_ids: bool):
    @cuda.jit(device=True)
    def device_block_best(values, ids, start, stop, prev, prev_id, red_v, red_i, half, tid):
        """The best (value, id) of values[start:stop] that ranks after (prev, prev_id); a
        position's id is ids[p] (has_ids; -1 = empty) or p itself. Every thread gets it."""
        best, best_id = NEG_INF, -1
        for p in range(start + tid, stop, threads):
            v = values[p]
            i = ids[p] if has_ids else p
            is_after = v < prev or (v == prev and i > prev_id)
            if i >= 0 and is_after and (best_id < 0 or v > best or (v == best and i < best_id)):
                best, best_id = v, i
        # two halves of red_v/red_i alternate between calls, so no barrier is needed at the end
        base = half * threads
        red_v[base + tid], red_i[base + tid] = best, best_id
        cuda.syncthreads()
        step = threads // 2
        while step > 0:
            if tid < step:
                v, i = red_v[base + tid + step], red_i[base + tid + step]
                if i >= 0 and (red_i[base + tid] < 0 or v > red_v[base + tid] or
                               (v == red_v[base + tid] and i < red_i[base + tid])):
                    red_v[base + tid], red_i[base + tid] = v, i
            cuda.syncthreads()
            step //= 2
        best, best_id = red_v[base], red_i[base]
        return best, best_id

    return device_block_best


@functools.cache
def _kernels(threads: int):
    red_size = 2 * threads
    index_best = _block_best_device(threads, False)
    candidate_best = _block_best_device(threads, True)

    @jit
    def candidates_kernel(logits, top_k, chunk, cand_val, cand_idx):  # -> [blocks * k]
        tid = cuda.threadIdx.x
        red_v = cuda.shared.array(red_size, np.float32)
        red_i = cuda.shared.array(red_size, np.int32)
        start = cuda.blockIdx.x * chunk
        stop = min(start + chunk, logits.shape[0])
        prev, prev_id = _POS_INF, -1
        for j in range(top_k):
            prev, prev_id = index_best(logits, cand_idx, start, stop, prev, prev_id, red_v, red_i, j % 2, tid)
            if tid == 0:
                cand_val[cuda.blockIdx.x * top_k + j] = prev
                cand_idx[cuda.blockIdx.x * top_k + j] = prev_id

    @jit
    def select_kernel(cand_val, cand_idx, top_k, params, token):  # params: temperature, top_p, u
        tid = cuda.threadIdx.x
        red_v = cuda.shared.array(red_size, np.float32)
        red_i = cuda.shared.array(red_size, np.int32)
        kept_v = cuda.shared.array(MAX_TOP_K, np.float32)
        kept_i = cuda.shared.array(MAX_TOP_K, np.int32)
        prev, prev_id = _POS_INF, -1
        for j in range(top_k):
            prev, prev_id = candidate_best(cand_val, cand_idx, 0, cand_val.shape[0], prev, prev_id,
                                           red_v, red_i, j % 2, tid)
            if tid == 0:
                kept_v[j], kept_i[j] = prev, prev_id
        if tid != 0:
            return
        temperature, top_p, u = params[0], params[1], params[2]
        if temperature <= 0 or top_k == 1:
            token[0] = kept_i[0]
            return
        top = kept_v[0]
        total = np.float32(0.0)
        num_kept = 0
        for j in range(top_k):
            if kept_i[j] >= 0:
                total += np.float32(math.exp(kept_v[j] - top))
                num_kept = j + 1
        cum = np.float32(0.0)
        for j in range(num_kept):  # smallest prefix reaching top_p
            cum += np.float32(math.exp(kept_v[j] - top)) / total
            if cum >= top_p:
                num_kept = j + 1
                break
        for j in range(1, num_kept):  # insertion sort of the kept tokens by id: the draw walks ids upwards
            v, i = kept_v[j], kept_i[j]
            m = j - 1
            while m >= 0 and kept_i[m] > i:
                kept_v[m + 1], kept_i[m + 1] = kept_v[m], kept_i[m]
                m -= 1
            kept_v[m + 1], kept_i[m + 1] = v, i
        weight_sum = np.float32(0.0)
        for j in range(num_kept):
            weight_sum += np.float32(math.exp((kept_v[j] - top) / temperature))
        target = u * weight_sum
        cum = np.float32(0.0)
        chosen = -1
        for j in range(num_kept):
            w = np.float32(math.exp((kept_v[j] - top) / temperature))
            cum += w
            if w > 0:
                chosen = kept_i[j]  # the last token with weight, should rounding leave target unmet
            if cum > target:
                break
        token[0] = chosen

    return candidates_kernel, select_kernel


def sample(logits, *, top_k: int, temperature: float = 1.0, top_p: float = 1.0, uniform: float = 0.5,
           params=None, token=None, workspace=None, num_blocks: int = 64, threads: int = 256, stream=0):
    """The next token id, written to token [1] int32 (returned). logits: [V] float32.

    temperature / top_p / uniform are ignored when params (a [3] float32 array: temperature,
    top_p, u) is given, e.g. a device array refreshed before each graph replay. workspace:
    optional (values [num_blocks * top_k] float32, ids [num_blocks * top_k] int32) for the
    candidates, so that a captured step allocates nothing.

    Launch config: candidates grid num_blocks (default 64), block `threads` (default 256); select
    grid 1, block `threads`; shared memory 4 * threads + 2 * MAX_TOP_K words.
    """
    check_array("logits", logits, dtypes=np.float32, ndim=1)
    vocab = logits.shape[0]
    if not 1 <= top_k <= min(MAX_TOP_K, vocab):
        raise ValueError(f"top_k must lie in [1, {min(MAX_TOP_K, vocab)}] on the GPU, got {top_k}")
    check_power_of_two("threads", threads)
    check_power_of_two("num_blocks", num_blocks)
    if params is None:
        for name, value, low, high in (("temperature", temperature, 0.0, np.inf), ("top_p", top_p, 1e-30, 1.0),
                                       ("uniform", uniform, 0.0, 1.0 - 1e-12)):
            if not is_finite_number(value) or not low <= value <= high:
                raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
        params = np.array([temperature, top_p, uniform], np.float32)
        params = cuda.to_device(params) if is_device_array(logits) else params
    check_array("params", params, dtypes=np.float32, shape=(3,))
    token = empty((1,), np.int32, logits) if token is None else token
    check_array("token", token, dtypes=np.int32, shape=(1,))
    chunk = ceil_div(vocab, num_blocks)
    num_candidates = num_blocks * top_k
    if workspace is None:
        workspace = (empty((num_candidates,), np.float32, logits), empty((num_candidates,), np.int32, logits))
    cand_val, cand_idx = workspace
    check_array("workspace values", cand_val, dtypes=np.float32, shape=(num_candidates,))
    check_array("workspace ids", cand_idx, dtypes=np.int32, shape=(num_candidates,))
    candidates_kernel, select_kernel = _kernels(threads)
    candidates_kernel[num_blocks, threads, stream](logits, top_k, chunk, cand_val, cand_idx)
    select_kernel[1, threads, stream](cand_val, cand_idx, top_k, params, token)
    return token


def argmax(logits, *, token=None, workspace=None, num_blocks: int = 64, threads: int = 256, stream=0):
    """Greedy: the id of the highest logit (the lowest id among equals), as token [1] int32.
    stream: 0, a Numba stream or a graph builder capturing the launches.

    Launch config: as sample's, with one round per block.
    """
    return sample(logits, top_k=1, temperature=0.0, token=token, workspace=workspace, num_blocks=num_blocks,
                  threads=threads, stream=stream)


@jit
def _bias_kernel(logits, ids, values):  # logits [V]; ids, values [n]
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        for j in range(ids.shape[0]):
            logits[ids[j]] += values[j]


def add_logit_bias(logits, ids, values, *, stream=0):
    """logits[ids[j]] += values[j] in place, j in order, in float32: the host's sums, bit for bit,
    a repeated id included. ids [n] int32 in [0, V) (unchecked on the device: check them on the
    host before uploading); values [n] float32 (-inf bans a token).

    Launch config: grid 1, block 1: the lists are a request's few biased tokens, and one thread
    keeps the order of additions.
    """
    check_array("logits", logits, dtypes=np.float32, ndim=1)
    check_array("ids", ids, dtypes=np.int32, ndim=1)
    check_array("values", values, dtypes=np.float32, shape=(ids.shape[0],))
    if ids.shape[0]:
        _bias_kernel[1, 1, stream](logits, ids, values)
    return logits
