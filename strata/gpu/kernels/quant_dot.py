"""Dot products of one unit of a packed row with staged activations: the GEMVs' inner loop.

A unit is what one lane loads of a row per step, and lane i takes unit i, so a warp's loads of a
row are contiguous:

    Q4_0, Q4_1, Q4_K  16 el  words 2u, 2u+1 (8 bytes of nibbles, one block / one sub-block pair)
    Q8_0               8 el  words 2u, 2u+1
    Q6_K              16 el  ql words w, w+8 and qh word (per super-block: 8 consecutive lanes
                             read 32 consecutive bytes of each, whole sectors)
    F16, F32           8 el  elements u, u+U, ..., u+7U (U = ceil(K / 8): each a contiguous warp load)

The block stages x once in shared memory, unit-major within each slot (slot = the element's place
in the unit, ordered by bit position in its word): xs[slot * num_units + unit], so the 32 lanes of
a warp read 32 consecutive floats per slot (no bank conflicts) and keep them in registers for all
the rows they multiply. Formats with a minimum add sum slots (sum of x over the unit's elements
that share one min): Q4_1 one, Q4_K two (low and high nibbles: two sub-blocks).

Each staged value is pre-scaled by 2^-p, p the bit position its quant is read at, so a quant is
never shifted down: (word & (0xF << p)) | 0x4B000000 is the float 2^23 + q 2^p (exact while
q 2^p < 2^23), one LOP3; subtracting 2^23 + zero 2^p gives (q - zero) 2^p exactly; one FFMA with
x 2^-p. Nibbles above bit 19 come from one shift of the word by 12. That is 3 instructions per
4-bit element (4 per Q6_K element), the block scale applied once per unit.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
from numba import cuda

from ._common import ceil_div
from .packing import quant_format
from .quant_device import TWO_23, device_q4_k_scale_min, device_sign_extend_byte, device_small_int_to_float

_NIBBLE_SHIFTS = (0, 4, 8, 12, 16, 8, 12, 16)  # bit position of nibble t of a word (t >= 5: after >> 12)
_Q8_SHIFTS = (0, 8, 0, 8)  # byte i of a word (i >= 2: after >> 16)


class UnitLayout(NamedTuple):
    """How a format's row splits into units and how x is staged for them."""

    unit_elems: int  # element slots per unit
    sum_slots: int  # extra slots holding sums of x over parts of the unit

    @property
    def slots(self) -> int:
        return self.unit_elems + self.sum_slots


_LAYOUTS = MappingProxyType({
    "Q4_0": UnitLayout(16, 0), "Q4_1": UnitLayout(16, 1), "Q8_0": UnitLayout(8, 0), "Q4_K": UnitLayout(16, 2),
    "Q6_K": UnitLayout(16, 0), "F16": UnitLayout(8, 0), "F32": UnitLayout(8, 0),
})


def unit_layout(fmt: str) -> UnitLayout:
    quant_format(fmt)
    return _LAYOUTS[fmt]


def num_units(fmt: str, num_cols: int) -> int:
    return ceil_div(num_cols, unit_layout(fmt).unit_elems)


def staged_floats(fmt: str, num_cols: int) -> int:
    """Shared-memory floats the staged x of a [*, num_cols] matrix of format `fmt` takes."""
    return num_units(fmt, num_cols) * unit_layout(fmt).slots


# ---- where each slot's element sits, its pre-scale, and which sum slot it feeds (-1: none) ----

