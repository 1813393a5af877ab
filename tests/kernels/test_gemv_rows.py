"""GEMV rows: each row of an R-row launch (R <= DECODE_MAX_ROWS) has the bits of a one-row launch.

A speculative verify runs the last accepted token and its drafts as one forward, which must reproduce
plain decode bit for bit, reading each matrix once for all rows: the Numba GEMVs here (every format),
the C++ rows on a GPU. Each test compares every row with a one-row launch (np.array_equal) and with the
NumPy reference within gemv's tolerances.
"""

import numpy as np
import pytest
from numba import config as numba_config
from kernel_data import (
    ALL_FORMATS,
    assert_dot_close,
    block_elems,
    cols_around_blocks,
    dev,
    host,
    random_matrix,
)

from strata.backend.ops import DECODE_MAX_ROWS
from strata.backend.select import has_cuda_device
from strata.gpu.kernels import gemv_native
from strata.gpu.kernels.gemv import GemvConfig, gemv, gemv_rows
from strata.gpu.kernels.gemv_multi import gemv_multi, gemv_multi_rows
from strata.gpu.kernels.gemv_native import NativeGemvConfig
from strata.model import reference_ops

needs_gpu = pytest.mark.skipif(not has_cuda_device(), reason="needs a real CUDA device (not the simulator)")
# the simulator runs each lane in Python: a launch of nine rows of a K-quant takes minutes there, so CI
# checks two formats and one width; a GPU checks them all
IS_SIMULATED = bool(numba_config.ENABLE_CUDASIM)
ROW_FORMATS = ("Q4_0", "Q8_0") if IS_SIMULATED else ALL_FORMATS
NORM_WIDTHS = (128,) if IS_SIMULATED else (96, 128, 160)
TINY = GemvConfig(threads=32, lanes_per_row=8, rows_per_group=2)  # 8 rows per block: 13 rows = 2 blocks
NUM_ROWS = 13
ROW_COUNTS = (2, 5, DECODE_MAX_ROWS)  # every count runs its own compiled kernel; 9 covers the largest


def _x(num_rows, num_cols, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal((num_rows, num_cols)) * scale).astype(np.float32)


def _assert_rows_equal(rows, ones):
    """rows [R, N] of one launch against R one-row results, bit for bit."""
    for t, one in enumerate(ones):
        assert np.array_equal(rows[t], one), f"row {t} differs from its one-row launch"


@pytest.fixture(autouse=True)
def every_built_format_served(monkeypatch):
    """The C++ rows' tests run every built format, served or not yet (gemv_native.FORMATS)."""
    monkeypatch.setattr(gemv_native, "FORMATS", gemv_native.BUILT_FORMATS)


# --- GEMV -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_gemv_rows_have_the_bits_of_one_row_launches(fmt):
    blocks = 3 if fmt not in ("Q4_K", "Q6_K") else 1
    num_cols = cols_around_blocks(fmt, blocks)[2]  # a lane's octets past the block: a partial last pass
    w, values = random_matrix(fmt, NUM_ROWS, num_cols, seed=600)
    x = _x(DECODE_MAX_ROWS, num_cols, seed=601)
    ones = [host(gemv(w, dev(x[t]), config=TINY)) for t in range(DECODE_MAX_ROWS)]
    for num_x_rows in ROW_COUNTS:
        rows = host(gemv_rows(w, dev(x[:num_x_rows]), config=TINY))
        _assert_rows_equal(rows, ones[:num_x_rows])
    assert_dot_close(rows, x.astype(np.float64) @ values.T.astype(np.float64), np.abs(x) @ np.abs(values).T)


@pytest.mark.parametrize("num_cols", NORM_WIDTHS)  # Q8_0: 3, 4, 5 blocks over lanes of 8 octets
def test_gemv_rows_fuse_each_rows_norm_and_accumulate(num_cols):
    w, values = random_matrix("Q8_0", NUM_ROWS, num_cols, seed=610)
    rng = np.random.default_rng(611)
    x = _x(DECODE_MAX_ROWS, num_cols, seed=612, scale=3.0)
    x[1] *= 100  # rows of very different size: each row is normed alone
    norm_weight = rng.uniform(0.5, 1.5, num_cols).astype(np.float32)
    residual = rng.standard_normal((DECODE_MAX_ROWS, NUM_ROWS)).astype(np.float32)
    ones = []
    for t in range(DECODE_MAX_ROWS):
        y = dev(residual[t])
        gemv(w, dev(x[t]), y, norm_weight=dev(norm_weight), accumulate=True, config=TINY)
        ones.append(host(y))
    y = dev(residual)
    gemv_rows(w, dev(x), y, norm_weight=dev(norm_weight), accumulate=True, config=TINY)
    _assert_rows_equal(host(y), ones)
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6).astype(np.float64)
    assert_dot_close(host(y), residual + x_normed @ values.T, np.abs(x_normed) @ np.abs(values).T + np.abs(residual))


