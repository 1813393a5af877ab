"""KV-cache writes: new K and V rows quantized into F16, Q8_0 or Q4_0 cache layers.

A cache layer holds K and V as two packed matrices (packing.PackedMatrix) of
[num_positions, num_kv_heads * head_dim]: row p is position p, and each 32-wide block of a row
is exactly a GGUF Q8_0 / Q4_0 block (fp16 d, quants in ggml's nibble order) split into the
quants and scales planes, so attention reads the cache through the same octet dequantizers as the
weights. Quantization rounds exactly as ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref
(round half away from zero; Q4_0's d = the signed extreme / -8, truncation after +8.5).
"""

from __future__ import annotations

import functools
import math
from types import MappingProxyType

import numpy as np
from numba import cuda

from ._common import ceil_div, check_array, check_power_of_two, is_device_array
from .launcher import jit
from .packing import PackedMatrix, check_packed, empty_packed

KV_FORMATS = ("F16", "Q8_0", "Q4_0")
KV_BLOCK = 32
_DEFAULT_THREADS = 64


def empty_kv_layer(fmt: str, num_positions: int, width: int,
                   on_device: bool = True) -> tuple[PackedMatrix, PackedMatrix]:
    """Zeroed (K, V) of one layer: [num_positions, width] each, width = num_kv_heads * head_dim."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"KV cache format must be one of {KV_FORMATS}, got {fmt!r}")
    if width % KV_BLOCK:
        raise ValueError(f"KV width must be a multiple of {KV_BLOCK}, got {width}")
    return empty_packed(fmt, num_positions, width, on_device), empty_packed(fmt, num_positions, width, on_device)


@cuda.jit(device=True)
def device_round_half_away(v):
    """C roundf: exact, unlike floor(|v| + 0.5), which rounds 0.49999997 up in float32."""
    a = abs(v)
    f = math.floor(a)
    r = f + math.floor(np.float32(2.0) * (a - f))
    return r if v >= 0 else -r


@cuda.jit(device=True)
def device_quantize_q8_0(src, t, block, quants, scales, row):
    base = block * KV_BLOCK
    amax = np.float32(0.0)
    for j in range(KV_BLOCK):
        amax = max(amax, abs(src[t, base + j]))
    d = amax / np.float32(127.0)
    inv_d = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    scales[row, block] = np.float16(d)
    for w in range(KV_BLOCK // 4):
        word = np.int64(0)
        for i in range(4):
            q = np.int64(device_round_half_away(src[t, base + 4 * w + i] * inv_d))
            word |= (q & 0xFF) << (8 * i)
        quants[row, block * 8 + w] = word


@cuda.jit(device=True)
def device_quantize_q4_0(src, t, block, quants, scales, row):
    base = block * KV_BLOCK
    amax = np.float32(0.0)
    extreme = np.float32(0.0)
    for j in range(KV_BLOCK):
        v = src[t, base + j]
        if abs(v) > amax:
            amax = abs(v)
            extreme = v
    d = extreme / np.float32(-8.0)
    inv_d = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    scales[row, block] = np.float16(d)
    for w in range(KV_BLOCK // 8):
        word = np.int64(0)
        for i in range(4):
            j = 4 * w + i
            lo = min(np.int64(15), np.int64(math.floor(src[t, base + j] * inv_d + np.float32(8.5))))
            hi = min(np.int64(15), np.int64(math.floor(src[t, base + j + 16] * inv_d + np.float32(8.5))))
            word |= (lo | (hi << 4)) << (8 * i)
        quants[row, block * 4 + w] = word


@cuda.jit(device=True)
def device_store_f16(src, t, block, quants, scales, row):
    for j in range(KV_BLOCK):
        quants[row, block * KV_BLOCK + j] = np.float16(src[t, block * KV_BLOCK + j])


KV_STORE = MappingProxyType({"F16": device_store_f16, "Q8_0": device_quantize_q8_0,
                           "Q4_0": device_quantize_q4_0})


@functools.cache
def _append_kernel(fmt: str, threads: int):
    store = KV_STORE[fmt]

    @jit
    def append_kv_kernel(k_new, v_new, positions, k_quants, k_scales, v_quants, v_scales):
        t = cuda.blockIdx.x
        block = cuda.blockIdx.y * threads + cuda.threadIdx.x
        row = positions[t]
        if block * KV_BLOCK >= k_new.shape[1] or row < 0 or row >= k_quants.shape[0]:
            return
        if cuda.blockIdx.z == 0:
            store(k_new, t, block, k_quants, k_scales, row)
        else:
            store(v_new, t, block, v_quants, v_scales, row)

    return append_kv_kernel


def append_kv(k_cache: PackedMatrix, v_cache: PackedMatrix, k_new, v_new, positions, *, threads: int = _DEFAULT_THREADS,
              stream=0):
    """Write k_new[t], v_new[t] ([T, width] float32) into row positions[t] ([T] int32) of the caches.

    Positions outside [0, num_positions) are skipped (and rejected here when on the host).

    Launch config: grid (T, ceil(width / 32 / threads), 2) (z: K, V), block `threads` (default
    64); one thread quantizes one 32-element block.
    """
    check_packed("k_cache", k_cache, formats=KV_FORMATS)
    check_packed("v_cache", v_cache, formats=(k_cache.fmt,))
    if (v_cache.num_rows, v_cache.num_cols) != (k_cache.num_rows, k_cache.num_cols):
        raise ValueError("k_cache and v_cache must have the same shape")
    width = k_cache.num_cols
    check_array("k_new", k_new, dtypes=np.float32, shape=(None, width))
    num_tokens = k_new.shape[0]
    check_array("v_new", v_new, dtypes=np.float32, shape=(num_tokens, width))
    check_array("positions", positions, dtypes=np.int32, shape=(num_tokens,))
    check_power_of_two("threads", threads)
    if not is_device_array(positions) and num_tokens and (positions.min() < 0 or positions.max() >= k_cache.num_rows):
        raise ValueError(f"positions must lie in [0, {k_cache.num_rows}), got [{positions.min()}, {positions.max()}]")
    if num_tokens == 0:
        return
    grid = (num_tokens, ceil_div(width // KV_BLOCK, threads), 2)
    _append_kernel(k_cache.fmt, threads)[grid, threads, stream](
        k_new, v_new, positions, k_cache.quants, k_cache.scales, v_cache.quants, v_cache.scales
    )


@functools.cache
def _dequantize_kernel(fmt: str, threads: int):
    from .quant_device import dequant8_for

    dequant8 = dequant8_for(fmt)

    @jit
    def dequantize_kv_kernel(k_quants, k_scales, k_extra, v_quants, v_scales, v_extra, k_out, v_out):
        row = cuda.blockIdx.x
        octet = cuda.blockIdx.y * threads + cuda.threadIdx.x
        if octet * 8 >= k_out.shape[1]:
            return
        values = cuda.local.array(8, np.float32)
        if cuda.blockIdx.z == 0:
            dequant8(k_quants, k_scales, k_extra, row, octet, values, 0)
            for i in range(8):
                k_out[row, octet * 8 + i] = np.float16(values[i])
        else:
            dequant8(v_quants, v_scales, v_extra, row, octet, values, 0)
            for i in range(8):
                v_out[row, octet * 8 + i] = np.float16(values[i])

    return dequantize_kv_kernel


def dequantize_kv(k_cache: PackedMatrix, v_cache: PackedMatrix, num_rows: int, k_out: PackedMatrix,
                  v_out: PackedMatrix, *, threads: int = _DEFAULT_THREADS, stream=0) -> None:
    """Rows 0..num_rows-1 of a Q8_0 / Q4_0 cache layer into F16 matrices of at least num_rows rows.

    Each value is the f32 product d * q rounded to f16: the values the attention kernels stage from
    the quantized cache, so attention over the F16 copy computes the same sums.

    Launch config: grid (num_rows, ceil(width / 8 / threads), 2) (z: K, V), block `threads`
    (default 64); one thread dequantizes one octet.
    """
    check_packed("k_cache", k_cache, formats=KV_FORMATS)
    check_packed("v_cache", v_cache, formats=(k_cache.fmt,))
    width = k_cache.num_cols
    for name, out in (("k_out", k_out), ("v_out", v_out)):
        check_packed(name, out, num_cols=width, formats=("F16",))
        if out.num_rows < num_rows:
            raise ValueError(f"{name} has {out.num_rows} rows, fewer than num_rows {num_rows}")
    if not 0 <= num_rows <= k_cache.num_rows:
        raise ValueError(f"num_rows must lie in [0, {k_cache.num_rows}], got {num_rows}")
    check_power_of_two("threads", threads)
    if num_rows == 0:
        return
    grid = (num_rows, ceil_div(width // 8, threads), 2)
    _dequantize_kernel(k_cache.fmt, threads)[grid, threads, stream](
        k_cache.quants, k_cache.scales, k_cache.extra, v_cache.quants, v_cache.scales, v_cache.extra,
        k_out.quants, v_out.quants
    )
