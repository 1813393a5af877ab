"""Quantized matrix-vector product for decode: y = W x, optionally RMSNorm(x) and y += W x.

A thread block is `threads / lanes_per_row` lane groups; each group owns `rows_per_group`
consecutive rows and its lanes stride over the row's octets (8 elements), so neighbouring lanes
read neighbouring words of the packed planes. Each lane loads its 8 activations once and reuses
them for all of the group's rows (the activation reuse that took a plain Numba 4-bit GEMV from
15% to ~40% of HBM on the H200), multiplies in registers with the block scale factored out
(quant_dot.py), and keeps one partial sum per row; the lanes' partials meet in shared memory
once, at the end (no warp shuffles: the simulator has none, and it is once per block).

With `norm_weight` the kernel first computes RMSNorm's 1/rms of x over the block (each block
re-reads x from L2, which costs far less than the launch it saves) and scales every activation by
inv_rms * norm_weight as it loads it: the pre-attention and pre-FFN norms cost no launch.

gemv_rows takes R rows of activations (x [R, K], a speculative verify's few tokens): each lane keeps
R partial sums per weight row and meets each weight octet with all R activation rows while it is in
its registers and L1, so W streams from memory once per launch. Row t's arithmetic is the one-row
kernel's for x[t] alone (the same octets per lane in the same order, the same lane sum): the one-row
gemv is the R = 1 case of this kernel, and every row of an R-row launch has its bits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda

from ._common import (
    IS_SIMULATOR,
    OCTET,
    ceil_div,
    check_array,
    check_power_of_two,
    empty,
    is_finite_number,
    stand_in,
)
from .block_reduce import device_inv_rms
from .gemv_native import FORMATS as NATIVE_FORMATS
from .gemv_native import LAYER_CONFIG, NativeGemvConfig, gemv_native_rows
from .gemv_native import is_supported as is_native_supported
from .launcher import jit
from .packing import PackedMatrix, check_packed
from .quant_dot import dot8_for


class GemvConfig(NamedTuple):
    threads: int = 128
    lanes_per_row: int = 32
    rows_per_group: int = 4

    def validate(self) -> "GemvConfig":
        check_power_of_two("threads", self.threads)
        check_power_of_two("lanes_per_row", self.lanes_per_row)
        if self.lanes_per_row > self.threads:
            raise ValueError(f"lanes_per_row {self.lanes_per_row} exceeds threads {self.threads}")
        if not 1 <= self.rows_per_group <= self.lanes_per_row:
            raise ValueError(f"rows_per_group must be in [1, lanes_per_row], got {self.rows_per_group}")
        return self

    @property
    def rows_per_block(self) -> int:
        return self.threads // self.lanes_per_row * self.rows_per_group


# the simulator runs a Python thread per GPU thread, each barrier a switch of every one: fewer lanes a row
DEFAULT_CONFIG = GemvConfig(threads=32, lanes_per_row=8) if IS_SIMULATOR else GemvConfig()


@functools.cache
def rows_dot_device(fmt: str, lanes: int, num_rows: int, has_norm: bool):
    """device_rows_dot(quants, scales, extra, row0, row_end, x, x_row, norm_w, inv_rms, num_octets, lane, acc):
    acc[r] += W[row0 + r] . x[x_row] over this lane's octets, for r < num_rows with row0 + r < row_end.
    """
    dot8 = dot8_for(fmt)

    @cuda.jit(device=True)
    def device_rows_dot(quants, scales, extra, row0, row_end, x, x_row, norm_w, inv_rms, num_octets, lane, acc):
        xs = cuda.local.array(OCTET, np.float32)
        for octet in range(lane, num_octets, lanes):
            for i in range(OCTET):
                xs[i] = np.float32(x[x_row, octet * OCTET + i])
                if has_norm:
                    xs[i] *= inv_rms * norm_w[octet * OCTET + i]
            for r in range(num_rows):
                if row0 + r < row_end:
                    acc[r] += dot8(quants, scales, extra, row0 + r, octet, xs)

    return device_rows_dot


@functools.cache
def lane_sum_device(lanes: int, num_rows: int):
    """device_lane_sum(acc, red, group, lane) -> sum over the group's lanes of acc[lane] (lanes < num_rows).

    One barrier; `red` holds threads * num_rows floats. Callers reusing `red` sync first.
    """
    lane_sum_at = lane_sum_at_device(lanes, num_rows)

    @cuda.jit(device=True)
    def device_lane_sum(acc, red, group, lane):
        return lane_sum_at(acc, 0, red, group, lane)

    return device_lane_sum


@functools.cache
def lane_sum_at_device(lanes: int, num_rows: int):
    """device_lane_sum_at(acc, acc_off, red, group, lane): lane_sum_device's sum of acc[acc_off + lane]."""

    @cuda.jit(device=True)
    def device_lane_sum_at(acc, acc_off, red, group, lane):
        for r in range(num_rows):
            red[(group * num_rows + r) * lanes + lane] = acc[acc_off + r]
        cuda.syncthreads()
        total = np.float32(0.0)
        if lane < num_rows:
            base = (group * num_rows + lane) * lanes
            for i in range(lanes):
                total += red[base + i]
        return total

    return device_lane_sum_at


