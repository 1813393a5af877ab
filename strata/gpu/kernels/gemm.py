"""Quantized matrix-matrix product for prefill: Y = X W^T, dequantization fused into the tiles.

A block computes a block_m x block_n tile of Y (tokens x weight rows). Per 32-wide step of K it
stages X's [block_m, 32] slice (float32 or float16, gathered through a row index list) and W's
[block_n, 32] slice, dequantized by octets from the packed planes, into shared memory as float32;
each thread then accumulates a thread_m x thread_n register tile, rows and columns strided by
block / thread so that a warp's shared-memory reads are broadcasts or conflict-free. The float
weights only ever exist in shared memory, one tile at a time.

Two main loops share this contract, chosen by the configuration's type:

    GemmConfig  FFMA: float32 tiles, a thread_m x thread_n register tile per thread (this module);
    MmaConfig   tensor cores: float16 tiles, mma.m16n8k16 fragments per warp (gemm_mma.py), through
                linked CUDA C++ on the GPU or its pure-Numba twin in the simulator.

Kernels stay generic: they size shared memory from the config (`xs_size`, `ws_size`,
`stage_dtype`), keep `acc_size` accumulators per thread, and find the tile element of each
accumulator with `acc_coords_device(config)`; the row gather, the staging of quantized weights
and every epilogue (plain, residual add, MoE SwiGLU and weighted scatter in moe.py) are shared.
`default_config(*formats)` picks tensor cores wherever they are available (the fused C++ K loop for the
block formats; an MoE's gate and up only when they share a format).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import gemm_mma, tensor_core
from ._common import (
    IS_SIMULATOR,
    OCTET,
    ceil_div,
    check_array,
    empty,
    is_device_array,
    stand_in,
)
from .gemm_config import (
    BLOCK_K,
    FUSED_FORMATS,
    OCTETS_PER_STEP,
    GemmConfig,
    MmaConfig,
    default_config,
    is_fused,
)
from .launcher import jit
from .packing import PackedMatrix, check_packed
from .quant_device import dequant8_for
from .shared_tiles import dynamic_bytes, launch, tiles_device


def staged_input(x, config, *fmts: str, out=None):
    """x (checked C-contiguous) as the main loop for these weight formats reads it: float16 for the fused
    loop (the values every MmaConfig loop stages anyway, written into ``out`` where given), x itself
    otherwise."""
    if not is_fused(config, *fmts) or x.dtype == np.float16:
        return x
    from .elementwise import to_float16

    return to_float16(x, out)


def is_staged_as_f16(fmt: str) -> bool:
    """Whether gemm stages a matrix of ``fmt`` as float16 values before its launch (on a GPU with tensor cores):
    the quantized formats the fused loop does not read (the other K-quants, the I-quants, BF16), whose octets
    the Numba loop would dequantize again in every tile of every block (the I-quants' grid lookups among
    them). Float32 weights (the routers) keep the Numba loop."""
    return fmt not in FUSED_FORMATS and fmt != "F32"


def launch_format(fmt: str) -> str:
    """The format gemm's main loop reads for a matrix of ``fmt``: F16 where it stages the matrix (on a GPU with
    tensor cores), else ``fmt``."""
    return "F16" if is_staged_as_f16(fmt) and tensor_core.is_available() else fmt


def f16_staging_bytes(num_rows: int, num_cols: int) -> int:
    """The float16 copy gemm stages a [num_rows, num_cols] matrix in (is_staged_as_f16)."""
    return 2 * num_rows * num_cols


@functools.cache
def _to_f16_kernel(fmt: str):
    dequant8 = dequant8_for(fmt)

    @jit
    def to_f16_kernel(quants, scales, extra, out):  # out [N, K] float16
        i = cuda.grid(1)
        num_octets = out.shape[1] // OCTET
        if i < out.shape[0] * num_octets:
            row, octet = i // num_octets, i % num_octets
            values = cuda.local.array(OCTET, np.float32)
            dequant8(quants, scales, extra, row, octet, values, 0)
            for j in range(OCTET):
                out[row, octet * OCTET + j] = np.float16(values[j])

    return to_f16_kernel


def dequantize_f16(w: PackedMatrix, out=None) -> PackedMatrix:
    """w as an F16 matrix: each value the float16 rounding of its octet dequantizer's (the value every
    tensor-core loop stages); out: optional [N, K] float16."""
    if out is None:
        out = empty((w.num_rows, w.num_cols), np.float16, w.quants)
    check_array("out", out, dtypes=np.float16, shape=(w.num_rows, w.num_cols))
    num_octets = w.num_rows * (w.num_cols // OCTET)
    if num_octets:
        _to_f16_kernel(w.fmt)[ceil_div(num_octets, 256), 256](w.quants, w.scales, w.extra, out)
    return PackedMatrix("F16", w.num_rows, w.num_cols, out, stand_in(out, np.float16, 2),
                        stand_in(w.extra, np.uint8, 2))


@functools.cache
def _tile_devices(fmt: str, config: GemmConfig):
    """(device_stage_x, device_stage_w, device_tile_fma): the pieces of one 32-wide K step."""
    dequant8 = dequant8_for(fmt)
    bm, bn, tm, tn = config
    threads = config.threads
    cols_n = bn // tn  # threads along n
    stride_m, stride_n = bm // tm, bn // tn
    x_loads = bm * BLOCK_K // threads
    w_loads = bn * OCTETS_PER_STEP // threads

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
            n = idx // OCTETS_PER_STEP
            octet = idx % OCTETS_PER_STEP
            if w_row0 + n < w_row_end:
                dequant8(quants, scales, extra, w_row0 + n, step * OCTETS_PER_STEP + octet, wl, 0)
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


def mainloop_device(fmt: str, config):
    """The main loop for ``config`` (GemmConfig or MmaConfig), same signature for both."""
    if isinstance(config, MmaConfig):
        return gemm_mma.mainloop_device(fmt, config)
    return _ffma_mainloop_device(fmt, config)


def dual_mainloop_device(fmt_a: str, fmt_b: str, config):
    """The two-weight main loop for ``config`` (GemmConfig or MmaConfig)."""
    if isinstance(config, MmaConfig):
        return gemm_mma.dual_mainloop_device(fmt_a, fmt_b, config)
    return _ffma_dual_mainloop_device(fmt_a, fmt_b, config)


def acc_coords_device(config):
    """device_acc_coords(tid, idx) -> (m, n): where accumulator idx of thread tid sits in the block tile."""
    if isinstance(config, MmaConfig):
        return gemm_mma.acc_coords_device(config)
    return _ffma_acc_coords_device(config)


@functools.cache
def _ffma_acc_coords_device(config: GemmConfig):
    tn = config.thread_n
    cols_n = config.block_n // tn
    stride_m, stride_n = config.block_m // config.thread_m, config.block_n // tn

    @cuda.jit(device=True)
    def device_acc_coords(tid, idx):
        return tid // cols_n + (idx // tn) * stride_m, tid % cols_n + (idx % tn) * stride_n

    return device_acc_coords


@functools.cache
def _ffma_mainloop_device(fmt: str, config: GemmConfig):
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
def _ffma_dual_mainloop_device(fmt_a: str, fmt_b: str, config: GemmConfig):
    """device_gemm_dual_mainloop(x, x_rows, qa, sa, ea, qb, sb, eb, w_row0, w_row_end, xs, ws_a, ws_b,
    acc_a, acc_b, tid):

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


