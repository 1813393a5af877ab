"""Quantization formats: block layouts, vectorized dequantization, Q8_0/Q4_0 quantization.

The I-quants (IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_S) decode in `quants_iq`.

Every format stores a row of `num_cols` values as `num_cols / block_elems` consecutive blocks of
`block_bytes` bytes; rows follow each other with no padding. All multi-byte fields are
little-endian; `f16` is IEEE half. The GPU kernels read these same bytes, so each layout is
spelled out at the function that decodes it. Element index `j` is the position inside a block.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.errors import ModelFormatError
from strata.model import quants_iq

QK = 32  # elements per block of the legacy formats
QK_K = 256  # elements per super-block of the k-quant formats


def block_layout(qtype: QType) -> tuple[int, int]:
    """(block_elems, block_bytes) of a supported format."""
    try:
        return _LAYOUTS[QType(qtype)]
    except (KeyError, ValueError):
        raise ModelFormatError(f"unsupported quant type {_name(qtype)}; supported: {supported_names()}") from None


def supported_names() -> str:
    return ", ".join(t.name for t in _LAYOUTS)


def is_supported(qtype: QType) -> bool:
    try:
        return QType(qtype) in _LAYOUTS
    except ValueError:
        return False


def row_nbytes(qtype: QType, num_cols: int) -> int:
    """Bytes of one row of `num_cols` values."""
    block_elems, block_bytes = block_layout(qtype)
    if num_cols % block_elems:
        raise ModelFormatError(f"{QType(qtype).name} rows need a multiple of {block_elems} columns, got {num_cols}")
    return num_cols // block_elems * block_bytes


def dequantize(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode the raw bytes of a tensor of NumPy `shape` to float32 (F32 input: a read-only view)."""
    qtype = QType(qtype)
    shape = tuple(int(d) for d in shape)
    num_rows = int(np.prod(shape[:-1], dtype=np.int64))
    expected = num_rows * row_nbytes(qtype, shape[-1]) if shape else block_layout(qtype)[1]
    flat = np.asarray(raw).reshape(-1)
    if flat.dtype != np.uint8 or flat.size != expected:
        raise ModelFormatError(
            f"{qtype.name} tensor of shape {list(shape)} needs {expected} uint8 bytes, got {flat.size} {flat.dtype}"
        )
    _, block_bytes = _LAYOUTS[qtype]
    blocks = flat.reshape(-1, block_bytes)  # [num_blocks, block_bytes]
    return _DECODERS[qtype](blocks).reshape(shape)


# --- plain floats -------------------------------------------------------------------------


def _dequant_f32(blocks: np.ndarray) -> np.ndarray:
    """F32: 4 bytes per value."""
    return blocks.view(np.float32)


def _dequant_f16(blocks: np.ndarray) -> np.ndarray:
    """F16: 2 bytes per value, IEEE half."""
    return blocks.view(np.float16).astype(np.float32)


def _dequant_bf16(blocks: np.ndarray) -> np.ndarray:
    """BF16: 2 bytes per value, the upper 16 bits of the float32."""
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# --- legacy 32-element blocks -------------------------------------------------------------


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0, 34 bytes: [0:2] f16 d, [2:34] int8 q[j]. y[j] = d * q[j]."""
    d = _f16(blocks, 0)  # [N, 1]
    return blocks[:, 2:].view(np.int8).astype(np.float32) * d


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0, 18 bytes: [0:2] f16 d, [2:18] qs[16] nibbles.

    y[j] = d * ((qs[j] & 0xF) - 8) and y[j + 16] = d * ((qs[j] >> 4) - 8) for j < 16: low nibbles
    hold the first half of the block, high nibbles the second half.
    """
    q = _nibbles(blocks[:, 2:18]).astype(np.int8) - np.int8(8)  # [N, 32]
    return q.astype(np.float32) * _f16(blocks, 0)


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1, 20 bytes: [0:2] f16 d, [2:4] f16 m, [4:20] qs[16] nibbles (order as Q4_0).

    y[j] = d * q[j] + m with q unsigned 0..15.
    """
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)  # [N, 32]
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0, 22 bytes: [0:2] f16 d, [2:6] u32 qh (fifth bits), [6:22] qs[16] nibbles.

    q[j] = nibble[j] | (bit j of qh) << 4 with nibbles ordered as Q4_0; y[j] = d * (q[j] - 16).
    """
    qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)  # [N, 1]
    high = ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, 32]
    q = (_nibbles(blocks[:, 6:22]) | (high << 4)).astype(np.int8) - np.int8(16)
    return q.astype(np.float32) * _f16(blocks, 0)


