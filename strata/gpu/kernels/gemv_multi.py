"""Two or three GEMVs over the same activations in one launch: the q, k and v projections.

The matrices may differ in format and row count (a Q4_K_M model stores attn_v as Q6_K and
attn_q/attn_k as Q4_K); blocks [0, b_a) take W_a's rows, the next b_b blocks W_b's, the rest
W_c's, each block working exactly as gemv.py's. Decode saves two launches per layer, and the
fused RMSNorm of x is computed once per block as there. gemv_multi_rows takes R rows of activations
as gemv.gemv_rows does: one read of the matrices, each row with the bits of its one-row call.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ._common import OCTET, ceil_div, check_array, empty, is_finite_number, stand_in
from .block_reduce import device_inv_rms
from .gemv import DEFAULT_CONFIG as DEFAULT_GEMV_CONFIG
from .gemv import GemvConfig, lane_sum_at_device, use_native, x_rows_dot_device
from .gemv_native import gemv_multi_native
from .launcher import jit
from .packing import check_packed


@functools.cache
def _gemv3_kernel(fmts: tuple, config: GemvConfig, has_norm: bool, num_x_rows: int = 1):
    threads, lanes, num_rows = config.threads, config.lanes_per_row, config.rows_per_group
    rows_per_block, red_size = config.rows_per_block, threads * num_rows
    acc_size = num_rows * num_x_rows
    dot_a, dot_b, dot_c = (x_rows_dot_device(f, lanes, num_rows, num_x_rows, has_norm) for f in fmts)
    lane_sum_at = lane_sum_at_device(lanes, num_rows)

    @jit
    def gemv3_kernel(qa, sa, ea, qb, sb, eb, qc, sc, ec, x, norm_w, eps, blocks_a, blocks_b, ya, yb, yc):
        tid = cuda.threadIdx.x  # x [R, K], y* [R, N*]
        lane, group = tid % lanes, tid // lanes
        red = cuda.shared.array(red_size, np.float32)
        inv_rms = cuda.local.array(num_x_rows, np.float32)
        for t in range(num_x_rows):
            inv_rms[t] = np.float32(1.0)
            if has_norm:
                inv_rms[t] = device_inv_rms(x, t, eps, red, tid, threads)
                cuda.syncthreads()
        acc = cuda.local.array(acc_size, np.float32)  # [R, rows]
        for i in range(acc_size):
            acc[i] = np.float32(0.0)
        num_octets = x.shape[1] // OCTET
        block = cuda.blockIdx.x
        segment = 0 if block < blocks_a else (1 if block < blocks_a + blocks_b else 2)
        first = 0 if segment == 0 else (blocks_a if segment == 1 else blocks_a + blocks_b)
        row0 = (block - first) * rows_per_block + group * num_rows
        if segment == 0:
            dot_a(qa, sa, ea, row0, ya.shape[1], x, norm_w, inv_rms, num_octets, lane, acc)
        elif segment == 1:
            dot_b(qb, sb, eb, row0, yb.shape[1], x, norm_w, inv_rms, num_octets, lane, acc)
        else:
            dot_c(qc, sc, ec, row0, yc.shape[1], x, norm_w, inv_rms, num_octets, lane, acc)
        row = row0 + lane
        for t in range(num_x_rows):
            if t > 0:
                cuda.syncthreads()  # every lane has read the last row's sums out of red
            total = lane_sum_at(acc, t * num_rows, red, group, lane)
            if lane < num_rows:
                if segment == 0 and row < ya.shape[1]:
                    ya[t, row] = total
                elif segment == 1 and row < yb.shape[1]:
                    yb[t, row] = total
                elif segment == 2 and row < yc.shape[1]:
                    yc[t, row] = total

    return gemv3_kernel


def gemv_multi(ws, x, ys=None, *, norm_weight=None, eps: float = 1e-6, config: GemvConfig = DEFAULT_GEMV_CONFIG,
               native: bool | None = None, stream=0):
    """ys[i][n] = sum_k W_i[n, k] x'[k] for 2 or 3 packed matrices with the same K (x' as in gemv).

    ws: sequence of PackedMatrix [N_i, K]; x: [K] float32/float16; norm_weight: [K] float32 or
    None; ys: sequence of [N_i] float32 (allocated when None). Returns ys as a tuple.

    Launch config: gemv's block; grid sum_i ceil(N_i / rows_per_block), blocks in matrix order.
    native: as in gemv (the C++ rows when every matrix can take them).
    """
    ws = tuple(ws)
    if not ws:
        raise ValueError("gemv_multi takes 2 or 3 matrices, got 0")
    check_array("x", x, dtypes=(np.float32, np.float16), shape=(ws[0].num_cols,))
    rows = None if ys is None else tuple(y.reshape(1, y.shape[0]) for y in ys)
    outs = gemv_multi_rows(ws, x.reshape(1, x.shape[0]), rows, norm_weight=norm_weight, eps=eps, config=config,
                           native=native, stream=stream)
    return tuple(y.reshape(y.shape[1]) for y in outs) if ys is None else tuple(ys)


def gemv_multi_rows(ws, x, ys=None, *, norm_weight=None, eps: float = 1e-6, config: GemvConfig = DEFAULT_GEMV_CONFIG,
                    native: bool | None = None, stream=0):
    """gemv_multi of R rows of activations in one launch, as gemv.gemv_rows: x [R, K]; ys [R, N_i] (allocated
    when None); row t of each output has the bits of gemv_multi(ws, x[t]). Returns ys as a tuple."""
    ws = tuple(ws)
    if len(ws) not in (2, 3):
        raise ValueError(f"gemv_multi takes 2 or 3 matrices, got {len(ws)}")
    config = config.validate()
    num_cols = ws[0].num_cols
    for i, w in enumerate(ws):
        check_packed(f"ws[{i}]", w, num_cols=num_cols)
    check_array("x", x, dtypes=(np.float32, np.float16), ndim=2)
    num_x_rows = x.shape[0]
    check_array("x", x, dtypes=(np.float32, np.float16), shape=(num_x_rows, num_cols))
    has_norm = norm_weight is not None
    if has_norm:
        check_array("norm_weight", norm_weight, dtypes=np.float32, shape=(num_cols,))
        if not is_finite_number(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    ys = tuple(empty((num_x_rows, w.num_rows), np.float32, w.quants, x) for w in ws) if ys is None else tuple(ys)
    if len(ys) != len(ws):
        raise ValueError(f"{len(ws)} matrices but {len(ys)} outputs")
    for i, (w, y) in enumerate(zip(ws, ys)):
        check_array(f"ys[{i}]", y, dtypes=np.float32, shape=(num_x_rows, w.num_rows))
    if num_x_rows == 0:
        return ys
    if all(use_native(native, w) for w in ws):
        return gemv_multi_native(ws, x, ys, norm_weight=norm_weight, eps=eps, stream=stream)
    if num_x_rows > 1:
        # a launch a row: on the H200 the kernel of several rows did not give a row the bits of its
        # one-row launch (its multiply-adds contract otherwise)
        for t in range(num_x_rows):
            gemv_multi_rows(ws, x[t:t + 1], tuple(y[t:t + 1] for y in ys), norm_weight=norm_weight, eps=eps,
                            config=config, native=False, stream=stream)
        return ys
    w_c, y_c = (ws[2], ys[2]) if len(ws) == 3 else (ws[1], stand_in(ys[1], np.float32, 2))
    blocks = [ceil_div(w.num_rows, config.rows_per_block) for w in ws]
    norm_w = norm_weight if has_norm else stand_in(x, np.float32, 1)
    kernel = _gemv3_kernel((ws[0].fmt, ws[1].fmt, w_c.fmt), config, has_norm, num_x_rows)
    if sum(blocks):
        kernel[sum(blocks), config.threads, stream](
            ws[0].quants, ws[0].scales, ws[0].extra, ws[1].quants, ws[1].scales, ws[1].extra,
            w_c.quants, w_c.scales, w_c.extra, x, norm_w, np.float32(eps), blocks[0], blocks[1], ys[0], ys[1], y_c)
    return ys