@cuda.jit(device=True)
def _slot_q4_0(unit, slot, units):
    # word 2u + wi of block u // 2; byte i: element 4 * word_in_block + i, high nibble + 16
    wi, t = slot // 8, slot % 8
    return 32 * (unit // 2) + 8 * (unit % 2) + 4 * wi + t // 2 + 16 * (t % 2), _nibble_shift(t), -1


@cuda.jit(device=True)
def _slot_q4_1(unit, slot, units):
    k, p, _ = _slot_q4_0(unit, slot, units)
    return k, p, 0


@cuda.jit(device=True)
def _slot_q4_k(unit, slot, units):
    # 32 bytes per sub-block pair c: byte l holds element 64c + l (low), 64c + 32 + l (high)
    wi, t = slot // 8, slot % 8
    v = unit % 16
    l4 = 2 * (v % 4) + wi
    return 256 * (unit // 16) + 64 * (v // 4) + 32 * (t % 2) + 4 * l4 + t // 2, _nibble_shift(t), t % 2


@cuda.jit(device=True)
def _slot_q8_0(unit, slot, units):
    return 8 * unit + slot, 8 * (slot % 2), -1


@cuda.jit(device=True)
def _slot_q6_k(unit, slot, units):
    # element 128n + 32q + l: ql[64n + 32(q % 2) + l] nibble q // 2, qh[32n + l] bits 2q
    q, i = slot // 4, slot % 4
    v = unit % 16
    return 256 * (unit // 16) + 128 * (v // 8) + 32 * q + 4 * (v % 8) + i, 8 * (i % 2) + 4 * (q // 2), -1


@cuda.jit(device=True)
def _slot_float(unit, slot, units):
    return slot * units + unit, 0, -1


@cuda.jit(device=True)
def _nibble_shift(t):
    return 4 * t if t < 5 else 4 * t - 12


# ---- unit dot products: xv holds the unit's staged slots ----

def _nibble_word_dot(zero: int):
    """device(w, xv, base) -> (low, high): sums of (nibble - zero) x over the low / high nibbles."""
    b = tuple(np.float32(TWO_23 + zero * 2**p) for p in _NIBBLE_SHIFTS)
    b0, b1, b2, b3, b4, b5, b6, b7 = b

    @cuda.jit(device=True)
    def device_nibble_word_dot(w, xv, base):
        up = w >> 12
        lo = device_small_int_to_float(w & 0xF, b0) * xv[base]
        hi = device_small_int_to_float(w & 0xF0, b1) * xv[base + 1]
        lo += device_small_int_to_float(w & 0xF00, b2) * xv[base + 2]
        hi += device_small_int_to_float(w & 0xF000, b3) * xv[base + 3]
        lo += device_small_int_to_float(w & 0xF0000, b4) * xv[base + 4]
        hi += device_small_int_to_float(up & 0xF00, b5) * xv[base + 5]
        lo += device_small_int_to_float(up & 0xF000, b6) * xv[base + 6]
        hi += device_small_int_to_float(up & 0xF0000, b7) * xv[base + 7]
        return lo, hi

    return device_nibble_word_dot


_nibble_dot_signed = _nibble_word_dot(8)
_nibble_dot = _nibble_word_dot(0)
_Q8_BIAS0 = np.float32(TWO_23 + 128)
_Q8_BIAS8 = np.float32(TWO_23 + 128 * 256)


@cuda.jit(device=True)
def _dot_q4_0(quants, scales, extra, row, unit, units, xv):
    l0, h0 = _nibble_dot_signed(quants[row, 2 * unit], xv, 0)
    l1, h1 = _nibble_dot_signed(quants[row, 2 * unit + 1], xv, 8)
    return np.float32(scales[row, unit // 2]) * ((l0 + h0) + (l1 + h1))


@cuda.jit(device=True)
def _dot_q4_1(quants, scales, extra, row, unit, units, xv):
    l0, h0 = _nibble_dot(quants[row, 2 * unit], xv, 0)
    l1, h1 = _nibble_dot(quants[row, 2 * unit + 1], xv, 8)
    block = unit // 2
    return np.float32(scales[row, 2 * block]) * ((l0 + h0) + (l1 + h1)) + np.float32(scales[row, 2 * block + 1]) * xv[16]


@cuda.jit(device=True)
def _dot_q4_k(quants, scales, extra, row, unit, units, xv):
    l0, h0 = _nibble_dot(quants[row, 2 * unit], xv, 0)
    l1, h1 = _nibble_dot(quants[row, 2 * unit + 1], xv, 8)
    sb = unit // 16
    pair = (unit % 16) // 4
    sc_lo, mn_lo = device_q4_k_scale_min(extra, row, sb * 12, 2 * pair)
    sc_hi, mn_hi = device_q4_k_scale_min(extra, row, sb * 12, 2 * pair + 1)
    dot = sc_lo * (l0 + l1) + sc_hi * (h0 + h1)
    mins = mn_lo * xv[16] + mn_hi * xv[17]
    return np.float32(scales[row, 2 * sb]) * dot - np.float32(scales[row, 2 * sb + 1]) * mins


@cuda.jit(device=True)
def _q8_word_dot(w, xv, base):
    w = w ^ 0x80808080  # int8 -> offset binary: each byte is q + 128
    up = w >> 16
    acc = device_small_int_to_float(w & 0xFF, _Q8_BIAS0) * xv[base]
    acc += device_small_int_to_float(w & 0xFF00, _Q8_BIAS8) * xv[base + 1]
    acc += device_small_int_to_float(up & 0xFF, _Q8_BIAS0) * xv[base + 2]
    acc += device_small_int_to_float(up & 0xFF00, _Q8_BIAS8) * xv[base + 3]
    return acc


@cuda.jit(device=True)
def _dot_q8_0(quants, scales, extra, row, unit, units, xv):
    dot = _q8_word_dot(quants[row, 2 * unit], xv, 0) + _q8_word_dot(quants[row, 2 * unit + 1], xv, 4)
    return np.float32(scales[row, unit // 4]) * dot


_Q6_BIAS0 = np.float32(TWO_23 + 32)
_Q6_BIAS4 = np.float32(TWO_23 + 32 * 16)
_Q6_BIAS8 = np.float32(TWO_23 + 32 * 256)
_Q6_BIAS12 = np.float32(TWO_23 + 32 * 4096)


@cuda.jit(device=True)
def _q6_half_dots(lo0, lo1, hi, xv, i0):
    """Bytes i0, i0 + 1 of the words (already shifted down to bytes 0, 1): sums per q over them."""
    hi4 = hi << 4  # qh bits 2q of byte i land above ql's nibble: q = 0 at bit 4, q = 2 at bit 8
    hi2 = hi << 2  # q = 1 at bit 4, q = 3 at bit 8
    d0 = device_small_int_to_float((lo0 & 0xF) | (hi4 & 0x30), _Q6_BIAS0) * xv[i0]
    d0 += device_small_int_to_float((lo0 & 0xF00) | (hi4 & 0x3000), _Q6_BIAS8) * xv[i0 + 1]
    d1 = device_small_int_to_float((lo1 & 0xF) | (hi2 & 0x30), _Q6_BIAS0) * xv[4 + i0]
    d1 += device_small_int_to_float((lo1 & 0xF00) | (hi2 & 0x3000), _Q6_BIAS8) * xv[5 + i0]
    d2 = device_small_int_to_float((lo0 & 0xF0) | (hi4 & 0x300), _Q6_BIAS4) * xv[8 + i0]
    d2 += device_small_int_to_float((lo0 & 0xF000) | (hi4 & 0x30000), _Q6_BIAS12) * xv[9 + i0]
    d3 = device_small_int_to_float((lo1 & 0xF0) | (hi2 & 0x300), _Q6_BIAS4) * xv[12 + i0]
    d3 += device_small_int_to_float((lo1 & 0xF000) | (hi2 & 0x30000), _Q6_BIAS12) * xv[13 + i0]
    return d0, d1, d2, d3


@cuda.jit(device=True)
def _dot_q6_k(quants, scales, extra, row, unit, units, xv):
    sb = unit // 16
    n = (unit % 16) // 8
    l4 = unit % 8
    ql = sb * 48 + n * 16 + l4
    lo0, lo1, hi = quants[row, ql], quants[row, ql + 8], quants[row, sb * 48 + 32 + n * 8 + l4]
    a0, a1, a2, a3 = _q6_half_dots(lo0, lo1, hi, xv, 0)  # the masks take bytes 0, 1 only
    b0, b1, b2, b3 = _q6_half_dots(lo0 >> 16, lo1 >> 16, hi >> 16, xv, 2)
    sc = sb * 16 + n * 8 + l4 // 4
    dot = np.float32(device_sign_extend_byte(extra[row, sc])) * (a0 + b0)
    dot += np.float32(device_sign_extend_byte(extra[row, sc + 2])) * (a1 + b1)
    dot += np.float32(device_sign_extend_byte(extra[row, sc + 4])) * (a2 + b2)
    dot += np.float32(device_sign_extend_byte(extra[row, sc + 6])) * (a3 + b3)
    return np.float32(scales[row, sb]) * dot


@cuda.jit(device=True)
def _dot_float(quants, scales, extra, row, unit, units, xv):
    num_cols = quants.shape[1]
    acc = np.float32(0.0)
    for slot in range(8):
        k = slot * units + unit
        if k < num_cols:
            acc += np.float32(quants[row, k]) * xv[slot]
    return acc


class UnitOps(NamedTuple):
    layout: UnitLayout
    slot: object  # device(unit, slot, num_units) -> (element, pre-scale shift, sum slot or -1)
    dot: object  # device(quants, scales, extra, row, unit, num_units, xv) -> float32


_OPS = MappingProxyType({
    "Q4_0": (_slot_q4_0, _dot_q4_0), "Q4_1": (_slot_q4_1, _dot_q4_1), "Q8_0": (_slot_q8_0, _dot_q8_0),
    "Q4_K": (_slot_q4_k, _dot_q4_k), "Q6_K": (_slot_q6_k, _dot_q6_k), "F16": (_slot_float, _dot_float),
    "F32": (_slot_float, _dot_float),
})


@functools.cache
def unit_ops(fmt: str) -> UnitOps:
    """The staging map and unit dot product of format `fmt` (a name from packing.FORMATS)."""
    if fmt not in _OPS:
        raise ValueError(f"no unit dot product for format {fmt!r}; supported: {', '.join(_OPS)}")
    return UnitOps(_LAYOUTS[fmt], *_OPS[fmt])