def jit_options(config) -> dict:
    """cuda.jit options of a kernel running this config's main loop: link-time optimization when asked
    (the C++ loop only); on a GPU, over 256 threads, launch bounds, so that ptxas keeps to the
    65,536 / threads registers a thread may have (more, and every launch fails)."""
    options = {"lto": True} if getattr(config, "lto", False) and getattr(config, "is_native", False) else {}
    if config.threads > 256 and not IS_SIMULATOR:  # the simulator's jit takes no launch bounds
        options["launch_bounds"] = config.threads
    return options


@functools.cache
def _gemm_kernel(fmt: str, config, is_accumulate: bool):
    bm, bn, acc_size = config.block_m, config.block_n, config.acc_size
    mainloop = mainloop_device(fmt, config)
    coords = acc_coords_device(config)
    tiles = tiles_device(config, 1)

    @jit(**jit_options(config))
    def gemm_kernel(x, quants, scales, extra, y):  # x [T, K], y [T, N]
        tid = cuda.threadIdx.x
        x_rows = cuda.shared.array(bm, np.int32)
        xs, ws = tiles()
        m0 = cuda.blockIdx.y * bm
        n0 = cuda.blockIdx.x * bn
        if tid < bm:
            x_rows[tid] = m0 + tid if m0 + tid < x.shape[0] else -1
        acc = cuda.local.array(acc_size, np.float32)
        for i in range(acc_size):
            acc[i] = np.float32(0.0)
        cuda.syncthreads()
        mainloop(x, x_rows, quants, scales, extra, n0, y.shape[1], xs, ws, acc, tid)
        for idx in range(acc_size):
            tile_m, tile_n = coords(tid, idx)
            m, n = m0 + tile_m, n0 + tile_n
            if m < y.shape[0] and n < y.shape[1]:
                if is_accumulate:
                    y[m, n] += acc[idx]
                else:
                    y[m, n] = acc[idx]

    return gemm_kernel


def gemm(x, w: PackedMatrix, y=None, *, accumulate: bool = False, config=None):
    """y[t, n] = sum_k x[t, k] W[n, k]: x [T, K] float32/float16, W packed [N, K], y [T, N] float32.

    accumulate=True adds into y (the residual stream) instead of overwriting it.

    Without a config, on a GPU with tensor cores, a matrix of a format the fused loop does not read is first
    staged as float16 (dequantize_f16: f16_staging_bytes of scratch, one launch) and runs the fused loop.

    Launch config: grid (ceil(N / block_n), ceil(T / block_m)), config.threads threads.
    GemmConfig (FFMA): (block_m / thread_m) * (block_n / thread_n) threads, shared 32 * (block_m +
    block_n) float32; MmaConfig (tensor cores, the default on the GPU): for the block formats the fused
    loop on 128 x 64 tiles, 8 warps of 32 x 32, 256 threads, shared 2 * 40 * (block_m + block_n) float16
    (30 KiB); for the others 128 x 128 tiles, 8 warps of 32 x 64, shared 40 * (block_m + block_n)
    float16 (20 KiB).
    """
    check_packed("w", w)
    is_staging = config is None and launch_format(w.fmt) != w.fmt and is_device_array(w.quants)
    config = (config or default_config("F16" if is_staging else w.fmt)).validate()
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
    if is_staging:
        w = dequantize_f16(w)
    grid = (ceil_div(w.num_rows, config.block_n), ceil_div(num_tokens, config.block_m))
    x = staged_input(x, config, w.fmt)
    launch(_gemm_kernel(w.fmt, config, accumulate), grid, config.threads, dynamic_bytes(config, 1),
           x, w.quants, w.scales, w.extra, y)
    return y
