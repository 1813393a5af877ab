"""Quantized matrix-vector product for decode: y = W x, optionally RMSNorm(x) and y += W x.

A block of `threads` threads is `threads / lanes_per_row` lane groups; each group owns
`rows_per_group` consecutive rows and its lanes stride over the rows' units (quant_dot.py: 8 or
16 elements, two adjacent uint32 words for the block formats), lane i on unit i, so each load
instruction of a warp covers 256 contiguous bytes of one row (Q6_K: whole 32-byte sectors).

Each block first stages x in shared memory (float32, quant_dot's slot-major, pre-scaled layout;
with `norm_weight`, RMSNorm-ed there: 1/rms by a tree reduction, then x * inv_rms * norm_w once
per element). Each lane then loads a unit's x values once into registers and multiplies them
with the same unit of all its group's rows; the row index is clamped rather than tested, so the
2 * rows_per_group word loads of a step are unconditional and in flight together. The lanes'
partial sums meet in a shared-memory tree at the end (the simulator has no warp shuffles; it runs
log2(lanes_per_row) barriers once per block).

Default (H200, 132 SMs, K = 2048): 128 threads all on one row group (lanes_per_row = 128) of
8 rows. A Q4_0/Q4_K row is 128 units, so every thread loads one unit (8 bytes) of each of the 8
rows at once: 64 bytes per thread in flight, 8 KiB per block; at the ~8 blocks per SM the
registers allow, ~64 KiB per SM, against the ~25 KiB (HBM latency x per-SM bandwidth share) it
takes to keep HBM busy. Grids: 4096 rows -> 512 blocks (~4 per SM), the 151,936-row head ->
18,992 blocks, MoE gate/up (768 rows x 8 experts) -> 768 blocks. Staging costs each block a read
of x from L2 (8 KiB), about what it reads of weights, overlapped by the other resident blocks.
Per 4-bit element the inner loop issues 3 instructions (LOP3, FADD, FFMA), per unit and row two
loads, the scale conversion and one FFMA more.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, types

from ._common import ceil_div, check_array, check_power_of_two, empty, is_finite_number, stand_in
from .packing import PackedMatrix, check_packed
from .quant_dot import num_units, staged_floats, unit_ops

MAX_STAGED_BYTES = 48 * 1024  # dynamic shared memory without the opt-in attribute


class GemvConfig(NamedTuple):
    threads: int = 128
    lanes_per_row: int = 128
    rows_per_group: int = 8

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


def staged_bytes(fmts, num_cols: int) -> int:
    """Dynamic shared memory for x staged once per format in `fmts` (a kernel's launch parameter)."""
    total = 4 * sum(staged_floats(f, num_cols) for f in fmts)
    if total > MAX_STAGED_BYTES:
        raise ValueError(f"{num_cols} columns of {'/'.join(fmts)} stage {total} bytes of x, over {MAX_STAGED_BYTES}")
    return total


@functools.cache
def rows_dot_device(fmt: str, lanes: int, num_rows: int):
    """device_rows_dot(quants, scales, extra, row0, row_end, xs, xs_base, units, lane, acc):
    acc[r] += W[row0 + r] . x over this lane's units, x staged by stage_device(fmt) at
    xs[xs_base:]; for rows at or past row_end acc[r] gets garbage (the caller drops it).
    """
    ops = unit_ops(fmt)
    slots, dot = ops.layout.slots, ops.dot

    @cuda.jit(device=True)
    def device_rows_dot(quants, scales, extra, row0, row_end, xs, xs_base, units, lane, acc):
        if row0 >= row_end:
            return
        last = row_end - 1
        xv = cuda.local.array(slots, np.float32)
        for unit in range(lane, units, lanes):
            for s in range(slots):
                xv[s] = xs[xs_base + s * units + unit]
            for r in range(num_rows):
                acc[r] += dot(quants, scales, extra, min(row0 + r, last), unit, units, xv)

    return device_rows_dot


@functools.cache
def lane_sum_device(lanes: int, num_rows: int):
    """device_lane_sum(acc, red, group, lane) -> sum over the group's lanes of acc[lane] (lanes < num_rows).

    A shared-memory tree, log2(lanes) + 1 barriers; `red` holds threads * num_rows floats.
    Callers reusing `red` sync first.
    """

    @cuda.jit(device=True)
    def device_lane_sum(acc, red, group, lane):
        base = group * num_rows * lanes
        for r in range(num_rows):
            red[base + r * lanes + lane] = acc[r]
        stride = lanes // 2
        while stride > 0:
            cuda.syncthreads()
            if lane < stride:
                for r in range(num_rows):
                    red[base + r * lanes + lane] += red[base + r * lanes + lane + stride]
            stride //= 2
        cuda.syncthreads()
        total = np.float32(0.0)
        if lane < num_rows:
            total = red[base + lane * lanes]
        return total

    return device_lane_sum


@cuda.jit(device=True)
def device_inv_rms(x, x_row, eps, red, tid, num_threads):
    """1 / sqrt(mean(x[x_row]^2) + eps), computed by the whole block (num_threads a power of two)."""
    num_cols = x.shape[1]
    sum_sq = np.float32(0.0)
    for k in range(tid, num_cols, num_threads):
        v = np.float32(x[x_row, k])
        sum_sq += v * v
    cuda.syncthreads()
    red[tid] = sum_sq
    stride = num_threads // 2
    while stride > 0:
        cuda.syncthreads()
        if tid < stride:
            red[tid] += red[tid + stride]
        stride //= 2
    cuda.syncthreads()
    return np.float32(1.0) / np.float32(math.sqrt(red[0] / np.float32(num_cols) + eps))


@functools.cache
def stage_device(fmt: str, threads: int, has_norm: bool):
    """device_stage(x, x_row, norm_w, eps, xs, xs_base, units, red, tid): x[x_row] (RMSNorm-ed when
    has_norm) into xs[xs_base:] in quant_dot's layout for `fmt`, by the whole block; ends with a barrier.
    """
    ops = unit_ops(fmt)
    elems, sums, slot_of = ops.layout.unit_elems, ops.layout.sum_slots, ops.slot

    @cuda.jit(device=True)
    def device_x(x, x_row, norm_w, scale, k):
        v = np.float32(x[x_row, k]) * scale
        if has_norm:
            v *= norm_w[k]
        return v

    @cuda.jit(device=True)
    def device_stage(x, x_row, norm_w, eps, xs, xs_base, units, red, tid):
        scale = np.float32(1.0)
        if has_norm:
            scale = device_inv_rms(x, x_row, eps, red, tid, threads)
        num_cols = x.shape[1]
        for i in range(tid, units * elems, threads):
            slot = i // units
            k, shift, _ = slot_of(i - slot * units, slot, units)
            v = np.float32(0.0)
            if k < num_cols:
                v = device_x(x, x_row, norm_w, scale, k) / np.float32(1 << shift)
            xs[xs_base + i] = v
        for i in range(tid, units * sums, threads):
            part = i // units
            unit = i - part * units
            total = np.float32(0.0)
            for slot in range(elems):
                k, _, sum_slot = slot_of(unit, slot, units)
                if sum_slot == part and k < num_cols:
                    total += device_x(x, x_row, norm_w, scale, k)
            xs[xs_base + units * elems + i] = total
        cuda.syncthreads()

    return device_stage


@functools.cache
def _gemv_kernel(fmt: str, config: GemvConfig, has_norm: bool, is_accumulate: bool):
    threads, lanes, num_rows = config.threads, config.lanes_per_row, config.rows_per_group
    rows_per_block = config.rows_per_block
    red_size = threads * num_rows
    stage = stage_device(fmt, threads, has_norm)
    rows_dot = rows_dot_device(fmt, lanes, num_rows)
    lane_sum = lane_sum_device(lanes, num_rows)

    @cuda.jit
    def gemv_kernel(quants, scales, extra, x, norm_w, eps, units, y):  # x [1, K], y [N]
        tid = cuda.threadIdx.x
        lane = tid % lanes
        group = tid // lanes
        xs = cuda.shared.array(0, types.float32)  # the staged x (np.float32 trips the simulator)
        red = cuda.shared.array(red_size, np.float32)
        stage(x, 0, norm_w, eps, xs, 0, units, red, tid)
        row0 = cuda.blockIdx.x * rows_per_block + group * num_rows
        acc = cuda.local.array(num_rows, np.float32)
        for r in range(num_rows):
            acc[r] = np.float32(0.0)
        rows_dot(quants, scales, extra, row0, y.shape[0], xs, 0, units, lane, acc)
        total = lane_sum(acc, red, group, lane)
        if lane < num_rows and row0 + lane < y.shape[0]:
            if is_accumulate:
                y[row0 + lane] += total
            else:
                y[row0 + lane] = total

    return gemv_kernel


def gemv(w: PackedMatrix, x, y=None, *, norm_weight=None, eps: float = 1e-6, accumulate: bool = False,
         config: GemvConfig = GemvConfig()):
    """y[n] = sum_k W[n, k] x'[k] with x' = x, or RMSNorm(x) * norm_weight when norm_weight is given.

    w: packed [N, K] (any format); x: [K] float32 or float16; norm_weight: [K] float32;
    y: [N] float32 (allocated when None); accumulate=True adds into y (the residual stream).

    Launch config: grid ceil(N / (threads / lanes_per_row * rows_per_group)), block `threads`;
    static shared memory threads * rows_per_group float32, dynamic shared memory the staged x
    (staged_bytes: 4 K bytes for most formats, at most 48 KiB). Default (H200): 128 threads,
    128 lanes per row, 8 rows per block (see the module docstring).
    """
    check_packed("w", w)
    config = config.validate()
    num_cols = w.num_cols
    check_array("x", x, dtypes=(np.float32, np.float16), shape=(num_cols,))
    has_norm = norm_weight is not None
    if has_norm:
        check_array("norm_weight", norm_weight, dtypes=np.float32, shape=(num_cols,))
        if not is_finite_number(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if y is None:
        if accumulate:
            raise ValueError("accumulate=True needs y, the array to add into")
        y = empty((w.num_rows,), np.float32, w.quants, x)
    check_array("y", y, dtypes=np.float32, shape=(w.num_rows,))
    if w.num_rows == 0:
        return y
    norm_w = norm_weight if has_norm else stand_in(x, np.float32, 1)
    kernel = _gemv_kernel(w.fmt, config, has_norm, accumulate)
    grid = ceil_div(w.num_rows, config.rows_per_block)
    smem = staged_bytes((w.fmt,), num_cols)
    kernel[grid, config.threads, 0, smem](w.quants, w.scales, w.extra, x.reshape(1, num_cols), norm_w,
                                          np.float32(eps), num_units(w.fmt, num_cols), y)
    return y
