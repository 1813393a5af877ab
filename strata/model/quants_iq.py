"""The I-quant formats: block layouts and vectorized dequantization (registered by `quants`).

Their values come from lookup tables (`iquant_tables`) rather than from integers times a scale:
IQ4 nibbles select one of 16 non-uniform levels, IQ3/IQ2 bytes select a grid entry of 4 or 8
magnitudes, each with a sign bit stored apart. Every super-block is 256 elements (IQ4_NL: 32)
in eight sub-blocks of 32 ("ib32"). Little-endian fields, `f16` IEEE half, as in `quants`.
The arithmetic runs in the order gguf-py's does, so both agree bit for bit.
"""

from __future__ import annotations

import numpy as np

from strata.model.iquant_tables import IQ2S_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL

_IQ3XXS_LEVELS = IQ3XXS_GRID.view(np.uint8).reshape(-1, 4).astype(np.float32)  # [256, 4]
_IQ3S_LEVELS = IQ3S_GRID.view(np.uint8).reshape(-1, 4).astype(np.float32)  # [512, 4]
_IQ2S_LEVELS = IQ2S_GRID.view(np.uint8).reshape(-1, 8).astype(np.float32)  # [1024, 8]
_IQ4_LEVELS = KVALUES_IQ4NL.astype(np.float32)
_BITS8 = np.arange(8, dtype=np.uint8)


def dequant_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL, 18 bytes: [0:2] f16 d, [2:18] qs[16] nibbles ordered as Q4_0. y = d * KVALUES[q]."""
    q = np.concatenate([blocks[:, 2:18] & 0xF, blocks[:, 2:18] >> 4], axis=1)  # [N, 32]
    return _f16(blocks, 0) * _IQ4_LEVELS[q]


def dequant_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS, 136 bytes: [0:2] f16 d, [2:4] u16 scales_h, [4:8] scales_l, [8:136] qs[128].

    Sub-block j's 6-bit scale: ls = (scales_l[j // 2] >> 4 (j % 2) & 0xF) | (scales_h >> 2j & 3) << 4.
    It takes qs[16j : 16j + 16]: low nibbles are its elements 0..15, high nibbles 16..31.
    y = (d * (ls - 32)) * KVALUES[q].
    """
    num_blocks = blocks.shape[0]
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16).astype(np.uint32)  # [N, 1]
    scales_l = blocks[:, 4:8]
    low = np.stack([scales_l & 0xF, scales_l >> 4], axis=2).reshape(num_blocks, 8)
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint32))) & 3
    ls = (low | (high << 4)).astype(np.int8) - np.int8(32)  # [N, 8]
    dl = (_f16(blocks, 0) * ls.astype(np.float32)).reshape(num_blocks, 8, 1)
    qs = blocks[:, 8:136].reshape(num_blocks, 8, 16)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2)  # [N, 8, 32]
    return (dl * _IQ4_LEVELS[q]).reshape(num_blocks, 256)


def dequant_iq3_xxs(blocks: np.ndarray) -> np.ndarray:
    """IQ3_XXS, 98 bytes: [0:2] f16 d, [2:66] qs[64] grid indices, [66:98] u32 aux[8].

    ib32 j takes qs[8j : 8j + 8], each selecting 4 magnitudes of IQ3XXS_GRID, and aux[j]: bits
    7g..7g + 6 (g < 4) index KSIGNS_IQ2XS for the signs of elements 8g..8g + 7 (bit i: element
    8g + i negative), bits 28..31 the scale: y = d * (0.5 + aux >> 28) * 0.5 * magnitude * sign.
    """
    num_blocks = blocks.shape[0]
    aux = np.ascontiguousarray(blocks[:, 66:98]).view(np.uint32)  # [N, 8]
    db = _f16(blocks, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)
    sign_index = (aux[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 0x7F  # [N, 8, 4]
    sign_bits = (KSIGNS_IQ2XS[sign_index][..., None] >> _BITS8) & 1  # [N, 8, 4, 8]
    magnitudes = _IQ3XXS_LEVELS[blocks[:, 2:66]].reshape(num_blocks, 8, 32)
    values = db[:, :, None] * magnitudes
    return np.where(sign_bits.reshape(num_blocks, 8, 32) != 0, -values, values).reshape(num_blocks, 256)


def dequant_iq3_s(blocks: np.ndarray) -> np.ndarray:
    """IQ3_S, 110 bytes: [0:2] f16 d, [2:66] qs[64], [66:74] qh[8], [74:106] signs[32], [106:110] scales[4].

    Grid index k < 64 (elements 4k..4k + 3 of IQ3S_GRID) = qs[k] | (qh[k // 8] >> k % 8 & 1) << 8;
    element e is negative where bit e % 8 of signs[e // 8] is set; ib32 j's scale is nibble j
    of scales (low nibble first): y = d * (1 + 2 * scale) * magnitude * sign.
    """
    num_blocks = blocks.shape[0]
    high = (blocks[:, 66:74, None] >> _BITS8) & 1  # [N, 8, 8]
    index = blocks[:, 2:66].astype(np.uint16) | (high.reshape(num_blocks, 64).astype(np.uint16) << 8)
    scales = np.stack([blocks[:, 106:110] & 0xF, blocks[:, 106:110] >> 4], axis=2).reshape(num_blocks, 8)
    db = _f16(blocks, 0) * (1 + 2 * scales).astype(np.float32)  # [N, 8]
    values = db[:, :, None] * _IQ3S_LEVELS[index].reshape(num_blocks, 8, 32)
    signs = ((blocks[:, 74:106, None] >> _BITS8) & 1).reshape(num_blocks, 8, 32)
    return np.where(signs != 0, -values, values).reshape(num_blocks, 256)


def dequant_iq2_s(blocks: np.ndarray) -> np.ndarray:
    """IQ2_S, 82 bytes: [0:2] f16 d, [2:34] qs[32], [34:66] signs[32], [66:74] qh[8], [74:82] scales[8].

    Grid index k < 32 (elements 8k..8k + 7 of IQ2S_GRID) = qs[k] | (qh[k // 4] >> 2 (k % 4) & 3) << 8;
    signs as IQ3_S; each 16 elements s have scale nibble s of scales (low nibble first):
    y = d * (0.5 + scale) * 0.25 * magnitude * sign.
    """
    num_blocks = blocks.shape[0]
    high = (blocks[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3  # [N, 8, 4]
    index = blocks[:, 2:34].astype(np.uint16) | (high.reshape(num_blocks, 32).astype(np.uint16) << 8)
    scales = np.stack([blocks[:, 74:82] & 0xF, blocks[:, 74:82] >> 4], axis=2).reshape(num_blocks, 16)
    db = _f16(blocks, 0) * (np.float32(0.5) + scales.astype(np.float32)) * np.float32(0.25)  # [N, 16]
    values = db[:, :, None] * _IQ2S_LEVELS[index].reshape(num_blocks, 16, 16)
    signs = ((blocks[:, 34:66, None] >> _BITS8) & 1).reshape(num_blocks, 16, 16)
    return np.where(signs != 0, -values, values).reshape(num_blocks, 256)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16).astype(np.float32)
