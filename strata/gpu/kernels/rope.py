"""Per-head RMSNorm and rotary position embedding of q and k, in place, in one launch.

Qwen3 normalizes every q and k head over its head_dim (attn_q_norm / attn_k_norm) and then
rotates it: one block per (token, head) does both while the head sits in registers, for q and k
together, so the step costs one launch instead of four. Either part can be switched off: with
rope_mode=None it is the per-head norm alone (norm.head_rms_norm), without norm weights it is
RoPE alone.

RoPE: pair i (i < rope_dims / 2) turns by position * inv_freq[i], inv_freq[i] =
base^(-2i / rope_dims) / freq_factors[i] (rope_inv_freq). NeoX ordering (qwen3moe) pairs x[i]
with x[i + rope_dims / 2]; normal ordering (llama) pairs x[2i], x[2i+1]; dims from rope_dims on
pass through. In float32 an angle at a position in the tens of thousands is off by ~1e-3 rad, so
the angle is formed and reduced modulo 2 pi in float64 (three float64 operations: cheap even on
GPUs with 1/64-rate float64), then its sine and cosine are taken in float32.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._common import (
    check_array,
    check_positive,
    is_device_array,
    is_finite_number,
    stand_in,
)
from .block_reduce import device_block_sum
from .kvcache import KV_BLOCK, KV_STORE
from .launcher import jit

ROPE_MODES = ("neox", "normal")
_TWO_PI = 2.0 * math.pi
_INV_TWO_PI = 1.0 / (2.0 * math.pi)


def rope_inv_freq(freq_base: float, rope_dims: int, freq_factors=None) -> np.ndarray:
    """inv_freq [rope_dims / 2] float64: base^(-2i / rope_dims), divided by freq_factors[i] if given."""
    i = np.arange(rope_dims // 2, dtype=np.float64)
    inv_freq = float(freq_base) ** (-2.0 * i / rope_dims)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64).reshape(-1)
    return inv_freq


def _head_device(head_dim: int, rope_dims: int, rope_mode: str | None, has_norm: bool):
    """norm_rope(q, k, num_q_heads, q_norm_w, k_norm_w, positions, inv_freq, eps, red, t, head, i): thread i
    of the block of (token t, head) normalizes and rotates its pair of that q or k head, in place."""
    num_pairs = head_dim // 2
    half_rot = rope_dims // 2
    is_neox = rope_mode == "neox"
    has_rope = rope_mode is not None

    @cuda.jit(device=True)
    def norm_rope(q, k, num_q_heads, q_norm_w, k_norm_w, positions, inv_freq, eps, red, t, head, i):
        is_q = head < num_q_heads
        base = (head if is_q else head - num_q_heads) * head_dim
        if has_rope and i < half_rot:
            a = i if is_neox else 2 * i
            b = i + half_rot if is_neox else 2 * i + 1
        else:
            a = 2 * i
            b = 2 * i + 1
        xa = q[t, base + a] if is_q else k[t, base + a]
        xb = q[t, base + b] if is_q else k[t, base + b]
        if has_norm:
            sum_sq = device_block_sum(xa * xa + xb * xb, red, i, num_pairs)
            inv_rms = np.float32(1.0) / np.float32(math.sqrt(sum_sq / np.float32(head_dim) + eps))
            xa = xa * inv_rms * (q_norm_w[a] if is_q else k_norm_w[a])
            xb = xb * inv_rms * (q_norm_w[b] if is_q else k_norm_w[b])
        if has_rope and i < half_rot:
            angle = np.float64(positions[t]) * inv_freq[i]
            reduced = np.float32(angle - _TWO_PI * math.floor(angle * _INV_TWO_PI + 0.5))
            c = np.float32(math.cos(reduced))
            s = np.float32(math.sin(reduced))
            xa, xb = xa * c - xb * s, xa * s + xb * c
        if is_q:
            q[t, base + a] = xa
            q[t, base + b] = xb
        else:
            k[t, base + a] = xa
            k[t, base + b] = xb

    return norm_rope


@functools.cache
def _head_kernel(head_dim: int, rope_dims: int, rope_mode: str | None, has_norm: bool):
    num_pairs = head_dim // 2
    norm_rope = _head_device(head_dim, rope_dims, rope_mode, has_norm)

    @jit
    def head_norm_rope_kernel(q, k, num_q_heads, q_norm_w, k_norm_w, positions, inv_freq, eps):
        # q [T, Hq * d], k [T, Hk * d], in place
        red = cuda.shared.array(num_pairs, np.float32)
        norm_rope(q, k, num_q_heads, q_norm_w, k_norm_w, positions, inv_freq, eps, red, cuda.blockIdx.x,
                  cuda.blockIdx.y, cuda.threadIdx.x)

    return head_norm_rope_kernel


@functools.cache
def _head_append_kernel(head_dim: int, rope_dims: int, rope_mode: str | None, has_norm: bool, kv_fmt: str):
    """The head kernel that also writes the token's K (normed and rotated) and V into row positions[t] of the
    caches, as kvcache.append_kv does: blocks (t, Hq + Hk + j) store V head j. One launch instead of two."""
    num_pairs = head_dim // 2
    blocks_per_head = head_dim // KV_BLOCK
    norm_rope = _head_device(head_dim, rope_dims, rope_mode, has_norm)
    store = KV_STORE[kv_fmt]

    @jit
    def head_norm_rope_append_kernel(q, k, v, num_q_heads, q_norm_w, k_norm_w, positions, inv_freq, eps,
                                     k_quants, k_scales, v_quants, v_scales):
        # q [T, Hq * d], k, v [T, Hk * d]; caches [cells, Hk * d] in kv_fmt
        t, head, i = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        red = cuda.shared.array(num_pairs, np.float32)
        num_k_heads = k.shape[1] // head_dim
        row = positions[t]
        is_row = 0 <= row < k_quants.shape[0]
        if head < num_q_heads + num_k_heads:  # uniform in the block: its barriers are every thread's
            norm_rope(q, k, num_q_heads, q_norm_w, k_norm_w, positions, inv_freq, eps, red, t, head, i)
            if head >= num_q_heads:
                cuda.syncthreads()  # the head's every pair is written before its blocks are quantized
                if i < blocks_per_head and is_row:
                    store(k, t, (head - num_q_heads) * blocks_per_head + i, k_quants, k_scales, row)
        elif i < blocks_per_head and is_row:
            store(v, t, (head - num_q_heads - num_k_heads) * blocks_per_head + i, v_quants, v_scales, row)

    return head_norm_rope_append_kernel


def head_norm_rope(q, k=None, positions=None, *, head_dim: int, q_norm_weight=None, k_norm_weight=None,
                   eps: float = 1e-6, rope_mode: str | None = "neox", freq_base: float = 1e6,
                   rope_dims: int | None = None, inv_freq=None, v=None, k_cache=None, v_cache=None, stream=0):
    """In place: per-head RMSNorm (when norm weights are given) then RoPE (unless rope_mode=None).
    With ``k_cache`` and ``v_cache`` (PackedMatrix [cells, Hk * head_dim] in a KV format) and ``v`` [T, Hk *
    head_dim] float32, the same launch then writes k and v into row positions[t] of the caches, as
    kvcache.append_kv does (rows outside the caches are skipped).

    q: [T, Hq * head_dim] float32; k: [T, Hk * head_dim] float32 or None; positions: [T] int32
    (needed with RoPE); q_norm_weight / k_norm_weight: [head_dim] float32, both or neither (only
    q's when k is None). inv_freq: [rope_dims / 2] float64 (rope_inv_freq, uploaded once by the
    caller); when None it is built from freq_base here. Returns (q, k).

    Launch config: grid (T, Hq + Hk), block head_dim / 2 threads (one pair each); shared memory
    head_dim / 2 float32.
    """
    check_positive("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    rope_dims = head_dim if rope_dims is None else rope_dims
    if rope_dims % 2 or not 0 < rope_dims <= head_dim:
        raise ValueError(f"rope_dims must be even and in (0, head_dim], got {rope_dims}")
    if rope_mode is not None and rope_mode not in ROPE_MODES:
        raise ValueError(f"rope_mode must be one of {ROPE_MODES} or None, got {rope_mode!r}")
    if not is_finite_number(eps) or eps < 0 or not is_finite_number(freq_base) or freq_base <= 0:
        raise ValueError(f"eps must be >= 0 and freq_base > 0, got eps={eps}, freq_base={freq_base}")
    check_array("q", q, dtypes=np.float32, ndim=2)
    num_tokens = q.shape[0]
    if q.shape[1] % head_dim:
        raise ValueError(f"q width {q.shape[1]} is not a whole number of {head_dim}-wide heads")
    if k is not None:
        check_array("k", k, dtypes=np.float32, shape=(num_tokens, None))
        if k.shape[1] % head_dim:
            raise ValueError(f"k width {k.shape[1]} is not a whole number of {head_dim}-wide heads")
    has_norm = q_norm_weight is not None
    if has_norm:
        check_array("q_norm_weight", q_norm_weight, dtypes=np.float32, shape=(head_dim,))
        if k is not None:
            if k_norm_weight is None:
                raise ValueError("k_norm_weight is required when q_norm_weight and k are given")
            check_array("k_norm_weight", k_norm_weight, dtypes=np.float32, shape=(head_dim,))
    elif k_norm_weight is not None:
        raise ValueError("k_norm_weight without q_norm_weight: pass both or neither")
    if rope_mode is not None:
        if positions is None:
            raise ValueError("positions are required for RoPE")
        check_array("positions", positions, dtypes=np.int32, shape=(num_tokens,))
        if inv_freq is None:
            inv_freq = rope_inv_freq(freq_base, rope_dims)
            inv_freq = cuda.to_device(inv_freq) if is_device_array(q) else inv_freq
        check_array("inv_freq", inv_freq, dtypes=np.float64, shape=(rope_dims // 2,))
    num_q_heads = q.shape[1] // head_dim
    num_k_heads = 0 if k is None else k.shape[1] // head_dim
    if k_cache is not None:
        _check_append(k, v, positions, k_cache, v_cache, head_dim)
    if num_tokens == 0 or not has_norm and rope_mode is None and k_cache is None:
        return q, k
    args = (
        q,
        stand_in(q, np.float32, 2) if k is None else k,
        num_q_heads,
        q_norm_weight if has_norm else stand_in(q, np.float32, 1),
        k_norm_weight if has_norm and k is not None else stand_in(q, np.float32, 1),
        positions if positions is not None else stand_in(q, np.int32, 1),
        inv_freq if inv_freq is not None else stand_in(q, np.float64, 1),
        np.float32(eps),
    )
    if k_cache is not None:
        kernel = _head_append_kernel(head_dim, rope_dims, rope_mode, has_norm, k_cache.fmt)
        kernel[(num_tokens, num_q_heads + 2 * num_k_heads), head_dim // 2, stream](
            args[0], args[1], v, *args[2:], k_cache.quants, k_cache.scales, v_cache.quants, v_cache.scales)
        return q, k
    kernel = _head_kernel(head_dim, rope_dims, rope_mode, has_norm)
    kernel[(num_tokens, num_q_heads + num_k_heads), head_dim // 2, stream](*args)
    return q, k


def _check_append(k, v, positions, k_cache, v_cache, head_dim: int) -> None:
    from .kvcache import KV_FORMATS
    from .packing import check_packed

    if k is None or v is None or positions is None:
        raise ValueError("writing the KV cache needs k, v and positions")
    check_packed("k_cache", k_cache, formats=KV_FORMATS)
    check_packed("v_cache", v_cache, formats=(k_cache.fmt,))
    if head_dim % KV_BLOCK or (v_cache.num_rows, v_cache.num_cols) != (k_cache.num_rows, k_cache.num_cols) \
            or k_cache.num_cols != k.shape[1]:
        raise ValueError(f"the caches must be [cells, {k.shape[1]}] both, and head_dim a multiple of {KV_BLOCK}")
    check_array("v", v, dtypes=np.float32, shape=k.shape)
    check_array("positions", positions, dtypes=np.int32, shape=(k.shape[0],))
