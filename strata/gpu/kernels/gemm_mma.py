"""The tensor-core main loop of the prefill GEMMs: fp16 tiles in shared memory, mma.m16n8k16 fragments.

Same contract as gemm.py's FFMA main loop (row gather, dequantization of packed weights by octets,
K staged step by step through shared memory), with three differences:

- tiles are staged as float16, row-major with a padded row stride (ld = step_k + 8 halves: the
  eight row groups of a fragment load then start on different banks);
- the block's warps form a warps_m x warps_n grid, each owning a (block_m / warps_m) x
  (block_n / warps_n) tile of 16 x 8 mma tiles; a thread's accumulators are its fragments;
- the product of a step is one call of a linked CUDA C++ function (cuda/gemm_mma.cu) on the GPU,
  or of its pure-Numba twin (same fragment layout, same f16-rounded inputs, f32 sums) in the
  simulator and wherever tensor cores are unavailable.

MmaConfig's main-loop options (register prefetch of W, 64-wide steps, double-buffered tiles,
ldmatrix fragments, 16-byte shared stores) change the schedule, never the numerics: the same
f16-rounded inputs meet the same f32 products, summed in a different order at most.

`fused` moves the whole K loop into C++ (cuda/gemm_mma.cu's gemm_fused, GPU only, the block
formats Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K, float16 X): the accumulators stay in registers from the
first step to the last, X rows arrive by cp.async and W octets through registers into
double-buffered tiles, one barrier a step of step_k (32 or 64) elements.
Where it does not apply (another format, float32 X, the simulator) the Numba loop runs; the
numerics are the same.

Accumulator r of mma tile (i, j) of a lane (g = lane / 4, t = lane % 4) is element
(i * 16 + g + 8 * (r // 2), j * 8 + 2 * t + r % 2) of the warp tile: `acc_coords_device` maps it.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from . import tensor_core
from ._common import OCTET
from .gemm_config import BLOCK_K, MmaConfig, is_fused
from .quant_device import dequant8_for, split_dequant8_for

_OCTETS_PER_K32 = BLOCK_K // OCTET
_WARP = 32
_U32_PTR = types.CPointer(types.uint32)
_INT_PTR = types.CPointer(types.int32)
_U8_PTR = types.CPointer(types.uint8)


@functools.cache
def _fused_loop(fmt: str, config: MmaConfig, num_weights: int):
    """cuda/gemm_mma.cu's gemm_fused for this tile and format, declared (num_weights 1, or 2 sharing X)."""
    bm, bn, wm, wn, k = config.block_m, config.block_n, config.warps_m, config.warps_n, config.step_k
    name = f"strata_gemm_fused_{fmt}_m{bm}_n{bn}_w{wm}x{wn}_x{num_weights}_k{k}"
    line = f"\nSTRATA_GEMM_FUSED({fmt}, {bm}, {bn}, {wm}, {wn}, {num_weights}, {k})\n"
    half, i32, f32 = tensor_core.HALF_PTR, tensor_core.INT32, tensor_core.FLOAT_PTR
    quants = half if fmt == "F16" else _U32_PTR  # an F16 matrix's values; the C++ reads them as words
    argtypes = (half, i32, _INT_PTR, i32, quants, half, _U8_PTR, quants, half, _U8_PTR, i32, i32, i32, i32, i32,
                half, half, half, f32, f32)
    return tensor_core.declare(name, argtypes, "gemm_mma.cu", line)


