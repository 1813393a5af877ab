"""Device functions that dequantize one octet (8 consecutive elements) of a packed matrix row.

Every format shares one signature, so a kernel is compiled per format by closing over the
function `dequant8_for(fmt)` returns:

    device_dequant8_<fmt>(quants, scales, extra, row, octet, out, out_off)
        writes elements [8*octet, 8*octet + 8) of `row` as float32 into out[out_off : out_off + 8]

An octet of any format reads at most two uint32 words per quant plane plus one scale, so
neighbouring threads taking neighbouring octets read neighbouring words (coalesced), and the
values never leave registers when the caller's `out` is a local array.

Small integers become floats through the exponent trick (bits 0x4B000000 | q is the float
2^23 + q): on sm_90 an int-to-float conversion issues at 16 per clock per SM, an eighth of the
FMA rate, and a 4-bit GEMV at HBM speed needs more conversions than that. The bitcast is free
on the GPU (libdevice `int_as_float`); the simulator gets the same bitcast through NumPy.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
from numba import cuda

from strata.model.iquant_tables import IQ2S_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL

from ._common import IS_SIMULATOR

if IS_SIMULATOR:

    def _int_as_float(bits):
        return np.uint32(bits).view(np.float32)

else:
    from numba.cuda.libdevice import int_as_float as _int_as_float

_MAGIC_BITS = 0x4B000000  # float 2^23: OR-ing a small integer into its mantissa adds it
TWO_23 = np.float32(8388608.0)
TWO_23_PLUS_8 = np.float32(8388616.0)  # nibble - 8 (Q4_0)
TWO_23_PLUS_16 = np.float32(8388624.0)  # 5-bit - 16 (Q5_0)
TWO_23_PLUS_32 = np.float32(8388640.0)  # 6-bit - 32 (Q6_K)
TWO_23_PLUS_128 = np.float32(8388736.0)  # byte with flipped sign bit - 128 = int8 (Q8_0)


@cuda.jit(device=True)
def device_small_int_to_float(q, bias):
    """float(q) - (bias - 2^23) for 0 <= q < 2^23, without an int-to-float conversion."""
    return _int_as_float(np.int32(_MAGIC_BITS | q)) - bias


@cuda.jit(device=True)
def device_sign_extend_byte(b):
    v = np.int32(b)
    return v - ((v & 0x80) << 1)


@cuda.jit(device=True)
def device_dequant8_q4_0(quants, scales, extra, row, octet, out, out_off):
    # block = 16 bytes of nibbles: byte j holds element j (low) and element j + 16 (high)
    block = octet // 4
    sub = octet % 4
    word = block * 4 + (sub % 2) * 2
    shift = (sub // 2) * 4
    d = np.float32(scales[row, block])
    w0 = quants[row, word]
    w1 = quants[row, word + 1]
    for i in range(4):
        out[out_off + i] = d * device_small_int_to_float((w0 >> (8 * i + shift)) & 0xF, TWO_23_PLUS_8)
        out[out_off + 4 + i] = d * device_small_int_to_float((w1 >> (8 * i + shift)) & 0xF, TWO_23_PLUS_8)


@cuda.jit(device=True)
def device_dequant8_q4_1(quants, scales, extra, row, octet, out, out_off):
    block = octet // 4
    sub = octet % 4
    word = block * 4 + (sub % 2) * 2
    shift = (sub // 2) * 4
    d = np.float32(scales[row, 2 * block])
    m = np.float32(scales[row, 2 * block + 1])
    w0 = quants[row, word]
    w1 = quants[row, word + 1]
    for i in range(4):
        out[out_off + i] = d * device_small_int_to_float((w0 >> (8 * i + shift)) & 0xF, TWO_23) + m
        out[out_off + 4 + i] = d * device_small_int_to_float((w1 >> (8 * i + shift)) & 0xF, TWO_23) + m


@cuda.jit(device=True)
def device_dequant8_q8_0(quants, scales, extra, row, octet, out, out_off):
    block = octet // 4
    word = block * 8 + (octet % 4) * 2
    d = np.float32(scales[row, block])
    w0 = quants[row, word] ^ 0x80808080  # int8 -> offset binary, so each byte is q + 128
    w1 = quants[row, word + 1] ^ 0x80808080
    for i in range(4):
        out[out_off + i] = d * device_small_int_to_float((w0 >> (8 * i)) & 0xFF, TWO_23_PLUS_128)
        out[out_off + 4 + i] = d * device_small_int_to_float((w1 >> (8 * i)) & 0xFF, TWO_23_PLUS_128)


@cuda.jit(device=True)
def device_q4_k_scale_min(extra, row, base, j):
    """6-bit scale and min of sub-block j (0..7) from the 12 packed bytes at extra[row, base:]."""
    if j < 4:
        sc = extra[row, base + j] & 63
        mn = extra[row, base + j + 4] & 63
    else:
        sc = (extra[row, base + j + 4] & 0xF) | ((extra[row, base + j - 4] >> 6) << 4)
        mn = (extra[row, base + j + 4] >> 4) | ((extra[row, base + j] >> 6) << 4)
    return np.float32(np.int32(sc)), np.float32(np.int32(mn))


@cuda.jit(device=True)
def device_dequant8_q4_k(quants, scales, extra, row, octet, out, out_off):
    # super-block of 256 = 8 sub-blocks of 32; bytes 32c..32c+31 hold sub-block 2c (low) and 2c+1 (high)
    sb = octet // 32
    s = octet % 32
    j = s // 4
    word = sb * 32 + (j // 2) * 8 + (s % 4) * 2
    shift = (j % 2) * 4
    sc, mn = device_q4_k_scale_min(extra, row, sb * 12, j)
    d = np.float32(scales[row, 2 * sb]) * sc
    m = np.float32(scales[row, 2 * sb + 1]) * mn
    w0 = quants[row, word]
    w1 = quants[row, word + 1]
    for i in range(4):
        out[out_off + i] = d * device_small_int_to_float((w0 >> (8 * i + shift)) & 0xF, TWO_23) - m
        out[out_off + 4 + i] = d * device_small_int_to_float((w1 >> (8 * i + shift)) & 0xF, TWO_23) - m


@cuda.jit(device=True)
def device_dequant8_q6_k(quants, scales, extra, row, octet, out, out_off):
    # per half n of 128: element 32q + l takes ql[64n + 32(q%2) + l] nibble q//2, qh[32n + l] bits 2q
    sb = octet // 32
    e = (octet % 32) * 8
    n = e // 128
    q = (e % 128) // 32
    l0 = e % 32
    ql_word = sb * 48 + n * 16 + (q % 2) * 8 + l0 // 4
    qh_word = sb * 48 + 32 + n * 8 + l0 // 4
    lo_shift = (q // 2) * 4
    hi_shift = q * 2
    d = np.float32(scales[row, sb]) * np.float32(
        device_sign_extend_byte(extra[row, sb * 16 + n * 8 + q * 2 + l0 // 16]))
    lo0 = quants[row, ql_word]
    lo1 = quants[row, ql_word + 1]
    hi0 = quants[row, qh_word]
    hi1 = quants[row, qh_word + 1]
    for i in range(4):
        q0 = ((lo0 >> (8 * i + lo_shift)) & 0xF) | (((hi0 >> (8 * i + hi_shift)) & 3) << 4)
        q1 = ((lo1 >> (8 * i + lo_shift)) & 0xF) | (((hi1 >> (8 * i + hi_shift)) & 3) << 4)
        out[out_off + i] = d * device_small_int_to_float(q0, TWO_23_PLUS_32)
        out[out_off + 4 + i] = d * device_small_int_to_float(q1, TWO_23_PLUS_32)


@cuda.jit(device=True)
def device_dequant8_float(quants, scales, extra, row, octet, out, out_off):
    """F16 and F32: `quants` holds the values themselves."""
    base = octet * 8
    for i in range(8):
        out[out_off + i] = np.float32(quants[row, base + i])


# --- the formats after the first seven: one direct dequantizer each (no split halves yet) ---
# Module-level tables a device function reads are compiled into the kernel as constant arrays.

_IQ4_LEVELS = KVALUES_IQ4NL.astype(np.float32)
_KSIGNS = KSIGNS_IQ2XS
_IQ3XXS_GRID = IQ3XXS_GRID
_IQ3S_GRID = IQ3S_GRID
_IQ2S_GRID_WORDS = IQ2S_GRID.view(np.uint32)  # entry k: words 2k (elements 0..3) and 2k + 1 (4..7)


@cuda.jit(device=True)
def device_dequant8_bf16(quants, scales, extra, row, octet, out, out_off):
    """BF16: `quants` holds the raw uint16 bits, the upper half of each float32."""
    base = octet * 8
    for i in range(8):
        out[out_off + i] = _int_as_float(np.int32(np.uint32(quants[row, base + i]) << 16))


@cuda.jit(device=True)
def device_dequant8_q5_0(quants, scales, extra, row, octet, out, out_off):
    # block = 5 words: qh (bit j: element j's fifth bit), then the nibbles as Q4_0's
    block = octet // 4
    sub = octet % 4
    word = block * 5 + 1 + (sub % 2) * 2
    shift = (sub // 2) * 4
    high = quants[row, block * 5] >> (8 * sub)
    d = np.float32(scales[row, block])
    w0 = quants[row, word]
    w1 = quants[row, word + 1]
    for i in range(4):
        q0 = ((w0 >> (8 * i + shift)) & 0xF) | (((high >> i) & 1) << 4)
        q1 = ((w1 >> (8 * i + shift)) & 0xF) | (((high >> (4 + i)) & 1) << 4)
        out[out_off + i] = d * device_small_int_to_float(q0, TWO_23_PLUS_16)
        out[out_off + 4 + i] = d * device_small_int_to_float(q1, TWO_23_PLUS_16)


@cuda.jit(device=True)
def device_dequant8_q5_1(quants, scales, extra, row, octet, out, out_off):
    block = octet // 4
    sub = octet % 4
    word = block * 5 + 1 + (sub % 2) * 2
    shift = (sub // 2) * 4
    high = quants[row, block * 5] >> (8 * sub)
    d = np.float32(scales[row, 2 * block])
    m = np.float32(scales[row, 2 * block + 1])
    w0 = quants[row, word]
    w1 = quants[row, word + 1]
    for i in range(4):
        q0 = ((w0 >> (8 * i + shift)) & 0xF) | (((high >> i) & 1) << 4)
        q1 = ((w1 >> (8 * i + shift)) & 0xF) | (((high >> (4 + i)) & 1) << 4)
        out[out_off + i] = d * device_small_int_to_float(q0, TWO_23) + m
        out[out_off + 4 + i] = d * device_small_int_to_float(q1, TWO_23) + m


@cuda.jit(device=True)
def device_dequant8_iq4_nl(quants, scales, extra, row, octet, out, out_off):
    block = octet // 4
    sub = octet % 4
    word = block * 4 + (sub % 2) * 2
    shift = (sub // 2) * 4
    d = np.float32(scales[row, block])
    w0 = quants[row, word]
    w1 = quants[row, word + 1]
    for i in range(4):
        out[out_off + i] = d * _IQ4_LEVELS[(w0 >> (8 * i + shift)) & 0xF]
        out[out_off + 4 + i] = d * _IQ4_LEVELS[(w1 >> (8 * i + shift)) & 0xF]


@cuda.jit(device=True)
def device_dequant8_q5_k(quants, scales, extra, row, octet, out, out_off):
    # super-block = 40 words: qh[32] (byte l, bit j: element l of sub-block j), then qs as Q4_K's
    sb = octet // 32
    s = octet % 32
    j = s // 4
    qh_word = sb * 40 + (s % 4) * 2
    qs_word = sb * 40 + 8 + (j // 2) * 8 + (s % 4) * 2
    shift = (j % 2) * 4
    sc, mn = device_q4_k_scale_min(extra, row, sb * 12, j)
    d = np.float32(scales[row, 2 * sb]) * sc
    m = np.float32(scales[row, 2 * sb + 1]) * mn
    w0 = quants[row, qs_word]
    w1 = quants[row, qs_word + 1]
    h0 = quants[row, qh_word]
    h1 = quants[row, qh_word + 1]
    for i in range(4):
        q0 = ((w0 >> (8 * i + shift)) & 0xF) | (((h0 >> (8 * i + j)) & 1) << 4)
        q1 = ((w1 >> (8 * i + shift)) & 0xF) | (((h1 >> (8 * i + j)) & 1) << 4)
        out[out_off + i] = d * device_small_int_to_float(q0, TWO_23) - m
        out[out_off + 4 + i] = d * device_small_int_to_float(q1, TWO_23) - m


@cuda.jit(device=True)
def device_dequant8_iq4_xs(quants, scales, extra, row, octet, out, out_off):
    # sub-block j: 16 bytes at word 4j, elements 0..15 the low nibbles, 16..31 the high ones;
    # extra per super-block: scales_h (u16), scales_l[4]
    sb = octet // 32
    j = (octet % 32) // 4
    e0 = (octet % 4) * 8
    word = sb * 32 + 4 * j + (e0 % 16) // 4
    shift = (e0 // 16) * 4
    base = sb * 6
    scales_h = np.int32(extra[row, base]) | (np.int32(extra[row, base + 1]) << 8)
    low = (np.int32(extra[row, base + 2 + j // 2]) >> (4 * (j % 2))) & 0xF
    ls = low | (((scales_h >> (2 * j)) & 3) << 4)
    dl = np.float32(scales[row, sb]) * np.float32(ls - 32)
    w0 = quants[row, word]
    w1 = quants[row, word + 1]
    for i in range(4):
        out[out_off + i] = dl * _IQ4_LEVELS[(w0 >> (8 * i + shift)) & 0xF]
        out[out_off + 4 + i] = dl * _IQ4_LEVELS[(w1 >> (8 * i + shift)) & 0xF]


@cuda.jit(device=True)
def device_signed_grid4(entry, signs, sign_shift, db, out, out_off):
    """out[out_off + i] = db * byte i of `entry`, negated where bit sign_shift + i of `signs` is set (i < 4)."""
    for i in range(4):
        v = db * device_small_int_to_float((entry >> (8 * i)) & 0xFF, TWO_23)
        out[out_off + i] = -v if (signs >> (sign_shift + i)) & 1 else v


@cuda.jit(device=True)
def device_dequant8_iq3_xxs(quants, scales, extra, row, octet, out, out_off):
    # super-block = 24 words: qs[64] (two grid indices per octet), then aux[8] (one per sub-block of 32)
    sb = octet // 32
    ib = (octet % 32) // 4
    g = octet % 4
    indices = quants[row, sb * 24 + 2 * ib + g // 2] >> ((g % 2) * 16)
    aux = quants[row, sb * 24 + 16 + ib]
    db = np.float32(scales[row, sb]) * (np.float32(0.5) + device_small_int_to_float(aux >> 28, TWO_23)) \
        * np.float32(0.5)
    signs = np.int32(_KSIGNS[(aux >> (7 * g)) & 127])
    device_signed_grid4(_IQ3XXS_GRID[indices & 0xFF], signs, 0, db, out, out_off)
    device_signed_grid4(_IQ3XXS_GRID[(indices >> 8) & 0xFF], signs, 4, db, out, out_off + 4)


@cuda.jit(device=True)
def device_dequant8_iq3_s(quants, scales, extra, row, octet, out, out_off):
    # super-block = 26 words: qs[64], qh[8] (ninth index bits), signs[32] (a bit an element); extra: scales[4]
    sb = octet // 32
    o = octet % 32
    ib = o // 4
    indices = quants[row, sb * 26 + o // 2] >> ((o % 2) * 16)
    high = quants[row, sb * 26 + 16 + ib // 4] >> (8 * (ib % 4) + 2 * (o % 4))
    signs = np.int32((quants[row, sb * 26 + 18 + o // 4] >> (8 * (o % 4))) & 0xFF)
    sc = (np.int32(extra[row, sb * 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF
    db = np.float32(scales[row, sb]) * device_small_int_to_float(1 + 2 * sc, TWO_23)
    device_signed_grid4(_IQ3S_GRID[(indices & 0xFF) | ((high & 1) << 8)], signs, 0, db, out, out_off)
    device_signed_grid4(_IQ3S_GRID[((indices >> 8) & 0xFF) | (((high >> 1) & 1) << 8)], signs, 4, db, out,
                        out_off + 4)


@cuda.jit(device=True)
def device_dequant8_iq2_s(quants, scales, extra, row, octet, out, out_off):
    # super-block = 18 words: qs[32] (one grid index of 8 elements an octet), signs[32], qh[8]; extra: scales[8]
    sb = octet // 32
    o = octet % 32
    byte_shift = 8 * (o % 4)
    high = (quants[row, sb * 18 + 16 + o // 16] >> (8 * ((o // 4) % 4) + 2 * (o % 4))) & 3
    index = ((quants[row, sb * 18 + o // 4] >> byte_shift) & 0xFF) | (high << 8)
    signs = np.int32((quants[row, sb * 18 + 8 + o // 4] >> byte_shift) & 0xFF)
    sc = (np.int32(extra[row, sb * 8 + o // 4]) >> (4 * ((o // 2) % 2))) & 0xF
    db = np.float32(scales[row, sb]) * (np.float32(0.5) + device_small_int_to_float(sc, TWO_23)) * np.float32(0.25)
    device_signed_grid4(_IQ2S_GRID_WORDS[2 * index], signs, 0, db, out, out_off)
    device_signed_grid4(_IQ2S_GRID_WORDS[2 * index + 1], signs, 4, db, out, out_off + 4)


_DEQUANT8 = MappingProxyType({
    "Q4_0": device_dequant8_q4_0,
    "Q4_1": device_dequant8_q4_1,
    "Q8_0": device_dequant8_q8_0,
    "Q4_K": device_dequant8_q4_k,
    "Q6_K": device_dequant8_q6_k,
    "F16": device_dequant8_float,
    "F32": device_dequant8_float,
    "BF16": device_dequant8_bf16,
    "Q5_0": device_dequant8_q5_0,
    "Q5_1": device_dequant8_q5_1,
    "IQ4_NL": device_dequant8_iq4_nl,
    "Q5_K": device_dequant8_q5_k,
    "IQ4_XS": device_dequant8_iq4_xs,
    "IQ3_XXS": device_dequant8_iq3_xxs,
    "IQ3_S": device_dequant8_iq3_s,
    "IQ2_S": device_dequant8_iq2_s,
})


def dequant8_for(fmt: str):
    """The octet dequantizer of format `fmt` (a name from packing.FORMATS)."""
    try:
        return _DEQUANT8[fmt]
    except KeyError:
        raise ValueError(f"no device dequantizer for format {fmt!r}; supported: {', '.join(_DEQUANT8)}") from None


# Split octet dequantizers: the same numerics as device_dequant8_<fmt>, in two halves so that a
# caller can issue the global loads of a later step before the current step's work and decode
# them after it (a register prefetch):
#
#     device_load8_<fmt>(quants, scales, extra, row, octet, raw_words, raw_floats, slot)
#         raw words/scales of the octet into raw_words[slot * W:], raw_floats[slot * F:]
#     device_decode8_<fmt>(raw_words, raw_floats, slot, octet, out, out_off)
#         out[out_off : out_off + 8] = the octet's float32 values
#
# (W, F) = split_dequant8_for(fmt)[2:]. All-zero raw values decode to zeros in every format.

_Q4_0_WORDS, _Q4_0_FLOATS = 2, 1
_Q8_0_WORDS, _Q8_0_FLOATS = 2, 1
_Q4_K_WORDS, _Q4_K_FLOATS = 3, 2  # two quant words, three scale bytes packed in one word; d, dmin
_Q6_K_WORDS, _Q6_K_FLOATS = 5, 1  # ql, ql, qh, qh, the int8 sub-block scale; d
_FLOAT_WORDS, _FLOAT_FLOATS = 1, 8


@cuda.jit(device=True)
def device_load8_q4_0(quants, scales, extra, row, octet, raw_words, raw_floats, slot):
    block = octet // 4
    word = block * 4 + (octet % 2) * 2
    raw_words[slot * _Q4_0_WORDS] = quants[row, word]
    raw_words[slot * _Q4_0_WORDS + 1] = quants[row, word + 1]
    raw_floats[slot * _Q4_0_FLOATS] = np.float32(scales[row, block])


@cuda.jit(device=True)
def device_decode8_q4_0(raw_words, raw_floats, slot, octet, out, out_off):
    shift = ((octet % 4) // 2) * 4
    d = raw_floats[slot * _Q4_0_FLOATS]
    w0 = raw_words[slot * _Q4_0_WORDS]
    w1 = raw_words[slot * _Q4_0_WORDS + 1]
    for i in range(4):
        out[out_off + i] = d * device_small_int_to_float((w0 >> (8 * i + shift)) & 0xF, TWO_23_PLUS_8)
        out[out_off + 4 + i] = d * device_small_int_to_float((w1 >> (8 * i + shift)) & 0xF, TWO_23_PLUS_8)


@cuda.jit(device=True)
def device_load8_q8_0(quants, scales, extra, row, octet, raw_words, raw_floats, slot):
    block = octet // 4
    word = block * 8 + (octet % 4) * 2
    raw_words[slot * _Q8_0_WORDS] = quants[row, word]
    raw_words[slot * _Q8_0_WORDS + 1] = quants[row, word + 1]
    raw_floats[slot * _Q8_0_FLOATS] = np.float32(scales[row, block])


@cuda.jit(device=True)
def device_decode8_q8_0(raw_words, raw_floats, slot, octet, out, out_off):
    d = raw_floats[slot * _Q8_0_FLOATS]
    w0 = raw_words[slot * _Q8_0_WORDS] ^ 0x80808080  # int8 -> offset binary, so each byte is q + 128
    w1 = raw_words[slot * _Q8_0_WORDS + 1] ^ 0x80808080
    for i in range(4):
        out[out_off + i] = d * device_small_int_to_float((w0 >> (8 * i)) & 0xFF, TWO_23_PLUS_128)
        out[out_off + 4 + i] = d * device_small_int_to_float((w1 >> (8 * i)) & 0xFF, TWO_23_PLUS_128)


@cuda.jit(device=True)
def device_load8_q4_k(quants, scales, extra, row, octet, raw_words, raw_floats, slot):
    sb = octet // 32
    s = octet % 32
    j = s // 4
    word = sb * 32 + (j // 2) * 8 + (s % 4) * 2
    base = sb * 12
    # the bytes device_q4_k_scale_min reads for sub-block j: [j], [j + 4], and [j - 4] when j >= 4
    low_j = np.uint32(extra[row, base + j])
    high_j = np.uint32(extra[row, base + j + 4])
    prev_j = np.uint32(extra[row, base + j - 4]) if j >= 4 else np.uint32(0)
    raw_words[slot * _Q4_K_WORDS] = quants[row, word]
    raw_words[slot * _Q4_K_WORDS + 1] = quants[row, word + 1]
    raw_words[slot * _Q4_K_WORDS + 2] = low_j | (high_j << 8) | (prev_j << 16)
    raw_floats[slot * _Q4_K_FLOATS] = np.float32(scales[row, 2 * sb])
    raw_floats[slot * _Q4_K_FLOATS + 1] = np.float32(scales[row, 2 * sb + 1])


@cuda.jit(device=True)
def device_decode8_q4_k(raw_words, raw_floats, slot, octet, out, out_off):
    j = (octet % 32) // 4
    shift = (j % 2) * 4
    packed = raw_words[slot * _Q4_K_WORDS + 2]
    low_j, high_j, prev_j = packed & 0xFF, (packed >> 8) & 0xFF, (packed >> 16) & 0xFF
    if j < 4:
        sc = low_j & 63
        mn = high_j & 63
    else:
        sc = (high_j & 0xF) | ((prev_j >> 6) << 4)
        mn = (high_j >> 4) | ((low_j >> 6) << 4)
    d = raw_floats[slot * _Q4_K_FLOATS] * np.float32(np.int32(sc))
    m = raw_floats[slot * _Q4_K_FLOATS + 1] * np.float32(np.int32(mn))
    w0 = raw_words[slot * _Q4_K_WORDS]
    w1 = raw_words[slot * _Q4_K_WORDS + 1]
    for i in range(4):
        out[out_off + i] = d * device_small_int_to_float((w0 >> (8 * i + shift)) & 0xF, TWO_23) - m
        out[out_off + 4 + i] = d * device_small_int_to_float((w1 >> (8 * i + shift)) & 0xF, TWO_23) - m


@cuda.jit(device=True)
def device_load8_q6_k(quants, scales, extra, row, octet, raw_words, raw_floats, slot):
    sb = octet // 32
    e = (octet % 32) * 8
    n = e // 128
    q = (e % 128) // 32
    l0 = e % 32
    ql_word = sb * 48 + n * 16 + (q % 2) * 8 + l0 // 4
    qh_word = sb * 48 + 32 + n * 8 + l0 // 4
    raw_words[slot * _Q6_K_WORDS] = quants[row, ql_word]
    raw_words[slot * _Q6_K_WORDS + 1] = quants[row, ql_word + 1]
    raw_words[slot * _Q6_K_WORDS + 2] = quants[row, qh_word]
    raw_words[slot * _Q6_K_WORDS + 3] = quants[row, qh_word + 1]
    raw_words[slot * _Q6_K_WORDS + 4] = np.uint32(extra[row, sb * 16 + n * 8 + q * 2 + l0 // 16])
    raw_floats[slot * _Q6_K_FLOATS] = np.float32(scales[row, sb])


@cuda.jit(device=True)
def device_decode8_q6_k(raw_words, raw_floats, slot, octet, out, out_off):
    q = ((octet % 32) * 8 % 128) // 32
    lo_shift = (q // 2) * 4
    hi_shift = q * 2
    sub_scale = device_sign_extend_byte(raw_words[slot * _Q6_K_WORDS + 4])
    d = raw_floats[slot * _Q6_K_FLOATS] * np.float32(sub_scale)
    lo0 = raw_words[slot * _Q6_K_WORDS]
    lo1 = raw_words[slot * _Q6_K_WORDS + 1]
    hi0 = raw_words[slot * _Q6_K_WORDS + 2]
    hi1 = raw_words[slot * _Q6_K_WORDS + 3]
    for i in range(4):
        q0 = ((lo0 >> (8 * i + lo_shift)) & 0xF) | (((hi0 >> (8 * i + hi_shift)) & 3) << 4)
        q1 = ((lo1 >> (8 * i + lo_shift)) & 0xF) | (((hi1 >> (8 * i + hi_shift)) & 3) << 4)
        out[out_off + i] = d * device_small_int_to_float(q0, TWO_23_PLUS_32)
        out[out_off + 4 + i] = d * device_small_int_to_float(q1, TWO_23_PLUS_32)


@cuda.jit(device=True)
def device_load8_float(quants, scales, extra, row, octet, raw_words, raw_floats, slot):
    base = octet * 8
    for i in range(8):
        raw_floats[slot * _FLOAT_FLOATS + i] = np.float32(quants[row, base + i])


@cuda.jit(device=True)
def device_decode8_float(raw_words, raw_floats, slot, octet, out, out_off):
    for i in range(8):
        out[out_off + i] = raw_floats[slot * _FLOAT_FLOATS + i]


_SPLIT_DEQUANT8 = MappingProxyType({
    "Q4_0": (device_load8_q4_0, device_decode8_q4_0, _Q4_0_WORDS, _Q4_0_FLOATS),
    "Q8_0": (device_load8_q8_0, device_decode8_q8_0, _Q8_0_WORDS, _Q8_0_FLOATS),
    "Q4_K": (device_load8_q4_k, device_decode8_q4_k, _Q4_K_WORDS, _Q4_K_FLOATS),
    "Q6_K": (device_load8_q6_k, device_decode8_q6_k, _Q6_K_WORDS, _Q6_K_FLOATS),
    "F16": (device_load8_float, device_decode8_float, _FLOAT_WORDS, _FLOAT_FLOATS),
    "F32": (device_load8_float, device_decode8_float, _FLOAT_WORDS, _FLOAT_FLOATS),
})


def split_dequant8_for(fmt: str):
    """(device_load8, device_decode8, words, floats) of format `fmt`, or None where only the direct
    dequantizer exists (Q4_1 and the formats after the first seven)."""
    return _SPLIT_DEQUANT8.get(fmt)
