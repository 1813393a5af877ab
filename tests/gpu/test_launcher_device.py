"""launcher.Kernel on the device: the launches after the first pack the parameters themselves and compute
what Numba's launches compute, for contiguous and strided arrays and every scalar type a kernel takes."""

from __future__ import annotations

import numpy as np
from numba import cuda

from strata.gpu.kernels import launcher


@launcher.jit
def _affine(out, x, offsets, alpha, beta, shift):  # out [R, C] = alpha * x + beta + shift + offsets [R]
    i, j = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        out[i, j] = alpha * x[i, j] + beta + shift + offsets[i]


def _launch(out, x, offsets, shift):
    _affine[(ceil(out.shape[0], 8), ceil(out.shape[1], 8)), (8, 8)](out, x, offsets, np.float32(2.0), 0.5, shift)


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def test_direct_launches_compute_what_numbas_do():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((37, 30)).astype(np.float32)
    offsets = np.arange(37, dtype=np.int32)
    device_x, device_offsets = cuda.to_device(x), cuda.to_device(offsets)
    for view, host_view in ((device_x, x), (device_x[:, ::2], x[:, ::2]), (device_x[3:, 1:], x[3:, 1:])):
        for shift in range(3):  # the first launch of each layout is Numba's, the others direct
            out = cuda.device_array(host_view.shape, np.float32)
            _launch(out, view, device_offsets, shift)
            expected = 2 * host_view + 0.5 + shift + offsets[:host_view.shape[0], None]
            np.testing.assert_allclose(out.copy_to_host(), expected, rtol=1e-6)
        key = launcher.argument_key((out, view, device_offsets, np.float32(2.0), 0.5, 0))
        assert _affine._entries[key] is not launcher._NUMBA  # packed like Numba's, so launched directly


def test_host_arrays_still_launch_through_numba():
    x = np.ones((8, 8), np.float32)
    out = np.zeros((8, 8), np.float32)
    _launch(out, x, np.zeros(8, np.int32), 1)
    np.testing.assert_array_equal(out, np.full((8, 8), 3.5, np.float32))