def test_gemv_rows_default_config_and_float16_rows():
    w, _ = random_matrix("Q4_0", 21, 96, seed=620)
    x = _x(4, 96, seed=621).astype(np.float16)
    rows = host(gemv_rows(w, dev(x)))
    _assert_rows_equal(rows, [host(gemv(w, dev(x[t]))) for t in range(4)])


def test_gemv_rows_reject_mismatched_inputs():
    w, _ = random_matrix("Q4_0", 4, 64, seed=622)
    with pytest.raises(ValueError, match=r"x must have shape \(2, 64\)"):
        gemv_rows(w, np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match=r"y must have shape \(2, 4\)"):
        gemv_rows(w, np.zeros((2, 64), np.float32), np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="accumulate=True needs y"):
        gemv_rows(w, np.zeros((2, 64), np.float32), accumulate=True)


def test_multi_gemv_rows_have_the_bits_of_one_row_launches():
    rng = np.random.default_rng(630)
    matrices = [random_matrix(fmt, rows, 256, seed=631 + i) for i, (fmt, rows) in
                enumerate((("Q4_K", 13), ("Q4_1", 5), ("Q6_K", 9)))]
    ws = [w for w, _ in matrices]
    x = _x(DECODE_MAX_ROWS, 256, seed=634, scale=2.0)
    norm_weight = rng.uniform(0.5, 1.5, 256).astype(np.float32)
    ones = [[host(y) for y in gemv_multi(ws, dev(x[t]), norm_weight=dev(norm_weight), config=TINY)]
            for t in range(DECODE_MAX_ROWS)]
    for num_x_rows in ROW_COUNTS:
        ys = gemv_multi_rows(ws, dev(x[:num_x_rows]), norm_weight=dev(norm_weight), config=TINY)
        for i, y in enumerate(ys):
            _assert_rows_equal(host(y), [one[i] for one in ones[:num_x_rows]])
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6).astype(np.float64)
    for y, (_, values) in zip(ys, matrices):
        assert_dot_close(host(y), x_normed @ values.T, np.abs(x_normed) @ np.abs(values).T)
    # two matrices: the third segment's stand-in gets no blocks
    ys = gemv_multi_rows(ws[:2], dev(x[:3]), config=TINY)
    ones = [[host(y) for y in gemv_multi(ws[:2], dev(x[t]), config=TINY)] for t in range(3)]
    for i, y in enumerate(ys):
        _assert_rows_equal(host(y), [one[i] for one in ones])


# --- the C++ rows (GPU) ---------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("fmt", gemv_native.BUILT_FORMATS)
@pytest.mark.parametrize("rows_per_warp", [1, 2, 4])
def test_native_gemv_rows_have_the_bits_of_one_row_launches(fmt, rows_per_warp):
    elems = block_elems(fmt)
    # columns: a few items, a row so long that a launch stages fewer than 9 rows of x (several launches), and
    # one longer than the static arrays hold alone (12,288: a dense down projection; the dynamic block)
    for num_cols in (elems * 3, elems * 40 if elems == 256 else elems * 320, 12288):
        w, values = random_matrix(fmt, 37, num_cols, seed=660 + num_cols)
        x = _x(DECODE_MAX_ROWS, num_cols, seed=661)
        norm_weight = np.random.default_rng(662).uniform(0.5, 1.5, num_cols).astype(np.float32)
        for config in (NativeGemvConfig(warps=2, rows_per_warp=rows_per_warp),
                       NativeGemvConfig(warps=1, rows_per_warp=rows_per_warp, blocks_per_sm=1)):
            ones = []
            for t in range(DECODE_MAX_ROWS):
                y = dev(np.zeros(37, np.float32))
                gemv_native.gemv_native(w, dev(x[t]), y, norm_weight=dev(norm_weight), config=config)
                ones.append(host(y))
            for num_x_rows in range(1, DECODE_MAX_ROWS + 1):
                y = dev(np.zeros((num_x_rows, 37), np.float32))
                gemv_native.gemv_native_rows(w, dev(x[:num_x_rows]), y, norm_weight=dev(norm_weight), config=config)
                _assert_rows_equal(host(y), ones[:num_x_rows])
        x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6).astype(np.float64)
        assert_dot_close(host(y), x_normed @ values.T, np.abs(x_normed) @ np.abs(values).T)


