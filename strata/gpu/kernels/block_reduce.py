"""The block-wide sum through shared memory that the norms reduce with (and the shared -inf).

The CUDA simulator has no warp shuffles, so reductions go through shared memory and
`syncthreads`, which both the simulator and the GPU run. Each thread writes one value, then every
thread reads all of them back in the same order: no second barrier to broadcast the result, and
every thread gets the bit-identical total. The reads are broadcasts (one address per step across
the block), so they cost no bank conflicts; at 128-256 threads this is a few hundred cycles per
call, paid once per kernel, never per element. (GEMV, attention and sampling reduce over their
own thread groups the same way, inline.)

`red` is a float32 shared array of at least `num_threads` elements owned by the caller; the
leading barrier makes it safe to call it back to back with the same `red`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

NEG_INF = np.float32(-np.inf)


@cuda.jit(device=True)
def device_block_sum(value, red, tid, num_threads):
    cuda.syncthreads()
    red[tid] = value
    cuda.syncthreads()
    total = np.float32(0.0)
    for i in range(num_threads):
        total += red[i]
    return total


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
