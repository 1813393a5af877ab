"""Copies a captured segment can hold (a driver copy cannot be captured on every stream): two
row-aligned matrices side by side (the MTP block's input ``[norm(embed(x)); norm(h)]``), and one
array into another of its size (a draft step's output into the buffer the next step reads)."""

from __future__ import annotations

import numpy as np
from numba import cuda

from ._common import ceil_div, check_array, check_power_of_two, empty
from .launcher import jit

_DEFAULT_THREADS = 256


@jit
def _concat_kernel(a, b, out):  # a [R, Da], b [R, Db] -> out [R, Da + Db]
    row = cuda.blockIdx.y
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    num_a = a.shape[1]
    if col < num_a:
        out[row, col] = a[row, col]
    elif col < out.shape[1]:
        out[row, col] = b[row, col - num_a]


def concat_columns(a, b, *, threads: int = _DEFAULT_THREADS, stream=0):
    """[R, Da] and [R, Db] float32 -> [R, Da + Db] float32, ``a``'s columns first.

    Launch config: grid (ceil((Da + Db) / threads), R), block ``threads`` (default 256); one output
    element per thread.
    """
    check_array("a", a, dtypes=np.float32, ndim=2)
    check_array("b", b, dtypes=np.float32, ndim=2)
    check_power_of_two("threads", threads)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a has {a.shape[0]} rows and b {b.shape[0]}; concat_columns needs equal rows")
    num_rows, num_cols = a.shape[0], a.shape[1] + b.shape[1]
    out = empty((num_rows, num_cols), np.float32, a, b)
    if num_rows and num_cols:
        _concat_kernel[(ceil_div(num_cols, threads), num_rows), threads, stream](a, b, out)
    return out


@jit
def _copy_kernel(dst, src):  # flat views of equal size
    i = cuda.grid(1)
    if i < dst.shape[0]:
        dst[i] = src[i]


def copy_array(dst, src, *, threads: int = _DEFAULT_THREADS, stream=0):
    """dst[...] = src: device arrays of one dtype and size, contiguous (any shape).

    Launch config: grid ceil(n / threads), block ``threads`` (default 256); one element per thread.
    """
    check_power_of_two("threads", threads)
    if dst.dtype != src.dtype or dst.size != src.size:
        raise ValueError(f"copy_array needs equal dtype and size, got {dst.dtype}[{dst.size}] and "
                         f"{src.dtype}[{src.size}]")
    if dst.size:
        _copy_kernel[ceil_div(dst.size, threads), threads, stream](dst.reshape(dst.size), src.reshape(src.size))
    return dst
