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

from strata.gpu.kernels.gemm import gemm
from strata.gpu.kernels.gemm_config import GemmConfig

TINY = GemmConfig(block_m=8, block_n=8, thread_m=2, thread_n=2)  # 16 threads
NUM_TOKENS, NUM_ROWS = 11, 13  # neither a multiple of the 8 x 8 tile


def _check(fmt, num_cols, seed, x_dtype=np.float32, config=TINY):
    w, values = random_matrix(fmt, NUM_ROWS, num_cols, seed=seed)
    x = np.random.default_rng(seed + 100).standard_normal((NUM_TOKENS, num_cols)).astype(x_dtype)
    y = host(gemm(dev(x), w, config=config))
    x64 = x.astype(np.float64)
    assert_dot_close(y, x64 @ values.T, np.abs(x64) @ np.abs(values).T)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_gemm_matches_dequantized_matmul(fmt):
    _check(fmt, 256 if fmt in ("Q4_K", "Q6_K") else 64, seed=40)


def test_gemm_k_around_block_boundaries():
    for i, num_cols in enumerate(cols_around_blocks("Q4_0", 3)):
        _check("Q4_0", num_cols, seed=41 + i)


def test_gemm_float16_activations_and_residual_accumulate():
    _check("Q8_0", 64, seed=45, x_dtype=np.float16)
    w, values = random_matrix("Q4_1", NUM_ROWS, 64, seed=46)
    rng = np.random.default_rng(47)
    x = rng.standard_normal((NUM_TOKENS, 64)).astype(np.float32)
    residual = rng.standard_normal((NUM_TOKENS, NUM_ROWS)).astype(np.float32)
    y = dev(residual)
    gemm(dev(x), w, y, accumulate=True, config=TINY)
    assert_dot_close(host(y), residual + x.astype(np.float64) @ values.T, np.abs(x) @ np.abs(values).T + 1)


def test_gemm_16x16_tiles():
    _check("Q6_K", 256, seed=48, config=GemmConfig(block_m=16, block_n=16, thread_m=2, thread_n=2))


def test_gemm_rejects_bad_shapes_and_configs():
    w, _ = random_matrix("Q4_0", 4, 64, seed=49)
    with pytest.raises(ValueError, match="x has 32 columns but w has 64"):
        gemm(np.zeros((2, 32), np.float32), w)
    with pytest.raises(ValueError, match="cannot stage"):
        gemm(np.zeros((2, 64), np.float32), w, config=GemmConfig(block_m=64, block_n=8, thread_m=1, thread_n=1))
    with pytest.raises(ValueError, match="must be a power of two"):
        GemmConfig(block_m=48).validate()