def _dequant_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1, 24 bytes: [0:2] f16 d, [2:4] f16 m, [4:8] u32 qh, [8:24] qs[16] nibbles.

    q[j] as Q5_0, unsigned 0..31; y[j] = d * q[j] + m.
    """
    qh = np.ascontiguousarray(blocks[:, 4:8]).view(np.uint32)  # [N, 1]
    high = ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, 32]
    q = (_nibbles(blocks[:, 8:24]) | (high << 4)).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


# --- k-quants: 256-element super-blocks ---------------------------------------------------


def _dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K, 144 bytes: [0:2] f16 d, [2:4] f16 dmin, [4:16] scales[12], [16:144] qs[128].

    Eight sub-blocks of 32 with 6-bit scale sc[s] and min m[s] packed in `scales`:
    s < 4: sc = scales[s] & 63, m = scales[s + 4] & 63;
    s >= 4: sc = (scales[s + 4] & 0xF) | (scales[s - 4] >> 6) << 4,
            m  = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4.
    Chunk c < 4 uses qs[32c : 32c + 32]: low nibbles are sub-block 2c (elements 64c + l),
    high nibbles sub-block 2c + 1 (elements 64c + 32 + l). y = d * sc * q - dmin * m.
    """
    num_blocks = blocks.shape[0]
    sc, m = _k_scale_min(blocks[:, 4:16])  # [N, 8] each
    d = (_f16(blocks, 0) * sc).reshape(num_blocks, 8, 1)
    dm = (_f16(blocks, 2) * m).reshape(num_blocks, 8, 1)
    qs = blocks[:, 16:144].reshape(num_blocks, 4, 1, 32)
    q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF).reshape(num_blocks, 8, 32)
    return (d * q.astype(np.float32) - dm).reshape(num_blocks, QK_K)


def _dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K, 176 bytes: [0:2] f16 d, [2:4] f16 dmin, [4:16] scales[12], [16:48] qh[32], [48:176] qs[128].

    As Q4_K, with a fifth bit: element l of sub-block s (l < 32) adds (qh[l] >> s & 1) << 4.
    """
    num_blocks = blocks.shape[0]
    sc, m = _k_scale_min(blocks[:, 4:16])  # [N, 8] each
    d = (_f16(blocks, 0) * sc).reshape(num_blocks, 8, 1)
    dm = (_f16(blocks, 2) * m).reshape(num_blocks, 8, 1)
    qs = blocks[:, 48:176].reshape(num_blocks, 4, 1, 32)
    low = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF).reshape(num_blocks, 8, 32)
    high = (blocks[:, 16:48].reshape(num_blocks, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = (low | (high << 4)).astype(np.float32)
    return (d * q - dm).reshape(num_blocks, QK_K)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]  # [N, 4] each
    sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


def _dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K, 210 bytes: [0:128] ql, [128:192] qh, [192:208] int8 scales[16], [208:210] f16 d.

    Two halves h of 128 elements use ql[64h : 64h + 64] and qh[32h : 32h + 32]; for l < 32:
    element 128h + l      = ql[l] & 0xF      | (qh[l] >> 0 & 3) << 4
    element 128h + l + 32 = ql[l + 32] & 0xF | (qh[l] >> 2 & 3) << 4
    element 128h + l + 64 = ql[l] >> 4       | (qh[l] >> 4 & 3) << 4
    element 128h + l + 96 = ql[l + 32] >> 4  | (qh[l] >> 6 & 3) << 4
    (ql, qh offset by the half). y[e] = d * scales[e // 16] * (q[e] - 32).
    """
    num_blocks = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(num_blocks, 2, 1, 64)
    ql = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF).reshape(num_blocks, 2, 4, 32)
    qh = blocks[:, 128:192].reshape(num_blocks, 2, 1, 32)
    qh = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # [N, 2, 4, 32]
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [N, 16]
    return (scale.reshape(num_blocks, 16, 1) * q.reshape(num_blocks, 16, 16).astype(np.float32)).reshape(
        num_blocks, QK_K
    )


