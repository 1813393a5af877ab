"""The tensor-core main loop of the prefill GEMMs: fp16 tiles in shared memory, mma.m16n8k16 fragments.

Same contract as gemm.py's FFMA main loop (row gather, dequantization of packed weights by octets,
one 32-wide K step per shared-memory round trip), with three differences:

- tiles are staged as float16, row-major with a padded row stride (LD = 40 halves: the eight
  row groups of a fragment load then start on different banks);
- the block's warps form a warps_m x warps_n grid, each owning a (block_m / warps_m) x
  (block_n / warps_n) tile of 16 x 8 mma tiles; a thread's accumulators are its fragments;
- the product of a step is one call of a linked CUDA C++ function (cuda/gemm_mma.cu) on the GPU,
  or of its pure-Numba twin (same fragment layout, same f16-rounded inputs, f32 sums) in the
  simulator and wherever tensor cores are unavailable.

Accumulator r of mma tile (i, j) of a lane (g = lane / 4, t = lane % 4) is element
(i * 16 + g + 8 * (r // 2), j * 8 + 2 * t + r % 2) of the warp tile: `acc_coords_device` maps it.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import tensor_core
from ._common import OCTET
from .gemm import BLOCK_K, MmaConfig
from .quant_device import dequant8_for

LD = BLOCK_K + 8  # halves per staged row: 32 + 8 padding (20 words: conflict-free fragment loads)
_OCTETS_PER_STEP = BLOCK_K // OCTET
_WARP = 32


@functools.cache
def _warp_tile_device(config: MmaConfig):
    """device_warp_tile(xs, ws, acc, tid): this warp's fragments += its X rows x its W rows over one step."""
    warp_m, warp_n = config.warp_tile
    mi, nj = warp_m // 16, warp_n // 8
    warps_n = config.warps_n
    if config.is_native:
        ffi = tensor_core.ffi()
        mma = tensor_core.declare(f"strata_mma_k32_m{mi}_n{nj}", (tensor_core.HALF_PTR, tensor_core.HALF_PTR,
                                                                  tensor_core.FLOAT_PTR, tensor_core.INT32),
                                  "gemm_mma.cu")

        @cuda.jit(device=True)
        def device_warp_tile(xs, ws, acc, tid):
            warp = tid // _WARP
            x0 = (warp // warps_n) * warp_m * LD
            w0 = (warp % warps_n) * warp_n * LD
            mma(ffi.from_buffer(xs[x0:]), ffi.from_buffer(ws[w0:]), ffi.from_buffer(acc), LD)

        return device_warp_tile

    @cuda.jit(device=True)
    def device_warp_tile_twin(xs, ws, acc, tid):
        warp, lane = tid // _WARP, tid % _WARP
        g, t = lane // 4, lane % 4
        m_base = (warp // warps_n) * warp_m
        n_base = (warp % warps_n) * warp_n
        for i in range(mi):
            for j in range(nj):
                for r in range(4):
                    m = m_base + i * 16 + g + 8 * (r // 2)
                    n = n_base + j * 8 + 2 * t + r % 2
                    total = np.float32(0.0)
                    for k in range(BLOCK_K):
                        total += np.float32(xs[m * LD + k]) * np.float32(ws[n * LD + k])
                    acc[(i * nj + j) * 4 + r] += total

    return device_warp_tile_twin


@functools.cache
def acc_coords_device(config: MmaConfig):
    """device_acc_coords(tid, idx) -> (m, n): the block-tile element that accumulator idx of thread tid holds."""
    warp_m, warp_n = config.warp_tile
    nj = warp_n // 8
    warps_n = config.warps_n

    @cuda.jit(device=True)
    def device_acc_coords(tid, idx):
        warp, lane = tid // _WARP, tid % _WARP
        tile, r = idx // 4, idx % 4
        m = (warp // warps_n) * warp_m + (tile // nj) * 16 + lane // 4 + 8 * (r // 2)
        n = (warp % warps_n) * warp_n + (tile % nj) * 8 + 2 * (lane % 4) + r % 2
        return m, n

    return device_acc_coords


@functools.cache
def _stage_devices(fmt: str, config: MmaConfig):
    dequant8 = dequant8_for(fmt)
    bm, threads = config.block_m, config.threads
    x_loads = bm * BLOCK_K // threads
    w_loads = config.block_n * _OCTETS_PER_STEP // threads

    @cuda.jit(device=True)
    def device_load_x(x, x_rows, step, xr, tid):  # xr[i] = x[x_rows[m], 32 * step + k] into registers
        for i in range(x_loads):
            idx = tid + i * threads
            row = x_rows[idx // BLOCK_K]
            xr[i] = np.float32(x[row, step * BLOCK_K + idx % BLOCK_K]) if row >= 0 else np.float32(0.0)

    @cuda.jit(device=True)
    def device_store_x(xr, xs, tid):  # xs[m * LD + k] = xr as f16
        for i in range(x_loads):
            idx = tid + i * threads
            xs[(idx // BLOCK_K) * LD + idx % BLOCK_K] = np.float16(xr[i])

    @cuda.jit(device=True)
    def device_stage_w(quants, scales, extra, w_row0, w_row_end, step, ws, wl, tid):  # ws[n * LD + k]
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
                ws[n * LD + octet * OCTET + j] = np.float16(wl[j])

    return device_load_x, device_store_x, device_stage_w, x_loads


@functools.cache
def mainloop_device(fmt: str, config: MmaConfig):
    """device_gemm_mainloop(x, x_rows, quants, scales, extra, w_row0, w_row_end, xs, ws, acc, tid):
    gemm.mainloop_device's contract with float16 xs [block_m * LD], ws [block_n * LD]."""
    load_x, store_x, stage_w, x_loads = _stage_devices(fmt, config)
    warp_tile = _warp_tile_device(config)

    @cuda.jit(device=True)
    def device_gemm_mainloop(x, x_rows, quants, scales, extra, w_row0, w_row_end, xs, ws, acc, tid):
        wl = cuda.local.array(OCTET, np.float32)
        xr = cuda.local.array(x_loads, np.float32)
        num_steps = x.shape[1] // BLOCK_K
        load_x(x, x_rows, 0, xr, tid)
        for step in range(num_steps):
            store_x(xr, xs, tid)
            stage_w(quants, scales, extra, w_row0, w_row_end, step, ws, wl, tid)
            cuda.syncthreads()
            if step + 1 < num_steps:  # the next X tile's loads are in flight during the products
                load_x(x, x_rows, step + 1, xr, tid)
            warp_tile(xs, ws, acc, tid)
            cuda.syncthreads()

    return device_gemm_mainloop


@functools.cache
def dual_mainloop_device(fmt_a: str, fmt_b: str, config: MmaConfig):
    """gemm.dual_mainloop_device's contract (gate and up sharing the X tile) on tensor cores."""
    load_x, store_x, stage_a, x_loads = _stage_devices(fmt_a, config)
    stage_b = _stage_devices(fmt_b, config)[2]
    warp_tile = _warp_tile_device(config)

    @cuda.jit(device=True)
    def device_gemm_dual_mainloop(x, x_rows, qa, sa, ea, qb, sb, eb, w_row0, w_row_end, xs, ws_a, ws_b,
                                  acc_a, acc_b, tid):
        wl = cuda.local.array(OCTET, np.float32)
        xr = cuda.local.array(x_loads, np.float32)
        num_steps = x.shape[1] // BLOCK_K
        load_x(x, x_rows, 0, xr, tid)
        for step in range(num_steps):
            store_x(xr, xs, tid)
            stage_a(qa, sa, ea, w_row0, w_row_end, step, ws_a, wl, tid)
            stage_b(qb, sb, eb, w_row0, w_row_end, step, ws_b, wl, tid)
            cuda.syncthreads()
            if step + 1 < num_steps:
                load_x(x, x_rows, step + 1, xr, tid)
            warp_tile(xs, ws_a, acc_a, tid)
            warp_tile(xs, ws_b, acc_b, tid)
            cuda.syncthreads()

    return device_gemm_dual_mainloop
