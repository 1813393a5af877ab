"""Quantized matrix-matrix product for prefill: Y = X W^T, dequantization fused into the tiles.

A block computes a block_m x block_n tile of Y (tokens x weight rows). Per 32-wide step of K it
stages X's [block_m, 32] slice (float32 or float16, gathered through a row index list) and W's
[block_n, 32] slice, dequantized by octets from the packed planes, into shared memory as float32;
each thread then accumulates a thread_m x thread_n register tile, rows and columns strided by
block / thread so that a warp's shared-memory reads are broadcasts or conflict-free. The float
weights only ever exist in shared memory, one tile at a time.

This is the FFMA path: it is what the simulator runs, and what the tensor-core path must agree
with. On the GPU the tensor-core path replaces only `device_tile_fma` (and the fp32 staging with
fp16 staging) inside `mainloop_device` / `dual_mainloop_device`, with the same signatures:
stage the tiles as fp16 in shared memory and call a linked `mma.sync.m16n8k16` device function
(`cuda.declare_device(..., link=[...])`) on fragments instead of the FFMA loop; the row gather,
the staging of quantized weights and every epilogue (plain, residual add, MoE SwiGLU and
weighted scatter in moe.py) stay as they are.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda

from ._common import OCTET, ceil_div, check_array, check_power_of_two, empty
from .packing import PackedMatrix, check_packed
from .quant_device import dequant8_for

BLOCK_K = 32  # elements of K staged per step: one legacy block, one K-quant sub-block
_OCTETS_PER_STEP = BLOCK_K // OCTET


class GemmConfig(NamedTuple):
    block_m: int = 64
    block_n: int = 64
    thread_m: int = 4
    thread_n: int = 4

    @property
    def threads(self) -> int:
        return (self.block_m // self.thread_m) * (self.block_n // self.thread_n)

    def validate(self) -> "GemmConfig":
        for name in self._fields:
            check_power_of_two(name, getattr(self, name))
        if self.thread_m > self.block_m or self.thread_n > self.block_n:
            raise ValueError(f"thread tile {self.thread_m}x{self.thread_n} exceeds block tile {self.block_m}x{self.block_n}")
        if (self.block_n * _OCTETS_PER_STEP) % self.threads or (self.block_m * BLOCK_K) % self.threads:
            raise ValueError(f"{self.threads} threads cannot stage a {self.block_m}x{self.block_n} tile evenly")
        if self.block_m > self.threads:
            raise ValueError(f"block_m {self.block_m} exceeds the {self.threads} threads that fill its row list")
        return self


@functools.cache
def _tile_devices(fmt: str, config: GemmConfig):
    """(device_stage_x, device_stage_w, device_tile_fma): the pieces of one 32-wide K step."""
    dequant8 = dequant8_for(fmt)
    bm, bn, tm, tn = config
    threads = config.threads
    cols_n = bn // tn  # threads along n
    stride_m, stride_n = bm // tm, bn // tn
    x_loads = bm * BLOCK_K // threads
    w_loads = bn * _OCTETS_PER_STEP // threads

    @cuda.jit(device=True)
    def device_stage_x(x, x_rows, step, xs, tid):  # xs[k * bm + m] = x[x_rows[m], 32 * step + k]
        for i in range(x_loads):
            idx = tid + i * threads
            m = idx // BLOCK_K
            k = idx % BLOCK_K
            row = x_rows[m]
            xs[k * bm + m] = np.float32(x[row, step * BLOCK_K + k]) if row >= 0 else np.float32(0.0)

    @cuda.jit(device=True)
    def device_stage_w(quants, scales, extra, w_row0, w_row_end, step, ws, wl, tid):  # ws[k * bn + n]
        for i in range(w_loads):
            idx = tid + i * threads
            n = idx // _OCTETS_PER_STEP
            octet = idx % _OCTETS_PER_STEP
            if w_row0 + n < w_row_end:
                dequant8(quants, scales, extra, w_row0 + n, step * _OCTETS_PER_STEP + octet, wl, 0)
            else:
                for j in range(OCTET):
                    wl[j] = np.float32(0.0)
            for j in range(OCTET):
                ws[(octet * OCTET + j) * bn + n] = wl[j]

    @cuda.jit(device=True)
    def device_tile_fma(xs, ws, acc, a, b, tid):
        tx = tid % cols_n
        ty = tid // cols_n
        for k in range(BLOCK_K):
            for i in range(tm):
                a[i] = xs[k * bm + ty + i * stride_m]
            for j in range(tn):
                b[j] = ws[k * bn + tx + j * stride_n]
            for i in range(tm):
                for j in range(tn):
                    acc[i * tn + j] += a[i] * b[j]

    return device_stage_x, device_stage_w, device_tile_fma


@functools.cache
def mainloop_device(fmt: str, config: GemmConfig):
    """device_gemm_mainloop(x, x_rows, quants, scales, extra, w_row0, w_row_end, xs, ws, acc, tid):

    acc[i * thread_n + j] += sum_k x[x_rows[m_i], k] * W[w_row0 + n_j, k] with m_i = ty + i * (block_m / thread_m),
    n_j = tx + j * (block_n / thread_n). x_rows: shared int32 [block_m], -1 marks an empty tile row;
    xs, ws: shared float32 [32 * block_m], [32 * block_n]. Every thread of the block must call it.
    """
    stage_x, stage_w, tile_fma = _tile_devices(fmt, config)
    tm, tn = config.thread_m, config.thread_n

    @cuda.jit(device=True)
    def device_gemm_mainloop(x, x_rows, quants, scales, extra, w_row0, w_row_end, xs, ws, acc, tid):
        wl = cuda.local.array(OCTET, np.float32)
        a = cuda.local.array(tm, np.float32)
        b = cuda.local.array(tn, np.float32)
        for step in range(x.shape[1] // BLOCK_K):
            stage_x(x, x_rows, step, xs, tid)
            stage_w(quants, scales, extra, w_row0, w_row_end, step, ws, wl, tid)
            cuda.syncthreads()
            tile_fma(xs, ws, acc, a, b, tid)
            cuda.syncthreads()

    return device_gemm_mainloop


@functools.cache
def dual_mainloop_device(fmt_a: str, fmt_b: str, config: GemmConfig):
    """device_gemm_dual_mainloop(x, x_rows, qa, sa, ea, qb, sb, eb, w_row0, w_row_end, xs, ws_a, ws_b, acc_a, acc_b, tid):

    mainloop_device's products against two weights with the same row range (gate and up), the X
    tile staged once per step for both.
    """
    stage_x, stage_a, tile_fma = _tile_devices(fmt_a, config)
    stage_b = _tile_devices(fmt_b, config)[1]
    tm, tn = config.thread_m, config.thread_n

    @cuda.jit(device=True)
    def device_gemm_dual_mainloop(x, x_rows, qa, sa, ea, qb, sb, eb, w_row0, w_row_end, xs, ws_a, ws_b,
                                  acc_a, acc_b, tid):
        wl = cuda.local.array(OCTET, np.float32)
        a = cuda.local.array(tm, np.float32)
        b = cuda.local.array(tn, np.float32)
        for step in range(x.shape[1] // BLOCK_K):
            stage_x(x, x_rows, step, xs, tid)
            stage_a(qa, sa, ea, w_row0, w_row_end, step, ws_a, wl, tid)
            stage_b(qb, sb, eb, w_row0, w_row_end, step, ws_b, wl, tid)
            cuda.syncthreads()
            tile_fma(xs, ws_a, acc_a, a, b, tid)
            tile_fma(xs, ws_b, acc_b, a, b, tid)
            cuda.syncthreads()

    return device_gemm_dual_mainloop


@functools.cache
def _gemm_kernel(fmt: str, config: GemmConfig, is_accumulate: bool):
    bm, bn, tm, tn = config
    cols_n = bn // tn
    stride_m, stride_n = bm // tm, bn // tn
    xs_size, ws_size, acc_size = BLOCK_K * bm, BLOCK_K * bn, tm * tn
    mainloop = mainloop_device(fmt, config)

    @cuda.jit
    def gemm_kernel(x, quants, scales, extra, y):  # x [T, K], y [T, N]
        tid = cuda.threadIdx.x
        x_rows = cuda.shared.array(bm, np.int32)
        xs = cuda.shared.array(xs_size, np.float32)
        ws = cuda.shared.array(ws_size, np.float32)
        m0 = cuda.blockIdx.y * bm
        n0 = cuda.blockIdx.x * bn
        if tid < bm:
            x_rows[tid] = m0 + tid if m0 + tid < x.shape[0] else -1
        acc = cuda.local.array(acc_size, np.float32)
        for i in range(acc_size):
            acc[i] = np.float32(0.0)
        cuda.syncthreads()
        mainloop(x, x_rows, quants, scales, extra, n0, y.shape[1], xs, ws, acc, tid)
        for i in range(tm):
            m = m0 + tid // cols_n + i * stride_m
            for j in range(tn):
                n = n0 + tid % cols_n + j * stride_n
                if m < y.shape[0] and n < y.shape[1]:
                    if is_accumulate:
                        y[m, n] += acc[i * tn + j]
                    else:
                        y[m, n] = acc[i * tn + j]

    return gemm_kernel


def gemm(x, w: PackedMatrix, y=None, *, accumulate: bool = False, config: GemmConfig = GemmConfig()):
    """y[t, n] = sum_k x[t, k] W[n, k]: x [T, K] float32/float16, W packed [N, K], y [T, N] float32.

    accumulate=True adds into y (the residual stream) instead of overwriting it.

    Launch config: grid (ceil(N / block_n), ceil(T / block_m)), block (block_m / thread_m) *
    (block_n / thread_n) threads; shared memory 32 * (block_m + block_n) float32 + block_m int32.
    Default (H200): 64 x 64 tiles, 4 x 4 per thread, 256 threads, 16.25 KiB shared.
    """
    check_packed("w", w)
    config = config.validate()
    check_array("x", x, dtypes=(np.float32, np.float16), ndim=2)
    num_tokens = x.shape[0]
    if x.shape[1] != w.num_cols:
        raise ValueError(f"x has {x.shape[1]} columns but w has {w.num_cols}")
    if w.num_cols % BLOCK_K:
        raise ValueError(f"gemm needs K to be a multiple of {BLOCK_K}, got {w.num_cols}")
    if y is None:
        if accumulate:
            raise ValueError("accumulate=True needs y, the array to add into")
        y = empty((num_tokens, w.num_rows), np.float32, x, w.quants)
    check_array("y", y, dtypes=np.float32, shape=(num_tokens, w.num_rows))
    if num_tokens == 0 or w.num_rows == 0:
        return y
    grid = (ceil_div(w.num_rows, config.block_n), ceil_div(num_tokens, config.block_m))
    _gemm_kernel(w.fmt, config, accumulate)[grid, config.threads](x, w.quants, w.scales, w.extra, y)
    return y