# --- quantization -------------------------------------------------------------------------


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0 bytes of `x` [..., C] (C a multiple of 32): shape [..., C / 32 * 34], as ggml rounds."""
    blocks = _as_blocks(x)  # [N, 32]
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
    scaled = blocks * inv_d
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8)  # round half away
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """Q4_0 bytes of `x` [..., C] (C a multiple of 32): shape [..., C / 32 * 18], as ggml rounds.

    d = (the value of largest magnitude, with its sign) / -8, so that value maps to q = 0 exactly.
    """
    blocks = _as_blocks(x)  # [N, 32]
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1, keepdims=True), axis=1)
    d = extreme / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.clip(np.trunc(blocks * inv_d + np.float32(8.5)), 0, 15).astype(np.uint8)  # [N, 32]
    packed = q[:, :16] | (q[:, 16:] << 4)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), packed], axis=1)
    return out.reshape(*x.shape[:-1], -1)


# --- helpers ------------------------------------------------------------------------------


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte `offset` of each block, as float32 [N, 1]."""
    return np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[N, 16] packed bytes -> [N, 32] values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _as_blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK:
        raise ValueError(f"quantization needs a last dimension that is a multiple of {QK}, got shape {x.shape}")
    return x.reshape(-1, QK)


def _name(qtype) -> str:
    try:
        return QType(qtype).name
    except ValueError:
        return f"#{int(qtype)}"


_LAYOUTS: dict[QType, tuple[int, int]] = {
    QType.F32: (1, 4),
    QType.F16: (1, 2),
    QType.BF16: (1, 2),
    QType.Q8_0: (QK, 34),
    QType.Q4_0: (QK, 18),
    QType.Q4_1: (QK, 20),
    QType.Q5_0: (QK, 22),
    QType.Q5_1: (QK, 24),
    QType.Q4_K: (QK_K, 144),
    QType.Q5_K: (QK_K, 176),
    QType.Q6_K: (QK_K, 210),
    QType.IQ4_NL: (QK, 18),
    QType.IQ4_XS: (QK_K, 136),
    QType.IQ3_XXS: (QK_K, 98),
    QType.IQ3_S: (QK_K, 110),
    QType.IQ2_S: (QK_K, 82),
}

_DECODERS = {
    QType.F32: _dequant_f32,
    QType.F16: _dequant_f16,
    QType.BF16: _dequant_bf16,
    QType.Q8_0: _dequant_q8_0,
    QType.Q4_0: _dequant_q4_0,
    QType.Q4_1: _dequant_q4_1,
    QType.Q5_0: _dequant_q5_0,
    QType.Q5_1: _dequant_q5_1,
    QType.Q4_K: _dequant_q4_k,
    QType.Q5_K: _dequant_q5_k,
    QType.Q6_K: _dequant_q6_k,
    QType.IQ4_NL: quants_iq.dequant_iq4_nl,
    QType.IQ4_XS: quants_iq.dequant_iq4_xs,
    QType.IQ3_XXS: quants_iq.dequant_iq3_xxs,
    QType.IQ3_S: quants_iq.dequant_iq3_s,
    QType.IQ2_S: quants_iq.dequant_iq2_s,
}