@functools.cache
def _fused_mainloop_device(fmt: str, config: MmaConfig, num_weights: int):
    """The (dual_)mainloop_device contract over the C++ fused loop; x float16, C-contiguous."""
    ffi = tensor_core.ffi()
    loop = _fused_loop(fmt, config, num_weights)
    halves_per_word = 2 if fmt == "F16" else 1  # the C++ counts a row's quants in 32-bit words
    if num_weights == 1:
        @cuda.jit(device=True)
        def device_fused_mainloop(x, x_rows, quants, scales, extra, w_row0, w_row_end, xs, ws, acc, tid):
            w = ffi.from_buffer(ws)
            a = ffi.from_buffer(acc)
            q, s, e = ffi.from_buffer(quants), ffi.from_buffer(scales), ffi.from_buffer(extra)
            loop(ffi.from_buffer(x), np.int32(x.shape[1]), ffi.from_buffer(x_rows), np.int32(x.shape[1] // BLOCK_K),
                 q, s, e, q, s, e, np.int32(quants.shape[1] // halves_per_word), np.int32(scales.shape[1]),
                 np.int32(extra.shape[1]), np.int32(w_row0), np.int32(w_row_end), ffi.from_buffer(xs), w, w, a, a)

        return device_fused_mainloop

    @cuda.jit(device=True)
    def device_fused_dual_mainloop(x, x_rows, qa, sa, ea, qb, sb, eb, w_row0, w_row_end, xs, ws_a, ws_b, acc_a,
                                   acc_b, tid):
        loop(ffi.from_buffer(x), np.int32(x.shape[1]), ffi.from_buffer(x_rows), np.int32(x.shape[1] // BLOCK_K),
             ffi.from_buffer(qa), ffi.from_buffer(sa), ffi.from_buffer(ea), ffi.from_buffer(qb), ffi.from_buffer(sb),
             ffi.from_buffer(eb), np.int32(qa.shape[1] // halves_per_word), np.int32(sa.shape[1]),
             np.int32(ea.shape[1]),
             np.int32(w_row0), np.int32(w_row_end), ffi.from_buffer(xs), ffi.from_buffer(ws_a), ffi.from_buffer(ws_b),
             ffi.from_buffer(acc_a), ffi.from_buffer(acc_b))

    return device_fused_dual_mainloop


@functools.cache
def _warp_tile_device(config: MmaConfig):
    """device_warp_tile(xs, ws, x_buf, w_buf, acc, tid): this warp's fragments += its X rows x its W
    rows over one step_k step of the tiles starting at xs[x_buf], ws[w_buf]."""
    warp_m, warp_n = config.warp_tile
    mi, nj = warp_m // 16, warp_n // 8
    warps_n, ld, step_k = config.warps_n, config.ld, config.step_k
    if config.is_native:
        ffi = tensor_core.ffi()
        prefix = "strata_mma_ldm" if config.ldmatrix else "strata_mma"
        mma = tensor_core.declare(f"{prefix}_k{step_k}_m{mi}_n{nj}", (tensor_core.HALF_PTR, tensor_core.HALF_PTR,
                                                                      tensor_core.FLOAT_PTR, tensor_core.INT32),
                                  "gemm_mma.cu")

        @cuda.jit(device=True)
        def device_warp_tile(xs, ws, x_buf, w_buf, acc, tid):
            warp = tid // _WARP
            x0 = x_buf + (warp // warps_n) * warp_m * ld
            w0 = w_buf + (warp % warps_n) * warp_n * ld
            mma(ffi.from_buffer(xs[x0:]), ffi.from_buffer(ws[w0:]), ffi.from_buffer(acc), ld)

        return device_warp_tile

    @cuda.jit(device=True)
    def device_warp_tile_twin(xs, ws, x_buf, w_buf, acc, tid):
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
                    for k in range(step_k):
                        total += np.float32(xs[x_buf + m * ld + k]) * np.float32(ws[w_buf + n * ld + k])
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
def _put8_device(config: MmaConfig):
    """device_put8(dst, dst_off, values, values_off): dst[dst_off:+8] = values[values_off:+8] as float16."""
    if config.vector_stores and config.is_native:
        ffi = tensor_core.ffi()
        f32 = types.float32
        store8 = tensor_core.declare("strata_store8_f16", (tensor_core.HALF_PTR,) + (f32,) * OCTET, "gemm_mma.cu")

        @cuda.jit(device=True)
        def device_put8_vector(dst, dst_off, v, v_off):
            store8(ffi.from_buffer(dst[dst_off:]), v[v_off], v[v_off + 1], v[v_off + 2], v[v_off + 3],
                   v[v_off + 4], v[v_off + 5], v[v_off + 6], v[v_off + 7])

        return device_put8_vector

    @cuda.jit(device=True)
    def device_put8(dst, dst_off, v, v_off):
        for j in range(OCTET):
            dst[dst_off + j] = np.float16(v[v_off + j])

    return device_put8


@functools.cache
def _x_stage_devices(config: MmaConfig):
    """(device_load_x, device_store_x, xr_size): X's step into registers xr, then into xs as f16.

    device_load_x(x, x_rows, step, num_k32, xr, tid); device_store_x(xr, xs, x_buf, tid).
    Element-per-thread (consecutive threads on consecutive k), or octet-per-thread with vector_stores.
    """
    threads, ld = config.threads, config.ld
    subs = config.step_k // BLOCK_K
    if config.vector_stores:
        put8 = _put8_device(config)
        x_octets = config.block_m * _OCTETS_PER_K32 // threads

        @cuda.jit(device=True)
        def device_load_x_octets(x, x_rows, step, num_k32, xr, tid):  # xr[(s, i) * 8 + j]
            for s in range(subs):
                k32 = step * subs + s
                for i in range(x_octets):
                    idx = tid + i * threads
                    row = x_rows[idx // _OCTETS_PER_K32]
                    k0 = k32 * BLOCK_K + (idx % _OCTETS_PER_K32) * OCTET
                    base = (s * x_octets + i) * OCTET
                    for j in range(OCTET):
                        xr[base + j] = np.float32(x[row, k0 + j]) if row >= 0 and k32 < num_k32 else np.float32(0.0)

        @cuda.jit(device=True)
        def device_store_x_octets(xr, xs, x_buf, tid):
            for s in range(subs):
                for i in range(x_octets):
                    idx = tid + i * threads
                    dst = x_buf + (idx // _OCTETS_PER_K32) * ld + s * BLOCK_K + (idx % _OCTETS_PER_K32) * OCTET
                    put8(xs, dst, xr, (s * x_octets + i) * OCTET)

        return device_load_x_octets, device_store_x_octets, subs * x_octets * OCTET

    x_loads = config.block_m * BLOCK_K // threads

    @cuda.jit(device=True)
    def device_load_x(x, x_rows, step, num_k32, xr, tid):  # xr[s * x_loads + i] = x[x_rows[m], 32 * k32 + k]
        for s in range(subs):
            k32 = step * subs + s
            for i in range(x_loads):
                idx = tid + i * threads
                row = x_rows[idx // BLOCK_K]
                value = np.float32(0.0)
                if row >= 0 and k32 < num_k32:
                    value = np.float32(x[row, k32 * BLOCK_K + idx % BLOCK_K])
                xr[s * x_loads + i] = value

    @cuda.jit(device=True)
    def device_store_x(xr, xs, x_buf, tid):  # xs[x_buf + m * ld + k] = xr as f16
        for s in range(subs):
            for i in range(x_loads):
                idx = tid + i * threads
                xs[x_buf + (idx // BLOCK_K) * ld + s * BLOCK_K + idx % BLOCK_K] = np.float16(xr[s * x_loads + i])

    return device_load_x, device_store_x, subs * x_loads


@functools.cache
def _w_stage_devices(fmt: str, config: MmaConfig):
    """(device_load_w, device_store_w, raw_words_size, raw_floats_size): W's step into ws as f16.

    device_load_w(quants, scales, extra, w_row0, w_row_end, step, num_k32, rw, rf, tid) loads the
    raw words/scales of the step into registers (prefetch_w with a split dequantizer; else nothing);
    device_store_w(quants, scales, extra, w_row0, w_row_end, step, num_k32, rw, rf, ws, w_buf, wl, tid)
    decodes them (or dequantizes straight from global memory) into ws[w_buf + n * ld + k].
    """
    threads, ld = config.threads, config.ld
    subs = config.step_k // BLOCK_K
    w_loads = config.block_n * _OCTETS_PER_K32 // threads
    put8 = _put8_device(config)
    split = split_dequant8_for(fmt) if config.prefetch_w else None
    if split is None:
        dequant8 = dequant8_for(fmt)

        @cuda.jit(device=True)
        def device_load_w_none(quants, scales, extra, w_row0, w_row_end, step, num_k32, rw, rf, tid):
            return

        @cuda.jit(device=True)
        def device_store_w_direct(quants, scales, extra, w_row0, w_row_end, step, num_k32, rw, rf, ws, w_buf, wl, tid):
            for s in range(subs):
                k32 = step * subs + s
                for i in range(w_loads):
                    idx = tid + i * threads
                    n = idx // _OCTETS_PER_K32
                    octet = idx % _OCTETS_PER_K32
                    if w_row0 + n < w_row_end and k32 < num_k32:
                        dequant8(quants, scales, extra, w_row0 + n, k32 * _OCTETS_PER_K32 + octet, wl, 0)
                    else:
                        for j in range(OCTET):
                            wl[j] = np.float32(0.0)
                    put8(ws, w_buf + n * ld + s * BLOCK_K + octet * OCTET, wl, 0)

        return device_load_w_none, device_store_w_direct, 1, 1

    load8, decode8, words, floats = split

    @cuda.jit(device=True)
    def device_load_w(quants, scales, extra, w_row0, w_row_end, step, num_k32, rw, rf, tid):
        for s in range(subs):
            k32 = step * subs + s
            for i in range(w_loads):
                idx = tid + i * threads
                n = idx // _OCTETS_PER_K32
                slot = s * w_loads + i
                if w_row0 + n < w_row_end and k32 < num_k32:
                    load8(quants, scales, extra, w_row0 + n, k32 * _OCTETS_PER_K32 + idx % _OCTETS_PER_K32,
                          rw, rf, slot)
                else:  # zero raw values decode to zeros
                    for j in range(words):
                        rw[slot * words + j] = np.uint32(0)
                    for j in range(floats):
                        rf[slot * floats + j] = np.float32(0.0)

    @cuda.jit(device=True)
    def device_store_w(quants, scales, extra, w_row0, w_row_end, step, num_k32, rw, rf, ws, w_buf, wl, tid):
        for s in range(subs):
            k32 = step * subs + s
            for i in range(w_loads):
                idx = tid + i * threads
                n = idx // _OCTETS_PER_K32
                octet = idx % _OCTETS_PER_K32
                decode8(rw, rf, s * w_loads + i, k32 * _OCTETS_PER_K32 + octet, wl, 0)
                put8(ws, w_buf + n * ld + s * BLOCK_K + octet * OCTET, wl, 0)

    return device_load_w, device_store_w, subs * w_loads * words, subs * w_loads * floats


@functools.cache
def mainloop_device(fmt: str, config: MmaConfig):
    """device_gemm_mainloop(x, x_rows, quants, scales, extra, w_row0, w_row_end, xs, ws, acc, tid):
    gemm.mainloop_device's contract with float16 xs [config.xs_size], ws [config.ws_size]."""
    if is_fused(config, fmt):
        return _fused_mainloop_device(fmt, config, 1)
    load_x, store_x, xr_size = _x_stage_devices(config)
    load_w, store_w, rw_size, rf_size = _w_stage_devices(fmt, config)
    warp_tile = _warp_tile_device(config)
    subs = config.step_k // BLOCK_K
    x_stage, w_stage = config.ld * config.block_m, config.ld * config.block_n  # halves per buffer

    @cuda.jit(device=True)
    def device_gemm_mainloop(x, x_rows, quants, scales, extra, w_row0, w_row_end, xs, ws, acc, tid):
        wl = cuda.local.array(OCTET, np.float32)
        xr = cuda.local.array(xr_size, np.float32)
        rw = cuda.local.array(rw_size, np.uint32)
        rf = cuda.local.array(rf_size, np.float32)
        num_k32 = x.shape[1] // BLOCK_K
        num_steps = (num_k32 + subs - 1) // subs
        load_x(x, x_rows, 0, num_k32, xr, tid)
        load_w(quants, scales, extra, w_row0, w_row_end, 0, num_k32, rw, rf, tid)
        for step in range(num_steps):
            store_x(xr, xs, 0, tid)
            store_w(quants, scales, extra, w_row0, w_row_end, step, num_k32, rw, rf, ws, 0, wl, tid)
            cuda.syncthreads()
            if step + 1 < num_steps:  # the next step's global loads are in flight during the products
                load_x(x, x_rows, step + 1, num_k32, xr, tid)
                load_w(quants, scales, extra, w_row0, w_row_end, step + 1, num_k32, rw, rf, tid)
            warp_tile(xs, ws, 0, 0, acc, tid)
            cuda.syncthreads()

    @cuda.jit(device=True)
    def device_gemm_mainloop_2stage(x, x_rows, quants, scales, extra, w_row0, w_row_end, xs, ws, acc, tid):
        wl = cuda.local.array(OCTET, np.float32)
        xr = cuda.local.array(xr_size, np.float32)
        rw = cuda.local.array(rw_size, np.uint32)
        rf = cuda.local.array(rf_size, np.float32)
        num_k32 = x.shape[1] // BLOCK_K
        num_steps = (num_k32 + subs - 1) // subs
        load_x(x, x_rows, 0, num_k32, xr, tid)
        load_w(quants, scales, extra, w_row0, w_row_end, 0, num_k32, rw, rf, tid)
        store_x(xr, xs, 0, tid)
        store_w(quants, scales, extra, w_row0, w_row_end, 0, num_k32, rw, rf, ws, 0, wl, tid)
        cuda.syncthreads()
        for step in range(num_steps):
            cur, nxt = step % 2, 1 - step % 2
            if step + 1 < num_steps:
                load_x(x, x_rows, step + 1, num_k32, xr, tid)
                load_w(quants, scales, extra, w_row0, w_row_end, step + 1, num_k32, rw, rf, tid)
            warp_tile(xs, ws, cur * x_stage, cur * w_stage, acc, tid)
            if step + 1 < num_steps:  # the other buffer's readers all passed the previous barrier
                store_x(xr, xs, nxt * x_stage, tid)
                store_w(quants, scales, extra, w_row0, w_row_end, step + 1, num_k32, rw, rf, ws, nxt * w_stage, wl,
                        tid)
            cuda.syncthreads()

    return device_gemm_mainloop if config.stages == 1 else device_gemm_mainloop_2stage


@functools.cache
def dual_mainloop_device(fmt_a: str, fmt_b: str, config: MmaConfig):
    """gemm.dual_mainloop_device's contract (gate and up sharing the X tile) on tensor cores."""
    if is_fused(config, fmt_a, fmt_b):
        return _fused_mainloop_device(fmt_a, config, 2)
    load_x, store_x, xr_size = _x_stage_devices(config)
    load_a, store_a, rwa_size, rfa_size = _w_stage_devices(fmt_a, config)
    load_b, store_b, rwb_size, rfb_size = _w_stage_devices(fmt_b, config)
    warp_tile = _warp_tile_device(config)
    subs = config.step_k // BLOCK_K
    x_stage, w_stage = config.ld * config.block_m, config.ld * config.block_n

    @cuda.jit(device=True)
    def device_gemm_dual_mainloop(x, x_rows, qa, sa, ea, qb, sb, eb, w_row0, w_row_end, xs, ws_a, ws_b,
                                  acc_a, acc_b, tid):
        wl = cuda.local.array(OCTET, np.float32)
        xr = cuda.local.array(xr_size, np.float32)
        rwa = cuda.local.array(rwa_size, np.uint32)
        rfa = cuda.local.array(rfa_size, np.float32)
        rwb = cuda.local.array(rwb_size, np.uint32)
        rfb = cuda.local.array(rfb_size, np.float32)
        num_k32 = x.shape[1] // BLOCK_K
        num_steps = (num_k32 + subs - 1) // subs
        load_x(x, x_rows, 0, num_k32, xr, tid)
        load_a(qa, sa, ea, w_row0, w_row_end, 0, num_k32, rwa, rfa, tid)
        load_b(qb, sb, eb, w_row0, w_row_end, 0, num_k32, rwb, rfb, tid)
        for step in range(num_steps):
            store_x(xr, xs, 0, tid)
            store_a(qa, sa, ea, w_row0, w_row_end, step, num_k32, rwa, rfa, ws_a, 0, wl, tid)
            store_b(qb, sb, eb, w_row0, w_row_end, step, num_k32, rwb, rfb, ws_b, 0, wl, tid)
            cuda.syncthreads()
            if step + 1 < num_steps:
                load_x(x, x_rows, step + 1, num_k32, xr, tid)
                load_a(qa, sa, ea, w_row0, w_row_end, step + 1, num_k32, rwa, rfa, tid)
                load_b(qb, sb, eb, w_row0, w_row_end, step + 1, num_k32, rwb, rfb, tid)
            warp_tile(xs, ws_a, 0, 0, acc_a, tid)
            warp_tile(xs, ws_b, 0, 0, acc_b, tid)
            cuda.syncthreads()

    @cuda.jit(device=True)
    def device_gemm_dual_mainloop_2stage(x, x_rows, qa, sa, ea, qb, sb, eb, w_row0, w_row_end, xs, ws_a, ws_b,
                                         acc_a, acc_b, tid):
        wl = cuda.local.array(OCTET, np.float32)
        xr = cuda.local.array(xr_size, np.float32)
        rwa = cuda.local.array(rwa_size, np.uint32)
        rfa = cuda.local.array(rfa_size, np.float32)
        rwb = cuda.local.array(rwb_size, np.uint32)
        rfb = cuda.local.array(rfb_size, np.float32)
        num_k32 = x.shape[1] // BLOCK_K
        num_steps = (num_k32 + subs - 1) // subs
        load_x(x, x_rows, 0, num_k32, xr, tid)
        load_a(qa, sa, ea, w_row0, w_row_end, 0, num_k32, rwa, rfa, tid)
        load_b(qb, sb, eb, w_row0, w_row_end, 0, num_k32, rwb, rfb, tid)
        store_x(xr, xs, 0, tid)
        store_a(qa, sa, ea, w_row0, w_row_end, 0, num_k32, rwa, rfa, ws_a, 0, wl, tid)
        store_b(qb, sb, eb, w_row0, w_row_end, 0, num_k32, rwb, rfb, ws_b, 0, wl, tid)
        cuda.syncthreads()
        for step in range(num_steps):
            cur, nxt = step % 2, 1 - step % 2
            if step + 1 < num_steps:
                load_x(x, x_rows, step + 1, num_k32, xr, tid)
                load_a(qa, sa, ea, w_row0, w_row_end, step + 1, num_k32, rwa, rfa, tid)
                load_b(qb, sb, eb, w_row0, w_row_end, step + 1, num_k32, rwb, rfb, tid)
            warp_tile(xs, ws_a, cur * x_stage, cur * w_stage, acc_a, tid)
            warp_tile(xs, ws_b, cur * x_stage, cur * w_stage, acc_b, tid)
            if step + 1 < num_steps:
                store_x(xr, xs, nxt * x_stage, tid)
                store_a(qa, sa, ea, w_row0, w_row_end, step + 1, num_k32, rwa, rfa, ws_a, nxt * w_stage, wl, tid)
                store_b(qb, sb, eb, w_row0, w_row_end, step + 1, num_k32, rwb, rfb, ws_b, nxt * w_stage, wl, tid)
            cuda.syncthreads()

    return device_gemm_dual_mainloop if config.stages == 1 else device_gemm_dual_mainloop_2stage
