"""A decode step's routing in one launch: RMSNorm, the router's logits, softmax and top-k.

Before, a decode layer launched three kernels between its attention and its experts (the norm, the
router's GEMV, the routing), and a resident token four (its ids mapped to cache slots): at one token
each is a few microseconds of latency, not of bandwidth, 48 times a token. Here, per token t (grid
(blocks, T)):

    every block:     h_t = rms_norm(x_t) * w (block 0 also writes it out: the experts read it) and
                     its router row's logit. On the GPU a block is one row and a thread's columns of
                     x are its columns of the row: it loads them all (the row's, x's and the norm's:
                     one latency, not a load's after the norm's reduction), keeps h in registers, and
                     the row's sum meets in warp shuffles and one barrier. The simulator stages h in
                     shared memory for 8 rows a block and sums each in a fixed tree
    the last block:  (a counter per token, bumped after a fence, names it) routes the token from the
                     logits as ``moe_route``'s block kernel does (``block_route_device``, the same
                     bits), maps each pick through a slot table when given, and zeroes the counter

h has the bits of ``norm.rms_norm`` at its default block (the same sum of squares and products), so
the experts read what they read before; the logits come from this kernel's own sums (an uncaptured
forward's router GEMV sums in another order, so where two logits nearly tie it may pick another expert).
The router is F32 or F16 (llama.cpp's quantizer never quantizes it; a BF16 one takes the separate
launches). A row's results do not depend on T or on the other rows, so a verify step's rows equal
one-token steps'. The counters are the caller's: zeroed once, they return to zero at the end of every
launch (a graph replays them as they are).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._common import IS_SIMULATOR, check_array, empty, is_finite_number
from .block_reduce import device_block_sum, device_inv_rms, device_warp_sum
from .launcher import jit
from .moe_route import BLOCK_ROUTE_RANKS, MAX_BLOCK_ROUTE_EXPERTS, block_route_device
from .norm import DEFAULT_THREADS as NORM_THREADS

FORMATS = ("F32", "F16")  # router storage the kernel reads (``PackedMatrix.quants`` [E, D] as is)
_THREADS = NORM_THREADS  # h's bits are rms_norm's at its default block
# router rows a block: on the GPU one (a row's 2,048 columns are 8 loads a thread); the simulator, which runs
# a Python thread per GPU thread and pays for every barrier, takes 8 a block (4 threads a row)
_ROWS_PER_BLOCK = 8 if IS_SIMULATOR else 1
_WARP = 32
# the simulator sizes dynamic shared memory by a dtype instance
_XS_DTYPE = np.dtype(np.float32) if IS_SIMULATOR else np.float32


def is_supported(router, num_rows: int, top_k: int) -> bool:
    """Whether ``decode_route`` takes this router ([E, D] packed) for ``num_rows`` tokens."""
    return (router.fmt in FORMATS and router.num_rows <= MAX_BLOCK_ROUTE_EXPERTS and 0 < top_k <= router.num_rows
            and num_rows > 0)


@functools.cache
def _decode_route_kernel(top_k: int, is_norm: bool, num_cols: int):
    threads, rows_per_block = _THREADS, _ROWS_PER_BLOCK
    lanes = threads // rows_per_block  # threads a router row, a power of two
    is_row_a_block = lanes == threads  # the GPU's shape: a thread's columns of x are its columns of the row
    num_own = -(-num_cols // threads)  # columns a thread normalizes
    num_warps = threads // _WARP
    block_route = block_route_device(top_k, is_norm, threads)

    @jit
    def decode_route_kernel(x, norm_w, eps, router, h, logits, ids, weights, is_mapped, slot_table, slots, counters):
        # x, h [T, D]; router [E, D]; logits [T, E]; ids, weights, slots [T, k]; counters [>= T] int32; is_mapped:
        # an argument, not a specialization, so that one compiled kernel serves every kind of decode step
        t, block, tid = cuda.blockIdx.y, cuda.blockIdx.x, cuda.threadIdx.x
        num_experts = router.shape[0]
        xs = cuda.shared.array(0, _XS_DTYPE)  # [D] the normed row (the simulator's shape)
        red = cuda.shared.array(threads, np.float32)
        partials = cuda.shared.array(num_warps, np.float32)
        row_s = cuda.shared.array(MAX_BLOCK_ROUTE_EXPERTS, np.float32)
        exps = cuda.shared.array(MAX_BLOCK_ROUTE_EXPERTS, np.float32)
        ranks = cuda.shared.array(BLOCK_ROUTE_RANKS, np.int32)
        scalars = cuda.shared.array(2, np.float32)
        is_last = cuda.shared.array(1, np.int32)
        if is_row_a_block:
            # every load first (the router row's, x's, the norm's), in flight together; then device_inv_rms's sum
            # of squares in its order, the products in rms_norm's, the row's in column order
            w_own = cuda.local.array(num_own, np.float32)
            x_own = cuda.local.array(num_own, np.float32)
            n_own = cuda.local.array(num_own, np.float32)
            for i in range(num_own):
                c = tid + i * threads
                if c < num_cols and block < num_experts:
                    w_own[i] = np.float32(router[block, c])
            for i in range(num_own):
                c = tid + i * threads
                if c < num_cols:
                    x_own[i] = np.float32(x[t, c])
                    n_own[i] = norm_w[c]
            sum_sq = np.float32(0.0)
            for i in range(num_own):
                if tid + i * threads < num_cols:
                    sum_sq += x_own[i] * x_own[i]
            total = device_block_sum(sum_sq, red, tid, threads)
            inv_rms = np.float32(1.0) / np.float32(math.sqrt(total / np.float32(num_cols) + eps))
            total = np.float32(0.0)
            for i in range(num_own):
                c = tid + i * threads
                if c < num_cols:
                    v = x_own[i] * inv_rms * n_own[i]
                    if block == 0:
                        h[t, c] = v
                    total += w_own[i] * v
            total = device_warp_sum(total)
            if tid % _WARP == 0:
                partials[tid // _WARP] = total
            cuda.syncthreads()
            if tid == 0 and block < num_experts:
                logit = np.float32(0.0)
                for w in range(num_warps):
                    logit += partials[w]
                logits[t, block] = logit
        else:
            inv_rms = device_inv_rms(x, t, eps, red, tid, threads)
            for c in range(tid, num_cols, threads):
                v = np.float32(x[t, c]) * inv_rms * norm_w[c]  # norm.rms_norm's product, in its order
                xs[c] = v
                if block == 0:
                    h[t, c] = v
            cuda.syncthreads()
            lane, expert = tid % lanes, block * rows_per_block + tid // lanes
            total = np.float32(0.0)
            if expert < num_experts:
                for c in range(lane, num_cols, lanes):
                    total += np.float32(router[expert, c]) * xs[c]
            red[tid] = total
            cuda.syncthreads()
            half = lanes // 2
            while half > 0:  # each row's lanes in a fixed tree
                if lane < half:
                    red[tid] += red[tid + half]
                cuda.syncthreads()
                half //= 2
            if lane == 0 and expert < num_experts:
                logits[t, expert] = red[tid]
        cuda.threadfence()  # the logits are seen by whichever block routes
        cuda.syncthreads()
        if tid == 0:
            is_last[0] = 1 if cuda.atomic.add(counters, t, 1) == cuda.gridDim.x - 1 else 0
        cuda.syncthreads()
        if is_last[0] == 0:
            return
        cuda.threadfence()
        for e in range(tid, num_experts, threads):
            row_s[e] = logits[t, e]
        cuda.syncthreads()
        block_route(row_s, num_experts, exps, ranks, scalars, ids, weights, t, tid)
        cuda.syncthreads()
        if is_mapped != 0:
            for j in range(tid, top_k, threads):
                expert_id = ids[t, j]
                slot = -1
                if 0 <= expert_id < slot_table.shape[0]:
                    slot = slot_table[expert_id]
                slots[t, j] = slot if slot >= 0 else -1
        if tid == 0:
            counters[t] = 0  # the next launch counts from zero

    return decode_route_kernel


def decode_route(x, norm_weight, eps: float, router, top_k: int, counters, *, norm_weights: bool = True,
                 slot_table=None, logits=None, stream=0):
    """(h, ids, weights, slots): h = rms_norm(x) * norm_weight [T, D] float32, and the top-k experts of h's
    router logits, ids [T, k] int32 and weights [T, k] float32 as ``moe_route`` gives them; slots [T, k] int32:
    ``slot_table`` [N] (-1: none) at each id, -1 where it has none (None without a table).

    x [T, D] float32; norm_weight [D] float32; router: PackedMatrix [E, D] in FORMATS (``is_supported``);
    counters [>= T] int32 on the device, zero, the caller's (zero again after the launch); logits: [T, E] float32
    for the router's logits (scratch of the launch's own when None).
    Launch config: grid (E, T) (ceil(E / 8), T in the simulator), block 256 threads (32 in the simulator), dynamic
    shared memory 4 D bytes.
    """
    check_array("x", x, dtypes=np.float32, ndim=2)
    num_tokens, num_cols = x.shape
    check_array("norm_weight", norm_weight, dtypes=np.float32, shape=(num_cols,))
    if not is_supported(router, num_tokens, top_k) or router.num_cols != num_cols:
        raise ValueError(f"decode_route takes an F32/F16 router of at most {MAX_BLOCK_ROUTE_EXPERTS} rows and "
                         f"{num_cols} columns, top_k in 1..rows and at least one token; got {router.fmt} "
                         f"[{router.num_rows}, {router.num_cols}], top_k {top_k}, {num_tokens} tokens")
    if not is_finite_number(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    check_array("counters", counters, dtypes=np.int32, ndim=1)
    if counters.shape[0] < num_tokens:
        raise ValueError(f"counters holds {counters.shape[0]} tokens' counts, the launch has {num_tokens}")
    num_experts = router.num_rows
    h = empty((num_tokens, num_cols), np.float32, x)
    if logits is None:
        logits = empty((num_tokens, num_experts), np.float32, x)
    check_array("logits", logits, dtypes=np.float32, shape=(num_tokens, num_experts))
    ids = empty((num_tokens, top_k), np.int32, x)
    weights = empty((num_tokens, top_k), np.float32, x)
    is_mapped = slot_table is not None
    if is_mapped:
        check_array("slot_table", slot_table, dtypes=np.int32, ndim=1)
    slots = empty((num_tokens, top_k), np.int32, x) if is_mapped else ids
    table = slot_table if is_mapped else counters  # not read unmapped
    num_blocks = -(-num_experts // _ROWS_PER_BLOCK)
    kernel = _decode_route_kernel(top_k, bool(norm_weights), num_cols)
    shared_bytes = 0 if _ROWS_PER_BLOCK == 1 else 4 * num_cols  # the simulator's shape stages the normed row
    kernel[(num_blocks, num_tokens), _THREADS, stream, shared_bytes](
        x, norm_weight, np.float32(eps), router.quants, h, logits, ids, weights, np.int32(is_mapped), table, slots,
        counters)
    return h, ids, weights, (slots if is_mapped else None)
