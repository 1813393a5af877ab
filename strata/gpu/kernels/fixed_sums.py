"""Sums that come out the same in any order: 64-bit fixed point for prefill's routed-expert outputs.

The MoE down products add each routed pair's output into its token's row with atomics, in whatever
order the tiles finish, and float addition is not associative: two runs of one prompt may differ in
the last bit and a near tie of the logits flips a token. Integer addition is associative, so a
product added as int64 in units of 2^-32 (``UNITS``, rounded half to even) gives the same bits in
every order, and whatever batches a layer's experts came in (the cache's contents, the loan).
``add_fixed_sums`` then adds the whole sum into the float32 residual once. Resolution 2^-32 (finer
than float32's ulp for every value from 2^-8 up).

A product that is not finite, or of magnitude ``MAX_PRODUCT`` or more, adds ``POISON`` instead: at most
2^51 units a product otherwise, a sum of up to 32 products stays below 2^56 unless one was poisoned,
and the fold writes NaN for any sum from ``POISON_FLOOR`` up, so a non-finite expert output still
ends the request as non-finite, as float sums would.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ._common import ceil_div, check_array, check_power_of_two, empty
from .launcher import jit

UNITS = 4294967296.0  # 2^32: a sum's unit is 2^-32
MAX_PRODUCT = 524288.0  # 2^19: a product's magnitude from which it poisons its sum
POISON = 1 << 57  # the units a non-finite or too large product adds
POISON_FLOOR = 1 << 56  # a sum's magnitude from which the fold writes NaN
_THREADS = 256


@cuda.jit(device=True, inline=True)
def to_units(value):
    """A float32 product as int64 units of 2^-32, rounded half to even (value * 2^32 is exact in float32);
    POISON where it is not finite or its magnitude is MAX_PRODUCT or more (NaN fails the comparison)."""
    if abs(value) < np.float32(MAX_PRODUCT):
        return np.int64(round(value * np.float32(UNITS)))
    return np.int64(POISON)


@jit
def _zero_kernel(values):  # values [n] = 0
    i = cuda.grid(1)
    if i < values.shape[0]:
        values[i] = 0


@jit
def _fold_kernel(y, sums):  # y [n] += sums [n] * 2^-32, NaN where a sum was poisoned
    i = cuda.grid(1)
    if i < y.shape[0]:
        total = sums[i]
        if total >= POISON_FLOOR or total <= -POISON_FLOOR:
            y[i] = np.float32(np.nan)
        else:
            y[i] += np.float32(np.float64(total) * (1.0 / UNITS))


def fixed_sums(shape: tuple, like, *, threads: int = _THREADS):
    """A zeroed int64 array of ``shape`` where ``like`` lives (device or host), for kernels to add units into.

    Launch config (on the device): grid ceil(n / threads), block `threads`; one element per thread.
    """
    check_power_of_two("threads", threads)
    sums = empty(tuple(shape), np.int64, like)
    n = int(np.prod(shape))
    if isinstance(sums, np.ndarray):
        sums[...] = 0
    elif n:
        _zero_kernel[ceil_div(n, threads), threads](sums.reshape(n))
    return sums


def add_fixed_sums(y, sums, *, threads: int = _THREADS):
    """y += sums / 2^32 (float32 y, int64 sums of one shape); NaN where a sum holds a poisoned product.

    Launch config: grid ceil(n / threads), block `threads` (default 256); one element per thread.
    """
    check_array("y", y, dtypes=np.float32)
    check_array("sums", sums, dtypes=np.int64, shape=tuple(y.shape))
    check_power_of_two("threads", threads)
    n = int(np.prod(y.shape))
    if n:
        _fold_kernel[ceil_div(n, threads), threads](y.reshape(n), sums.reshape(n))
    return y
