"""RMSNorm over rows (the hidden state) and per attention head (Qwen3's q/k norm).

y = x / sqrt(mean(x^2) + eps) * weight. The decode path rarely launches this: the norm in front
of a GEMV is fused into it (gemv(..., norm_weight=...)), and the per-head q/k norm into RoPE
(rope.head_norm_rope). This is the prefill path, the final norm, and the standalone per-head norm.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ._common import IS_SIMULATOR, check_array, check_power_of_two, empty, is_finite_number
from .block_reduce import device_inv_rms
from .launcher import jit
from .rope import head_norm_rope

DEFAULT_THREADS = 32 if IS_SIMULATOR else 256  # the simulator runs a Python thread per GPU thread


@functools.cache
def _rms_norm_kernel(threads: int):
    @jit
    def rms_norm_kernel(x, weight, eps, y):  # x, y [T, H]
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        red = cuda.shared.array(threads, np.float32)
        num_cols = x.shape[1]
        inv_rms = device_inv_rms(x, t, eps, red, tid, threads)
        for c in range(tid, num_cols, threads):
            y[t, c] = np.float32(x[t, c]) * inv_rms * weight[c]

    return rms_norm_kernel


def rms_norm(x, weight, eps: float = 1e-6, out=None, *, threads: int = DEFAULT_THREADS, stream=0):
    """RMSNorm of each row: x [T, H] float32/float16, weight [H] float32 -> out [T, H] float32.

    out may be x itself (float32) for an in-place norm.

    Launch config: grid T, block `threads` (default 256, 32 in the simulator); shared memory `threads` float32.
    """
    check_array("x", x, dtypes=(np.float32, np.float16), ndim=2)
    check_array("weight", weight, dtypes=np.float32, shape=(x.shape[1],))
    check_power_of_two("threads", threads)
    if not is_finite_number(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if out is None:
        out = empty(tuple(x.shape), np.float32, x, weight)
    check_array("out", out, dtypes=np.float32, shape=tuple(x.shape))
    if x.shape[0]:
        _rms_norm_kernel(threads)[x.shape[0], threads, stream](x, weight, np.float32(eps), out)
    return out


def head_rms_norm(x, weight, head_dim: int, eps: float = 1e-6):
    """In place: RMSNorm of every head_dim-wide head of x [T, num_heads * head_dim] with weight [head_dim].

    Launch config: rope.head_norm_rope's, grid (T, num_heads), block head_dim / 2 threads.
    """
    head_norm_rope(x, head_dim=head_dim, q_norm_weight=weight, eps=eps, rope_mode=None)
    return x
