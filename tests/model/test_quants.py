"""Quant formats: every block layout against gguf-py's reference, and the Q8_0/Q4_0 round trips."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from strata.errors import ModelFormatError
from strata.model import quants

FORMATS = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K,
           Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_S]


def _random_raw(qtype, shape, seed):
    """Uniformly random bytes for a tensor of `shape`: every bit pattern, NaN scales included."""
    rng = np.random.default_rng(seed)
    num_rows = int(np.prod(shape[:-1]))
    return rng.integers(0, 256, size=(num_rows, quants.row_nbytes(qtype, shape[-1])), dtype=np.uint8)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_block_layout_matches_ggml(qtype):
    assert quants.block_layout(qtype) == gguf.GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantize_matches_gguf_py_block_for_block(qtype, seed):
    block_elems, _ = quants.block_layout(qtype)
    shape = (3, 5, 4 * max(block_elems, 32))  # an expert-like 3-D tensor, several blocks per row
    raw = _random_raw(qtype, shape, seed)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(shape)
        got = quants.dequantize(raw, qtype, shape)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, expected)  # bit for bit; NaN where the scale bytes are NaN


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_accepts_a_memmap_row_view(qtype, tmp_path):
    shape = (4, 256)
    raw = _random_raw(qtype, shape, 7)
    raw.tofile(tmp_path / "t.bin")
    mapped = np.memmap(tmp_path / "t.bin", dtype=np.uint8, mode="r").reshape(raw.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(quants.dequantize(mapped[1:3], qtype, (2, 256)),
                                      quants.dequantize(raw, qtype, shape)[1:3])


def test_q4_0_nibble_order_low_half_first():
    d = np.float16(0.5)
    qs = np.array([(hi << 4) | lo for lo, hi in zip(range(16), range(15, -1, -1))], dtype=np.uint8)
    block = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), qs])
    got = quants.dequantize(block, Q.Q4_0, (32,))
    expected = 0.5 * (np.concatenate([np.arange(16), np.arange(15, -1, -1)]) - 8)
    np.testing.assert_array_equal(got, expected.astype(np.float32))


def test_row_nbytes_and_its_errors():
    assert quants.row_nbytes(Q.Q4_0, 2048) == 64 * 18
    assert quants.row_nbytes(Q.Q6_K, 512) == 2 * 210
    assert quants.row_nbytes(Q.F16, 7) == 14
    with pytest.raises(ModelFormatError, match="Q4_K rows need a multiple of 256 columns, got 64"):
        quants.row_nbytes(Q.Q4_K, 64)
    with pytest.raises(ModelFormatError, match="unsupported quant type Q3_K"):
        quants.row_nbytes(Q.Q3_K, 256)
    assert not quants.is_supported(Q.IQ2_XXS) and quants.is_supported(Q.Q6_K) and not quants.is_supported(999)


def test_dequantize_rejects_a_wrong_byte_count():
    with pytest.raises(ModelFormatError, match=r"Q8_0 tensor of shape \[2, 32\] needs 68 uint8 bytes, got 67"):
        quants.dequantize(np.zeros(67, np.uint8), Q.Q8_0, (2, 32))


def _blocks_of(x):
    return x.reshape(-1, 32)


@pytest.mark.parametrize("quantize, qtype", [(quants.quantize_q8_0, Q.Q8_0), (quants.quantize_q4_0, Q.Q4_0)],
                         ids=["Q8_0", "Q4_0"])
def test_quantize_is_byte_exact_with_gguf_py(quantize, qtype):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((6, 4, 128)) * rng.uniform(0.01, 10, size=(6, 4, 1))).astype(np.float32)
    x[0, 0, :32] = 0  # an all-zero block: scale 0, no division by zero
    x[0, 1, :32] = -3.0  # a constant negative block
    got = quantize(x)
    assert got.dtype == np.uint8 and got.shape == (6, 4, quants.row_nbytes(qtype, 128))
    np.testing.assert_array_equal(got, gguf.quants.quantize(x, qtype))


def test_q8_0_round_trip_error_is_within_half_a_step():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 256)) * 3).astype(np.float32)
    back = quants.dequantize(quants.quantize_q8_0(x), Q.Q8_0, x.shape)
    step = np.abs(_blocks_of(x)).max(axis=1, keepdims=True) / 127  # [N, 1]
    # half a step of rounding, plus the f16 rounding of the scale (2^-11 relative) times |q| <= 127
    assert np.all(np.abs(_blocks_of(back - x)) <= step * (0.5 + 127 * 2.0**-11) + 1e-7)


def test_q4_0_round_trip_error_is_within_one_step():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((64, 256)) * 3).astype(np.float32)
    back = quants.dequantize(quants.quantize_q4_0(x), Q.Q4_0, x.shape)
    step = np.abs(_blocks_of(x)).max(axis=1, keepdims=True) / 8  # [N, 1]
    err = np.abs(_blocks_of(back - x))
    # the extreme maps to -8 exactly; the opposite side clips at +7, so one step at worst
    assert np.all(err <= step * (1 + 8 * 2.0**-11) + 1e-7)
    assert np.median(err / step) < 0.3  # and typically a quarter step


def test_quantize_rejects_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quants.quantize_q8_0(np.zeros((2, 48), np.float32))
