"""Device dot products of one octet of a packed row with 8 activations, for the GEMVs.

    device_dot8_<fmt>(quants, scales, extra, row, octet, xs) -> float32
        sum_i W[row, 8 * octet + i] * xs[i]

Same bits as quant_device's dequantizers, but with the block scale factored out of the sum:
d * sum_i (q_i - bias) x_i (plus m * sum_i x_i for the formats with a minimum). Each word is
shifted once to its nibble, so every element costs shift-by-constant, mask, the exponent-trick
conversion and one FMA; the decode GEMV issues far more instructions per weight byte than the
HBM delivers bytes, so an instruction saved per element is bandwidth gained.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
from numba import cuda

from ._common import OCTET
from .quant_device import (
    TWO_23,
    TWO_23_PLUS_8,
    TWO_23_PLUS_32,
    TWO_23_PLUS_128,
    device_q4_k_scale_min,
    device_sign_extend_byte,
    device_small_int_to_float,
    dequant8_for,
)


@cuda.jit(device=True)
def device_nibble_dot8(w0, w1, bias, xs):
    """sum_i (nibble_i - (bias - 2^23)) xs[i]; nibble i of the pre-shifted words: i < 4 in w0."""
    acc = np.float32(0.0)
    for i in range(4):
        acc += device_small_int_to_float((w0 >> (8 * i)) & 0xF, bias) * xs[i]
        acc += device_small_int_to_float((w1 >> (8 * i)) & 0xF, bias) * xs[4 + i]
    return acc


@cuda.jit(device=True)
def device_sum8(xs):
    total = np.float32(0.0)
    for i in range(OCTET):
        total += xs[i]
    return total


@cuda.jit(device=True)
def device_dot8_q4_0(quants, scales, extra, row, octet, xs):
    block = octet // 4
    sub = octet % 4
    word = block * 4 + (sub % 2) * 2
    shift = (sub // 2) * 4
    return np.float32(scales[row, block]) * device_nibble_dot8(
        quants[row, word] >> shift, quants[row, word + 1] >> shift, TWO_23_PLUS_8, xs)


@cuda.jit(device=True)
def device_dot8_q4_1(quants, scales, extra, row, octet, xs):
    block = octet // 4
    sub = octet % 4
    word = block * 4 + (sub % 2) * 2
    shift = (sub // 2) * 4
    dot = device_nibble_dot8(quants[row, word] >> shift, quants[row, word + 1] >> shift, TWO_23, xs)
    return np.float32(scales[row, 2 * block]) * dot + np.float32(scales[row, 2 * block + 1]) * device_sum8(xs)


@cuda.jit(device=True)
def device_dot8_q8_0(quants, scales, extra, row, octet, xs):
    block = octet // 4
    word = block * 8 + (octet % 4) * 2
    w0 = quants[row, word] ^ 0x80808080  # int8 -> offset binary
    w1 = quants[row, word + 1] ^ 0x80808080
    acc = np.float32(0.0)
    for i in range(4):
        acc += device_small_int_to_float((w0 >> (8 * i)) & 0xFF, TWO_23_PLUS_128) * xs[i]
        acc += device_small_int_to_float((w1 >> (8 * i)) & 0xFF, TWO_23_PLUS_128) * xs[4 + i]
    return np.float32(scales[row, block]) * acc


@cuda.jit(device=True)
def device_dot8_q4_k(quants, scales, extra, row, octet, xs):
    sb = octet // 32
    s = octet % 32
    j = s // 4
    word = sb * 32 + (j // 2) * 8 + (s % 4) * 2
    shift = (j % 2) * 4
    sc, mn = device_q4_k_scale_min(extra, row, sb * 12, j)
    dot = device_nibble_dot8(quants[row, word] >> shift, quants[row, word + 1] >> shift, TWO_23, xs)
    return np.float32(scales[row, 2 * sb]) * sc * dot - np.float32(scales[row, 2 * sb + 1]) * mn * device_sum8(xs)


@cuda.jit(device=True)
def device_dot8_q6_k(quants, scales, extra, row, octet, xs):
    sb = octet // 32
    e = (octet % 32) * 8
    n = e // 128
    q = (e % 128) // 32
    l0 = e % 32
    ql_word = sb * 48 + n * 16 + (q % 2) * 8 + l0 // 4
    qh_word = sb * 48 + 32 + n * 8 + l0 // 4
    lo0 = quants[row, ql_word] >> ((q // 2) * 4)
    lo1 = quants[row, ql_word + 1] >> ((q // 2) * 4)
    hi0 = quants[row, qh_word] >> (q * 2)
    hi1 = quants[row, qh_word + 1] >> (q * 2)
    acc = np.float32(0.0)
    for i in range(4):
        q0 = ((lo0 >> (8 * i)) & 0xF) | (((hi0 >> (8 * i)) & 3) << 4)
        q1 = ((lo1 >> (8 * i)) & 0xF) | (((hi1 >> (8 * i)) & 3) << 4)
        acc += device_small_int_to_float(q0, TWO_23_PLUS_32) * xs[i]
        acc += device_small_int_to_float(q1, TWO_23_PLUS_32) * xs[4 + i]
    sc = device_sign_extend_byte(extra[row, sb * 16 + n * 8 + q * 2 + l0 // 16])
    return np.float32(scales[row, sb]) * np.float32(sc) * acc


@cuda.jit(device=True)
def device_dot8_float(quants, scales, extra, row, octet, xs):
    acc = np.float32(0.0)
    for i in range(OCTET):
        acc += np.float32(quants[row, octet * OCTET + i]) * xs[i]
    return acc


def _dot8_through_dequant8(fmt: str):
    """A dot product that dequantizes the octet first: for the formats without a factored one."""
    dequant8 = dequant8_for(fmt)

    @cuda.jit(device=True)
    def device_dot8_dequantized(quants, scales, extra, row, octet, xs):
        ws = cuda.local.array(OCTET, np.float32)
        dequant8(quants, scales, extra, row, octet, ws, 0)
        acc = np.float32(0.0)
        for i in range(OCTET):
            acc += ws[i] * xs[i]
        return acc

    return device_dot8_dequantized


_DOT8 = MappingProxyType({
    "Q4_0": device_dot8_q4_0,
    "Q4_1": device_dot8_q4_1,
    "Q8_0": device_dot8_q8_0,
    "Q4_K": device_dot8_q4_k,
    "Q6_K": device_dot8_q6_k,
    "F16": device_dot8_float,
    "F32": device_dot8_float,
    **{fmt: _dot8_through_dequant8(fmt)
       for fmt in ("BF16", "Q5_0", "Q5_1", "IQ4_NL", "Q5_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_S")},
})


def dot8_for(fmt: str):
    """The octet dot product of format `fmt` (a name from packing.FORMATS)."""
    try:
        return _DOT8[fmt]
    except KeyError:
        raise ValueError(f"no device dot product for format {fmt!r}; supported: {', '.join(_DOT8)}") from None