@functools.cache
def x_rows_dot_device(fmt: str, lanes: int, num_rows: int, num_x_rows: int, has_norm: bool):
    """device_x_rows_dot(quants, scales, extra, row0, row_end, x, norm_w, inv_rms, num_octets, lane, acc):
    acc[t * num_rows + r] += W[row0 + r] . x[t] over this lane's octets, for t < num_x_rows and r < num_rows
    with row0 + r < row_end (x[t] times inv_rms[t] * norm_w when has_norm). Each (t, r) sum takes the
    same octets in the same order, with the same dot8, as rows_dot_device's for x[t] alone."""
    dot8 = dot8_for(fmt)

    @cuda.jit(device=True)
    def device_x_rows_dot(quants, scales, extra, row0, row_end, x, norm_w, inv_rms, num_octets, lane, acc):
        xs = cuda.local.array(OCTET, np.float32)
        for octet in range(lane, num_octets, lanes):
            for t in range(num_x_rows):
                for i in range(OCTET):
                    xs[i] = np.float32(x[t, octet * OCTET + i])
                    if has_norm:
                        xs[i] *= inv_rms[t] * norm_w[octet * OCTET + i]
                for r in range(num_rows):
                    if row0 + r < row_end:
                        acc[t * num_rows + r] += dot8(quants, scales, extra, row0 + r, octet, xs)

    return device_x_rows_dot


