"""Random quantized weights written directly as blocks: no float tensor, no quantization pass.

Each block gets uniformly random quant values and a random scale whose sign is random, so every
block is symmetric about zero in distribution and a row's mean is zero in expectation (random
bytes with a fixed-sign scale have mean -0.5 * d per value, which piles up across a 2,048-wide
dot product and sent every token of a 48-layer model to the same experts). The formats with a
min (Q4_1, Q5_1, Q4_K, Q5_K) set it to centre the values exactly. The I-quants keep their random
grid indices (every bit pattern indexes a valid grid entry) and random sign bits, which centre
them. Magnitudes give each value roughly the requested standard deviation. Block layouts are
documented in `strata.model.quants` and `strata.model.quants_iq`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.model import quants
from strata.model.iquant_tables import IQ2S_GRID, IQ3S_GRID, IQ3XXS_GRID, KVALUES_IQ4NL

_UNIFORM_STD = {4: 4.6098, 5: 9.2331, 6: 18.4730, 8: 73.9003}  # std of a uniform b-bit integer
_K_SCALE_MEAN = 47.5  # Q4_K sub-block scales drawn from 32..63
_Q6_K_SCALE_MEAN = 79.5  # Q6_K sub-block scales drawn from +-(32..127)
_IQ4_XS_SCALE_MEAN = 23.5  # IQ4_XS sub-block scales drawn from +-(16..31)
_IQ_SCALE_NIBBLES = (4, 16)  # I-quant 4-bit sub-block scales drawn from 4..15
_IQ_SCALE_NIBBLE_MEAN = 9.5
_IQ4_LEVEL_RMS = float(np.sqrt(np.mean(KVALUES_IQ4NL.astype(np.float64) ** 2)))
_IQ3XXS_RMS = float(np.sqrt(np.mean(IQ3XXS_GRID.view(np.uint8).astype(np.float64) ** 2)))
_IQ3S_RMS = float(np.sqrt(np.mean(IQ3S_GRID.view(np.uint8).astype(np.float64) ** 2)))
_IQ2S_RMS = float(np.sqrt(np.mean(IQ2S_GRID.view(np.uint8).astype(np.float64) ** 2)))


def random_rows(rng: np.random.Generator, qtype: QType, num_rows: int, num_cols: int, std: float) -> np.ndarray:
    """`num_rows` random rows of `num_cols` values in `qtype`, as raw bytes [num_rows, row_bytes]."""
    qtype = QType(qtype)
    row_bytes = quants.row_nbytes(qtype, num_cols)
    if qtype in (QType.F32, QType.F16, QType.BF16):
        values = rng.standard_normal((num_rows, num_cols), dtype=np.float32) * np.float32(std)
        return _float_bytes(values, qtype).reshape(num_rows, row_bytes)
    block_elems, block_bytes = quants.block_layout(qtype)
    num_blocks = num_rows * num_cols // block_elems
    blocks = _random_bytes(rng, num_blocks * block_bytes).reshape(num_blocks, block_bytes)
    _FILL_SCALES[qtype](rng, blocks, std)
    return blocks.reshape(num_rows, row_bytes)


def random_tensor_chunks(
    rng: np.random.Generator, qtype: QType, shape: tuple[int, ...], std: float, max_chunk_bytes: int = 8 << 20
) -> Iterator[np.ndarray]:
    """The bytes of a random tensor of NumPy `shape`, in row chunks of at most ~max_chunk_bytes."""
    num_cols = shape[-1]
    num_rows = int(np.prod(shape[:-1], dtype=np.int64))
    rows_per_chunk = max(1, max_chunk_bytes // quants.row_nbytes(qtype, num_cols))
    for start in range(0, num_rows, rows_per_chunk):
        yield random_rows(rng, qtype, min(rows_per_chunk, num_rows - start), num_cols, std)


def norm_weight(rng: np.random.Generator, size: int) -> np.ndarray:
    """An RMSNorm weight: positive, close to 1. float32 [size]."""
    return (1.0 + 0.1 * rng.standard_normal(size)).clip(0.5, 1.5).astype(np.float32)


def _fill_q4_0(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    _put_f16(blocks, 0, _signed_amplitudes(rng, len(blocks), std / _UNIFORM_STD[4]))


def _fill_q5_0(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    _put_f16(blocks, 0, _signed_amplitudes(rng, len(blocks), std / _UNIFORM_STD[5]))


def _fill_q8_0(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    _put_f16(blocks, 0, _signed_amplitudes(rng, len(blocks), std / _UNIFORM_STD[8]))


def _fill_q4_1(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    d = _signed_amplitudes(rng, len(blocks), std / _UNIFORM_STD[4]).astype(np.float16)
    _put_f16(blocks, 0, d)
    _put_f16(blocks, 2, np.float32(-7.5) * d.astype(np.float32))  # y = d * (q - 7.5)


def _fill_q5_1(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    d = _signed_amplitudes(rng, len(blocks), std / _UNIFORM_STD[5]).astype(np.float16)
    _put_f16(blocks, 0, d)
    _put_f16(blocks, 2, np.float32(-15.5) * d.astype(np.float32))  # y = d * (q - 15.5)


def _fill_q4_k(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    _fill_k_scales(rng, blocks, std / (_UNIFORM_STD[4] * _K_SCALE_MEAN), centre=7.5)


def _fill_q5_k(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    _fill_k_scales(rng, blocks, std / (_UNIFORM_STD[5] * _K_SCALE_MEAN), centre=15.5)


def _fill_k_scales(rng: np.random.Generator, blocks: np.ndarray, mean_abs_d: float, centre: float) -> None:
    """Q4_K and Q5_K: d, dmin and the 6-bit scales and mins, so that y = d * sc * (q - centre)."""
    num_blocks = len(blocks)
    d = _signed_amplitudes(rng, num_blocks, mean_abs_d).astype(np.float16)
    _put_f16(blocks, 0, d)
    _put_f16(blocks, 2, np.float32(centre) * d.astype(np.float32))  # dmin * m = centre * d * sc
    sc = rng.integers(32, 64, size=(num_blocks, 8), dtype=np.uint8)  # [N, 8]; min index m = sc
    blocks[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    blocks[:, 8:12] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    blocks[:, 12:16] = (sc[:, 4:] & 0xF) | ((sc[:, 4:] & 0xF) << 4)


def _fill_iq4_nl(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    _put_f16(blocks, 0, _signed_amplitudes(rng, len(blocks), std / _IQ4_LEVEL_RMS))


def _fill_iq4_xs(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    num_blocks = len(blocks)
    magnitude = rng.integers(16, 32, size=(num_blocks, 8), dtype=np.int16)
    sign = rng.integers(0, 2, size=(num_blocks, 8), dtype=np.int16) * 2 - 1
    ls = (32 + magnitude * sign).astype(np.uint16)  # [N, 8] stored 6-bit scales: ls - 32 = +-(16..31)
    scales_h = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype(np.uint16)
    blocks[:, 2:4] = scales_h.reshape(-1, 1).view(np.uint8)
    blocks[:, 4:8] = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    _put_f16(blocks, 0, np.full(num_blocks, std / (_IQ4_XS_SCALE_MEAN * _IQ4_LEVEL_RMS), np.float32))


def _fill_iq3_xxs(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    num_blocks = len(blocks)
    aux = np.ascontiguousarray(blocks[:, 66:98]).view(np.uint32)  # [N, 8]: random sign indices below bit 28
    nibbles = rng.integers(*_IQ_SCALE_NIBBLES, size=aux.shape, dtype=np.uint32)
    blocks[:, 66:98] = ((aux & 0x0FFFFFFF) | (nibbles << 28)).view(np.uint8)
    mean_scale = 0.5 * (0.5 + _IQ_SCALE_NIBBLE_MEAN)
    _put_f16(blocks, 0, np.full(num_blocks, std / (mean_scale * _IQ3XXS_RMS), np.float32))


def _fill_iq3_s(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    blocks[:, 106:110] = _scale_nibble_bytes(rng, len(blocks), 4)
    mean_scale = 1 + 2 * _IQ_SCALE_NIBBLE_MEAN
    _put_f16(blocks, 0, np.full(len(blocks), std / (mean_scale * _IQ3S_RMS), np.float32))


def _fill_iq2_s(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    blocks[:, 74:82] = _scale_nibble_bytes(rng, len(blocks), 8)
    mean_scale = 0.25 * (0.5 + _IQ_SCALE_NIBBLE_MEAN)
    _put_f16(blocks, 0, np.full(len(blocks), std / (mean_scale * _IQ2S_RMS), np.float32))


def _scale_nibble_bytes(rng: np.random.Generator, num_blocks: int, num_bytes: int) -> np.ndarray:
    nibbles = rng.integers(*_IQ_SCALE_NIBBLES, size=(num_blocks, num_bytes, 2), dtype=np.uint8)
    return nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)


def _fill_q6_k(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    num_blocks = len(blocks)
    magnitude = rng.integers(32, 128, size=(num_blocks, 16), dtype=np.int16)
    sign = rng.integers(0, 2, size=(num_blocks, 16), dtype=np.int16) * 2 - 1
    blocks[:, 192:208] = (magnitude * sign).astype(np.int8).view(np.uint8)
    d = np.full(num_blocks, std / (_UNIFORM_STD[6] * _Q6_K_SCALE_MEAN), dtype=np.float32)
    _put_f16(blocks, 208, d)


def _signed_amplitudes(rng: np.random.Generator, num_blocks: int, mean_abs: float) -> np.ndarray:
    """Block scales: magnitude mean_abs * U(0.75, 1.25), random sign. float32 [N]."""
    magnitude = np.float32(mean_abs) * (np.float32(0.75) + np.float32(0.5) * rng.random(num_blocks, dtype=np.float32))
    sign = rng.integers(0, 2, size=num_blocks, dtype=np.int8).astype(np.float32) * 2 - 1
    return magnitude * sign


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset : offset + 2] = np.asarray(values).astype(np.float16).view(np.uint8).reshape(-1, 2)


def _random_bytes(rng: np.random.Generator, num_bytes: int) -> np.ndarray:
    # the bit generator's raw 64-bit output is ~4x faster than rng.bytes or rng.integers
    words = rng.bit_generator.random_raw((num_bytes + 7) // 8)
    return words.view(np.uint8)[:num_bytes]


def _float_bytes(values: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype == QType.F32:
        return values.view(np.uint8)
    if qtype == QType.F16:
        return values.astype(np.float16).view(np.uint8)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # BF16, truncated


_FILL_SCALES = {
    QType.Q4_0: _fill_q4_0,
    QType.Q5_0: _fill_q5_0,
    QType.Q8_0: _fill_q8_0,
    QType.Q4_1: _fill_q4_1,
    QType.Q5_1: _fill_q5_1,
    QType.Q4_K: _fill_q4_k,
    QType.Q5_K: _fill_q5_k,
    QType.Q6_K: _fill_q6_k,
    QType.IQ4_NL: _fill_iq4_nl,
    QType.IQ4_XS: _fill_iq4_xs,
    QType.IQ3_XXS: _fill_iq3_xxs,
    QType.IQ3_S: _fill_iq3_s,
    QType.IQ2_S: _fill_iq2_s,
}
SUPPORTED_QTYPES = (QType.F32, QType.F16, QType.BF16, *_FILL_SCALES)
