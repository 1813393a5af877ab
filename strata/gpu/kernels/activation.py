"""SwiGLU, silu(gate) * up, for the paths that do not fuse it into the expert GEMM epilogues."""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._common import ceil_div, check_array, check_power_of_two, empty
from .launcher import jit

_DEFAULT_THREADS = 256


@cuda.jit(device=True)
def device_silu_mul(g, u):
    """silu(g) * u in float32; exp of -|g| never overflows."""
    e = np.float32(math.exp(-abs(g)))
    sigmoid = np.float32(1.0) / (np.float32(1.0) + e) if g >= 0 else e / (np.float32(1.0) + e)
    return g * sigmoid * u


@jit
def _swiglu_kernel(gate, up, out):  # flat [n]
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = device_silu_mul(np.float32(gate[i]), np.float32(up[i]))


def swiglu(gate, up, out=None, *, threads: int = _DEFAULT_THREADS):
    """out = silu(gate) * up elementwise; gate, up [..., F] float32/float16 -> out float32.

    Launch config: grid ceil(n / threads), block `threads` (default 256); one element per thread.
    """
    check_array("gate", gate, dtypes=(np.float32, np.float16))
    check_array("up", up, dtypes=(np.float32, np.float16), shape=tuple(gate.shape))
    check_power_of_two("threads", threads)
    if out is None:
        out = empty(tuple(gate.shape), np.float32, gate, up)
    check_array("out", out, dtypes=np.float32, shape=tuple(gate.shape))
    n = int(np.prod(gate.shape))
    if n:
        _swiglu_kernel[ceil_div(n, threads), threads](gate.reshape(n), up.reshape(n), out.reshape(n))
    return out
