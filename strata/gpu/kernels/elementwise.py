"""Embedding gather from a quantized table, the residual add, a counter step, and float16 rounding."""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ._common import (
    OCTET,
    ceil_div,
    check_array,
    check_power_of_two,
    empty,
    is_device_array,
)
from .launcher import jit
from .packing import PackedMatrix, check_packed
from .quant_device import dequant8_for

_DEFAULT_THREADS = 128
_DEFAULT_ADD_THREADS = 256


@functools.cache
def _embedding_kernel(fmt: str, threads: int):
    dequant8 = dequant8_for(fmt)

    @jit
    def embedding_kernel(quants, scales, extra, token_ids, num_rows, out):  # out [T, cols]
        t = cuda.blockIdx.x
        octet = cuda.blockIdx.y * threads + cuda.threadIdx.x
        if octet * OCTET >= out.shape[1]:
            return
        values = cuda.local.array(OCTET, np.float32)
        row = token_ids[t]
        if row < 0 or row >= num_rows:
            for i in range(OCTET):
                values[i] = np.float32(0.0)
        else:
            dequant8(quants, scales, extra, row, octet, values, 0)
        for i in range(OCTET):
            out[t, octet * OCTET + i] = values[i]

    return embedding_kernel


def embedding(table: PackedMatrix, token_ids, out=None, *, threads: int = _DEFAULT_THREADS, stream=0):
    """out[i] = dequantized table row token_ids[i]; [T] int32 ids -> [T, num_cols] float32.

    Ids outside [0, num_rows) give a row of zeros (checked here when the ids are on the host).

    Launch config: grid (T, ceil(num_cols / 8 / threads)), block `threads` (default 128); thread
    t of block (i, j) dequantizes octet j * threads + t of row token_ids[i].
    """
    check_packed("table", table)
    check_array("token_ids", token_ids, dtypes=np.int32, ndim=1)
    check_power_of_two("threads", threads)
    num_tokens = token_ids.shape[0]
    if not is_device_array(token_ids) and num_tokens and (token_ids.min() < 0 or token_ids.max() >= table.num_rows):
        raise ValueError(f"token_ids must lie in [0, {table.num_rows}), got [{token_ids.min()}, {token_ids.max()}]")
    if out is None:
        out = empty((num_tokens, table.num_cols), np.float32, table.quants, token_ids)
    check_array("out", out, dtypes=np.float32, shape=(num_tokens, table.num_cols))
    if num_tokens == 0:
        return out
    grid = (num_tokens, ceil_div(table.num_cols // OCTET, threads))
    _embedding_kernel(table.fmt, threads)[grid, threads, stream](
        table.quants, table.scales, table.extra, token_ids, table.num_rows, out
    )
    return out


@jit
def _add_kernel(y, x, alpha):  # y [n] += alpha * x [n]
    i = cuda.grid(1)
    if i < y.shape[0]:
        y[i] += alpha * x[i]


def add(y, x, alpha: float = 1.0, *, threads: int = _DEFAULT_ADD_THREADS):
    """y += alpha * x in place (the residual add); float32 arrays of equal shape, any ndim.

    Launch config: grid ceil(n / threads), block `threads` (default 256); one element per thread.
    """
    check_array("y", y, dtypes=np.float32)
    check_array("x", x, dtypes=np.float32, shape=tuple(y.shape))
    check_power_of_two("threads", threads)
    n = int(np.prod(y.shape))
    if n:
        flat_y, flat_x = y.reshape(n), x.reshape(n)
        _add_kernel[ceil_div(n, threads), threads](flat_y, flat_x, np.float32(alpha))
    return y


@jit
def _increment_kernel(values):  # values [n] += 1
    i = cuda.grid(1)
    if i < values.shape[0]:
        values[i] += 1


def increment(values, *, threads: int = _DEFAULT_ADD_THREADS, stream=0):
    """values += 1 in place: [n] int32 on the device (a decode step's position, stepped inside a graph).

    Launch config: grid ceil(n / threads), block `threads` (default 256); one element per thread.
    """
    check_array("values", values, dtypes=np.int32, ndim=1)
    check_power_of_two("threads", threads)
    if values.shape[0]:
        _increment_kernel[ceil_div(values.shape[0], threads), threads, stream](values)
    return values


@jit
def _to_float16_kernel(x, out):  # out [n] = x [n] rounded to float16
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = np.float16(x[i])


def to_float16(x, out=None, *, threads: int = _DEFAULT_ADD_THREADS):
    """x rounded to float16 (round to nearest even, as every f16 staging does): float32 in, any ndim.

    Launch config: grid ceil(n / threads), block `threads` (default 256); one element per thread.
    """
    check_array("x", x, dtypes=np.float32)
    if out is None:
        out = empty(tuple(x.shape), np.float16, x)
    check_array("out", out, dtypes=np.float16, shape=tuple(x.shape))
    check_power_of_two("threads", threads)
    n = int(np.prod(x.shape))
    if n:
        _to_float16_kernel[ceil_div(n, threads), threads](x.reshape(n), out.reshape(n))
    return out