@functools.cache
def _gemv_kernel(fmt: str, config: GemvConfig, has_norm: bool, is_accumulate: bool, num_x_rows: int = 1):
    threads, lanes, num_rows = config.threads, config.lanes_per_row, config.rows_per_group
    rows_per_block = config.rows_per_block
    red_size = threads * num_rows
    acc_size = num_rows * num_x_rows
    x_rows_dot = x_rows_dot_device(fmt, lanes, num_rows, num_x_rows, has_norm)
    lane_sum_at = lane_sum_at_device(lanes, num_rows)

    @jit
    def gemv_kernel(quants, scales, extra, x, norm_w, eps, y):  # x [R, K], y [R, N]
        tid = cuda.threadIdx.x
        lane = tid % lanes
        group = tid // lanes
        red = cuda.shared.array(red_size, np.float32)
        inv_rms = cuda.local.array(num_x_rows, np.float32)
        for t in range(num_x_rows):
            inv_rms[t] = np.float32(1.0)
            if has_norm:
                inv_rms[t] = device_inv_rms(x, t, eps, red, tid, threads)
                cuda.syncthreads()
        row0 = cuda.blockIdx.x * rows_per_block + group * num_rows
        acc = cuda.local.array(acc_size, np.float32)  # [R, rows]
        for i in range(acc_size):
            acc[i] = np.float32(0.0)
        x_rows_dot(quants, scales, extra, row0, y.shape[1], x, norm_w, inv_rms, x.shape[1] // OCTET, lane, acc)
        for t in range(num_x_rows):
            if t > 0:
                cuda.syncthreads()  # every lane has read the last row's sums out of red
            total = lane_sum_at(acc, t * num_rows, red, group, lane)
            if lane < num_rows and row0 + lane < y.shape[1]:
                if is_accumulate:
                    y[t, row0 + lane] += total
                else:
                    y[t, row0 + lane] = total

    return gemv_kernel


def gemv(w: PackedMatrix, x, y=None, *, norm_weight=None, eps: float = 1e-6, accumulate: bool = False,
         config: GemvConfig = DEFAULT_CONFIG, native: bool | None = None,
         native_config: NativeGemvConfig = LAYER_CONFIG, stream=0):
    """y[n] = sum_k W[n, k] x'[k] with x' = x, or RMSNorm(x) * norm_weight when norm_weight is given.

    w: packed [N, K] (any format); x: [K] float32 or float16; norm_weight: [K] float32;
    y: [N] float32 (allocated when None); accumulate=True adds into y (the residual stream).
    stream: 0 (the default stream), a Numba stream or a graph builder capturing the launch.
    native: True runs gemv_native's linked C++ rows (refused where it cannot run), False this
    module's Numba kernel, None (default) the C++ wherever gemv_native.is_supported(w);
    native_config is its launch shape (gemv_native.head_config(fmt) for an output head).

    Launch config: grid ceil(N / (threads / lanes_per_row * rows_per_group)), block `threads`;
    shared memory threads * rows_per_group float32. Default (H200): 128 threads, 32 lanes per row,
    4 rows per lane group: 16 rows per block.
    """
    check_packed("w", w)
    check_array("x", x, dtypes=(np.float32, np.float16), shape=(w.num_cols,))
    if y is None and accumulate:
        raise ValueError("accumulate=True needs y, the array to add into")
    if y is not None:
        check_array("y", y, dtypes=np.float32, shape=(w.num_rows,))
    ys = gemv_rows(w, x.reshape(1, w.num_cols), None if y is None else y.reshape(1, w.num_rows),
                   norm_weight=norm_weight, eps=eps, accumulate=accumulate, config=config, native=native,
                   native_config=native_config, stream=stream)
    return ys.reshape(w.num_rows) if y is None else y


def gemv_rows(w: PackedMatrix, x, y=None, *, norm_weight=None, eps: float = 1e-6, accumulate: bool = False,
              config: GemvConfig = DEFAULT_CONFIG, native: bool | None = None,
              native_config: NativeGemvConfig = LAYER_CONFIG, stream=0):
    """gemv of R rows of activations in one launch: y[t] = W x'[t] (x'[t] RMSNorm-ed alone when norm_weight
    is given); row t of the result has the bits of gemv(w, x[t]). x: [R, K] float32 or float16; y: [R, N]
    float32 (allocated when None); the rest as gemv's. R is a compile-time constant of the kernel: keep
    it small (a speculative verify's rows).

    Launch config: gemv's; shared memory as gemv's; each lane holds R * rows_per_group sums. Through the
    C++ rows (gemv_native.gemv_native_rows): as many rows of x per launch as its shared memory holds.
    """
    check_packed("w", w)
    config = config.validate()
    num_cols = w.num_cols
    check_array("x", x, dtypes=(np.float32, np.float16), ndim=2)
    num_x_rows = x.shape[0]
    check_array("x", x, dtypes=(np.float32, np.float16), shape=(num_x_rows, num_cols))
    has_norm = norm_weight is not None
    if has_norm:
        check_array("norm_weight", norm_weight, dtypes=np.float32, shape=(num_cols,))
        if not is_finite_number(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if y is None:
        if accumulate:
            raise ValueError("accumulate=True needs y, the array to add into")
        y = empty((num_x_rows, w.num_rows), np.float32, w.quants, x)
    check_array("y", y, dtypes=np.float32, shape=(num_x_rows, w.num_rows))
    if w.num_rows == 0 or num_x_rows == 0:
        return y
    if use_native(native, w, is_dynamic=True):  # one row of x past 48 KiB staged: the dynamic block
        return gemv_native_rows(w, x, y, norm_weight=norm_weight, eps=eps, accumulate=accumulate,
                                config=native_config, stream=stream)
    norm_w = norm_weight if has_norm else stand_in(x, np.float32, 1)
    kernel = _gemv_kernel(w.fmt, config, has_norm, accumulate, num_x_rows)
    grid = ceil_div(w.num_rows, config.rows_per_block)
    kernel[grid, config.threads, stream](w.quants, w.scales, w.extra, x, norm_w, np.float32(eps), y)
    return y


def use_native(native: bool | None, w, num_x_rows: int = 1, is_dynamic: bool = False) -> bool:
    """Whether a decode GEMV of w runs gemv_native's C++: `native` as asked, None meaning where it can
    (is_dynamic: gemv_native_rows, whose rows of x may be staged in dynamic shared memory)."""
    is_supported = is_native_supported(w, num_x_rows, is_dynamic)
    if native and not is_supported:
        raise ValueError(f"native GEMV needs a GPU with linked CUDA C++, a {w.fmt} matrix in one of "
                         f"{', '.join(NATIVE_FORMATS)} with aligned device planes and fitting activations; "
                         "pass native=None to fall back to the Numba kernel")
    return is_supported if native is None else bool(native)