@needs_gpu
@pytest.mark.parametrize("fmt", gemv_native.BUILT_EXPERT_FORMATS)  # every quantized format an output head may have
def test_native_head_rows_accumulate_with_the_bits_of_one_row_launches(fmt):
    # one row: the head's shape; several: head_rows_config's, another shape with the same sums
    config, rows_config = gemv_native.head_config(fmt), gemv_native.head_rows_config(fmt, DECODE_MAX_ROWS)
    num_cols = 2048
    num_rows = 3 * config.grid(10**9) * config.warps * config.rows_per_warp + 3  # blocks loop over row groups
    w, _ = random_matrix(fmt, num_rows, num_cols, seed=670)
    x = _x(DECODE_MAX_ROWS, num_cols, seed=671)
    residual = np.random.default_rng(672).standard_normal((DECODE_MAX_ROWS, num_rows)).astype(np.float32)
    ones = []
    for t in range(DECODE_MAX_ROWS):
        y = dev(residual[t])
        gemv(w, dev(x[t]), y, accumulate=True, native=True, native_config=config)
        ones.append(host(y))
    y = dev(residual)
    gemv_rows(w, dev(x), y, accumulate=True, native=True, native_config=rows_config)
    _assert_rows_equal(host(y), ones)


@needs_gpu
@pytest.mark.parametrize("fmts", [("Q4_K", "Q4_K", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q6_K")])
def test_native_multi_gemv_rows_have_the_bits_of_one_row_launches(fmts):
    ws = [random_matrix(fmt, rows, 2048, seed=680 + i)[0] for i, (fmt, rows) in enumerate(zip(fmts, (4096, 512, 512)))]
    x = _x(DECODE_MAX_ROWS, 2048, seed=684)
    norm_weight = np.random.default_rng(685).uniform(0.5, 1.5, 2048).astype(np.float32)
    ones = [[host(y) for y in gemv_multi(ws, dev(x[t]), norm_weight=dev(norm_weight), native=True)]
            for t in range(DECODE_MAX_ROWS)]
    for num_x_rows in range(1, DECODE_MAX_ROWS + 1):
        ys = gemv_multi_rows(ws, dev(x[:num_x_rows]), norm_weight=dev(norm_weight), native=True)
        for i, y in enumerate(ys):
            _assert_rows_equal(host(y), [one[i] for one in ones[:num_x_rows]])


def test_native_rows_stage_what_shared_memory_holds_and_launch_again_for_the_rest():
    class Matrix:
        def __init__(self, fmt, num_cols):
            self.fmt, self.num_cols = fmt, num_cols

    assert gemv_native.max_x_rows(Matrix("Q4_0", 2048)) == 5  # 9 KiB a staged row of 47: a depth-4 verify step
    assert gemv_native.max_x_rows(Matrix("Q4_K", 2048)) == 5  # 9.1 KiB in gemv's Q4_K layout
    assert gemv_native.max_x_rows(Matrix("Q4_0", 4096)) == 2
    # a GEMV's launch takes dynamic shared memory past the static arrays' 48 KiB: a verify step's five rows of the
    # output projection (4,096 columns, 18 KiB each staged) in one launch that reads the weights once
    assert gemv_native.max_x_rows(Matrix("Q4_0", 4096), is_dynamic=True) >= 5  # 99 KiB a block on sm_86/89
    assert gemv_native._dynamic_stage_bytes(2 * 4608) == 0 and gemv_native._dynamic_stage_bytes(5 * 4608) == 5 * 18432
    assert gemv_native.max_x_rows(Matrix("Q4_0", 256)) >= DECODE_MAX_ROWS
    assert gemv_native._x_row_chunks(9, 4) == [(0, 4), (4, 4), (8, 1)]
    assert gemv_native._x_row_chunks(3, 4) == [(0, 3)]
    assert gemv_native.head_config("Q4_0").x_rows == 1  # its 16-warp blocks run out of registers with more
    assert gemv_native.head_rows_config("Q4_0", 1) == gemv_native.head_config("Q4_0")
    assert gemv_native.head_rows_config("Q4_0", 5).warps <= 8
    with pytest.raises(ValueError, match="x_rows"):
        gemv_native.NativeGemvConfig(x_rows=-1).validate()
