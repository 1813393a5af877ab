"""The block-wide sum through shared memory that the norms reduce with (and the shared -inf).

The CUDA simulator has no warp shuffles, so reductions go through shared memory and
`syncthreads`, which both the simulator and the GPU run. Each thread writes one value; on the GPU
pairs are then added in a tree (half the active threads per step, one barrier each: log2(threads)
steps) and every thread reads the root. Every thread reading all the values back in order is the
other way: at 256 threads its serial chain of shared-memory loads made a one-row RMSNorm take
11 us on the H200, but in the simulator, which runs a Python thread per GPU thread, a barrier
costs more than the reads (an engine test ran 50% longer with the tree), so the simulator sums
that way. Both give every thread the bit-identical total; the tests run both. GEMV, attention
and sampling reduce over their own thread groups, inline; GPU-only paths sum a warp with
`device_warp_sum`'s shuffles.

`red` is a float32 shared array of at least `num_threads` elements owned by the caller; the
leading barrier makes it safe to call it back to back with the same `red`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._common import IS_SIMULATOR

NEG_INF = np.float32(-np.inf)


@cuda.jit(device=True)
def device_block_sum_tree(value, red, tid, num_threads):
    cuda.syncthreads()
    red[tid] = value
    cuda.syncthreads()
    active = num_threads  # any count: an odd middle element waits a step
    while active > 1:
        half = (active + 1) // 2
        if tid < active // 2:
            red[tid] += red[tid + half]
        cuda.syncthreads()
        active = half
    return red[0]


@cuda.jit(device=True)
def device_block_sum_serial(value, red, tid, num_threads):
    cuda.syncthreads()
    red[tid] = value
    cuda.syncthreads()
    total = np.float32(0.0)
    for i in range(num_threads):
        total += red[i]
    return total


# the simulator runs a Python thread per GPU thread, and there a barrier costs more than the reads
device_block_sum = device_block_sum_serial if IS_SIMULATOR else device_block_sum_tree


@cuda.jit(device=True)
def device_warp_sum(value):
    """The sum of a warp's values, every lane the same bits (a butterfly: each lane adds the same pairs).
    GPU only: the simulator has no shuffles."""
    offset = 16
    while offset > 0:
        value += cuda.shfl_xor_sync(0xFFFFFFFF, value, offset)
        offset //= 2
    return value


@cuda.jit(device=True)
def device_inv_rms(x, x_row, eps, red, tid, num_threads):
    """1 / sqrt(mean(x[x_row]^2) + eps), computed by the whole block; every thread gets it."""
    num_cols = x.shape[1]
    sum_sq = np.float32(0.0)
    for k in range(tid, num_cols, num_threads):
        v = np.float32(x[x_row, k])
        sum_sq += v * v
    total = device_block_sum(sum_sq, red, tid, num_threads)
    return np.float32(1.0) / np.float32(math.sqrt(total / np.float32(num_cols) + eps))
