import numpy as np
import pytest
from kernel_data import (
    ALL_FORMATS,
    assert_dot_close,
    cols_around_blocks,
    dev,
    host,
    random_matrix,
)

from strata.gpu.kernels.gemv import GemvConfig, gemv
from strata.model import reference_ops

TINY = GemvConfig(threads=32, lanes_per_row=8, rows_per_group=2)  # 8 rows per block: 13 rows = 2 blocks
NUM_ROWS = 13


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_gemv_matches_dequantized_matmul_around_block_boundaries(fmt):
    blocks = 9 if fmt not in ("Q4_K", "Q6_K") else 2
    for i, num_cols in enumerate(cols_around_blocks(fmt, blocks)):
        w, values = random_matrix(fmt, NUM_ROWS, num_cols, seed=20 + i)
        x = np.random.default_rng(30 + i).standard_normal(num_cols).astype(np.float32)
        y = host(gemv(w, dev(x), config=TINY))
        assert_dot_close(y, values.astype(np.float64) @ x, np.abs(values) @ np.abs(x))


def test_gemv_fuses_rms_norm_and_accumulates_into_the_residual():
    w, values = random_matrix("Q4_K", NUM_ROWS, 512, seed=21)
    rng = np.random.default_rng(31)
    x = (rng.standard_normal(512) * 3).astype(np.float32)
    norm_weight = rng.uniform(0.5, 1.5, 512).astype(np.float32)
    residual = rng.standard_normal(NUM_ROWS).astype(np.float32)
    y = dev(residual)
    gemv(w, dev(x), y, norm_weight=dev(norm_weight), eps=1e-6, accumulate=True, config=TINY)
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6)
    ref = residual + values.astype(np.float64) @ x_normed
    assert_dot_close(host(y), ref, np.abs(values) @ np.abs(x_normed) + np.abs(residual))


def test_gemv_default_config_and_float16_activations():
    w, values = random_matrix("Q8_0", 21, 96, seed=22)
    x = np.random.default_rng(32).standard_normal(96).astype(np.float16)
    y = host(gemv(w, dev(x)))
    x64 = x.astype(np.float64)
    assert_dot_close(y, values @ x64, np.abs(values) @ np.abs(x64))


def test_gemv_rejects_mismatched_inputs():
    w, _ = random_matrix("Q4_0", 4, 64, seed=23)
    with pytest.raises(ValueError, match=r"x must have shape \(64,\)"):
        gemv(w, np.zeros(32, np.float32))
    with pytest.raises(TypeError, match="x must have dtype"):
        gemv(w, np.zeros(64, np.float64))
    with pytest.raises(ValueError, match="accumulate=True needs y"):
        gemv(w, np.zeros(64, np.float32), accumulate=True)
    with pytest.raises(ValueError, match="rows_per_group"):
        gemv(w, np.zeros(64, np.float32), config=GemvConfig(32, 4, 8))
    with pytest.raises(TypeError, match="PackedMatrix"):
        gemv(np.zeros((4, 64), np.float32), np.zeros(64, np.float32))


def test_gemv_multi_runs_q_k_v_of_different_formats_in_one_launch():
    from strata.gpu.kernels.gemv_multi import gemv_multi

    rng = np.random.default_rng(24)
    matrices = [random_matrix(fmt, rows, 256, seed=25 + i) for i, (fmt, rows) in
                enumerate((("Q4_K", 13), ("Q4_K", 5), ("Q6_K", 9)))]
    x = (rng.standard_normal(256) * 2).astype(np.float32)
    norm_weight = rng.uniform(0.5, 1.5, 256).astype(np.float32)
    ys = gemv_multi([w for w, _ in matrices], dev(x), norm_weight=dev(norm_weight), config=TINY)
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6).astype(np.float64)
    for y, (_, values) in zip(ys, matrices):
        assert_dot_close(host(y), values @ x_normed, np.abs(values) @ np.abs(x_normed))
    # two matrices, host outputs: the third slot's stand-in must not clobber them
    x = rng.standard_normal(256).astype(np.float32)
    ys = (np.zeros(13, np.float32), np.zeros(5, np.float32))
    gemv_multi([matrices[0][0], matrices[1][0]], x, ys, config=TINY)
    for y, (_, values) in zip(ys, matrices[:2]):
        assert_dot_close(y, values @ x.astype(np.float64), np.abs(values) @ np.abs(x))
