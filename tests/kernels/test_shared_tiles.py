"""The GEMM kernels' shared tiles: static arrays up to 48 KiB, slices of the dynamic block beyond.

The simulator runs dynamic shared memory too, so lowering the static limit sends the twin GEMM and
MoE kernels down the dynamic path here; on a GPU, the 128 x 128 fused configs of test_gemm_mma.py
(61,952 bytes for gate and up) take it for real.
"""

from typing import NamedTuple

import numpy as np
import pytest
from kernel_data import (
    assert_close_to_scale,
    check_moe_prefill,
    dev,
    host,
    random_matrix,
)
from numba import cuda

from strata.gpu.kernels import gemm, moe, shared_tiles
from strata.gpu.kernels.gemm_config import MmaConfig


class _Tiles(NamedTuple):
    xs_size: int = 24
    ws_size: int = 8
    block_m: int = 4
    stage_dtype: type = np.float32


@pytest.fixture
def dynamic_only(monkeypatch):
    """Every tile dynamic; kernels built under it are dropped before and after."""
    caches = (shared_tiles.tiles_device, moe._gate_up_kernel, moe._down_kernel, gemm._gemm_kernel)
    for cache in caches:
        cache.cache_clear()
    monkeypatch.setattr(shared_tiles, "MAX_STATIC_SHARED_BYTES", 0)
    yield
    for cache in caches:
        cache.cache_clear()


def test_sizes_and_when_tiles_are_dynamic():
    config = MmaConfig(stages=2)  # 128 x 128: X 2 x 40 x 128 halves, each weight as much
    assert shared_tiles.tile_bytes(config, 2) == 2 * 3 * 2 * 40 * 128
    assert shared_tiles.shared_bytes(config, 2) == config.shared_bytes(2) == 61_952
    assert shared_tiles.dynamic_bytes(config, 2) == 61_440  # the row list stays static
    assert shared_tiles.dynamic_bytes(config, 1) == 0  # 41,472 bytes: static
    assert shared_tiles.dynamic_bytes(MmaConfig(block_n=64, warps_n=2, stages=2), 2) == 0


@pytest.mark.parametrize("num_weights", [1, 2])
@pytest.mark.parametrize("is_dynamic", [False, True])
def test_tiles_are_separate_and_sized(monkeypatch, num_weights, is_dynamic):
    if is_dynamic:
        monkeypatch.setattr(shared_tiles, "MAX_STATIC_SHARED_BYTES", 0)
    config = _Tiles()
    tiles = shared_tiles.tiles_device.__wrapped__(config, num_weights)  # uncached: the limit is patched
    assert tiles.py_func.__name__.startswith("device_dynamic" if is_dynamic else "device_static")

    @cuda.jit
    def fill(out):  # each tile's elements get its number, then every element is read back
        i = cuda.threadIdx.x
        arrays = tiles()
        for t in range(len(arrays)):
            if i < arrays[t].shape[0]:
                arrays[t][i] = t + 1
        cuda.syncthreads()
        for t in range(len(arrays)):
            if i < arrays[t].shape[0]:
                out[t, i] = arrays[t][i]

    out = np.zeros((num_weights + 1, config.xs_size), np.float32)
    fill[1, config.xs_size, 0, shared_tiles.dynamic_bytes(config, num_weights)](out)
    expected = np.zeros_like(out)
    expected[0] = 1
    for t in range(1, num_weights + 1):
        expected[t, :config.ws_size] = t + 1
    np.testing.assert_array_equal(out, expected)


def test_launch_passes_the_dynamic_block():
    # allowing a kernel more than 48 KiB is the launcher's (test_launcher.py)
    calls = []

    class _Kernel:
        def __getitem__(self, launch_config):
            return lambda *args: calls.append((launch_config, args))

    shared_tiles.launch(_Kernel(), (3, 2), 256, 61_440, 1, 2.0)
    assert calls == [(((3, 2), 256, 0, 61_440), (1, 2.0))]


def test_dynamic_tiles_serve_the_gemm(dynamic_only):
    config = MmaConfig(block_m=16, block_n=8, warps_m=1, warps_n=1, stages=2, is_native=False)
    assert shared_tiles.dynamic_bytes(config, 1) > 0  # the kernel's tiles_device takes the dynamic form
    w, values = random_matrix("Q4_0", 13, 64, seed=180)
    x = np.random.default_rng(181).standard_normal((19, 64)).astype(np.float32)
    y = host(gemm.gemm(dev(x), w, config=config))
    assert_close_to_scale(y, x @ values.T, 5e-3)


def test_dynamic_tiles_serve_the_moe_prefill(dynamic_only):
    config = MmaConfig(block_m=16, block_n=8, warps_m=1, warps_n=1, stages=2, prefetch_w=True, is_native=False)
    assert shared_tiles.dynamic_bytes(config, 1) > 0 and shared_tiles.dynamic_bytes(config, 2) > 0
    check_moe_prefill(config, ("Q4_0", "Q4_0", "Q8_0"), seed=182)
