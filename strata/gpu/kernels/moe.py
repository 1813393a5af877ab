"""MoE expert products: out[t] += sum_j w_tj * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j].

Expert weights are packed expert stacks: gate and up [E * F, H], down [E * H, F] (expert e's
row n is row e * F + n, resp. e * H + n), in any format. E may equal the slots of an expert
cache, ids then naming slots: the kernels read the slot a resident expert occupies, never a copy.

Prefill (moe_experts_prefill), two launches over the tiles of moe_route.moe_group:
    gate_up: per (tile of block_m grouped pairs, block_n columns of F) one GEMM main loop stages
        the X rows (gathered by pair_token) once per step for both the gate and the up rows of
        the tile's expert; the epilogue writes silu(g) * u to hidden [P, F] (float32 or float16).
    down: per (tile, block_n columns of H): hidden rows x down rows; the epilogue scales by
        pair_weight and atomically adds into out[pair_token] (out is the residual stream), with
        tensor cores two adjacent columns per vector reduction. The k experts of a token land in
        any order, so the float sum is not bitwise reproducible; into int64 fixed-point sums
        (fixed_sums.py, runtime.deterministic) it is.
    With neither config nor down_config given, groups of moe_rows.TILE_ROWS pairs and experts that
    moe_rows serves (moe_rows.FORMATS on tensor cores) run moe_rows' two launches instead: the weight rows on
    the mma's M, the tile's tokens on its N. prefill_tile_rows picks a chunk's grouping accordingly.
Decode (moe_experts_decode), two launches, GEMV-shaped (a few tokens):
    gate_up: grid (F row blocks, T * k pairs), optionally with the FFN RMSNorm fused in;
    down: grid (H row blocks, T); each row group loops over the token's k experts and adds
        sum_j w_j * (W_down_e h_j) into out without atomics.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numba import cuda, types

from . import moe_rows
from ._common import (
    OCTET,
    ceil_div,
    check_array,
    check_positive,
    empty,
    is_finite_number,
    stand_in,
)
from .activation import device_silu_mul
from .block_reduce import device_inv_rms
from .fixed_sums import to_units
from .gemm import (
    acc_coords_device,
    dual_mainloop_device,
    jit_options,
    mainloop_device,
    staged_input,
)
from .gemm_config import (
    BLOCK_K,
    DEFAULT_BLOCK_MS,
    MmaConfig,
    default_config,
    default_down_config,
    moe_block_m,
)
from .gemv import DEFAULT_CONFIG as DEFAULT_GEMV_CONFIG
from .gemv import GemvConfig, lane_sum_device, rows_dot_device
from .gemv_native import FORMATS as NATIVE_FORMATS
from .gemv_native import experts_supported, moe_experts_native
from .launcher import jit
from .moe_route import MoeGroups, tile_slot_device
from .packing import PackedMatrix, check_packed
from .shared_tiles import dynamic_bytes, launch, tiles_device


@functools.cache
def _gate_up_kernel(fmt_gate: str, fmt_up: str, config, is_mapped: bool):
    """is_mapped as for tile_slot_device."""
    bm, bn, acc_size = config.block_m, config.block_n, config.acc_size
    tiles = tiles_device(config, 2)
    loop = dual_mainloop_device(fmt_gate, fmt_up, config)
    coords = acc_coords_device(config)
    tile_slot = tile_slot_device(is_mapped)

    @jit(**jit_options(config))
    def gate_up_kernel(x, gq, gs, ge, uq, us, ue, pair_token, tile_expert, tile_start, tile_rows, num_tiles,
                       slot_of_expert, hidden):
        tile = cuda.blockIdx.y
        expert = tile_slot(tile_expert, num_tiles, slot_of_expert, tile)
        if expert < 0:  # past the tiles in use, or not in this batch (another launch of the grouping has it)
            return
        tid = cuda.threadIdx.x
        ffn = hidden.shape[1]
        start, rows = tile_start[tile], tile_rows[tile]
        x_rows = cuda.shared.array(bm, np.int32)
        xs, ws_g, ws_u = tiles()
        if tid < bm:
            x_rows[tid] = pair_token[start + tid] if tid < rows else -1
        acc_g = cuda.local.array(acc_size, np.float32)
        acc_u = cuda.local.array(acc_size, np.float32)
        for i in range(acc_size):
            acc_g[i] = np.float32(0.0)
            acc_u[i] = np.float32(0.0)
        cuda.syncthreads()
        n0 = cuda.blockIdx.x * bn
        loop(x, x_rows, gq, gs, ge, uq, us, ue, expert * ffn + n0, expert * ffn + ffn, xs, ws_g, ws_u, acc_g, acc_u,
             tid)
        for idx in range(acc_size):
            m, n = coords(tid, idx)
            n += n0
            if m < rows and n < ffn:
                hidden[start + m, n] = device_silu_mul(acc_g[idx], acc_u[idx])

    return gate_up_kernel


@functools.cache
def _down_kernel(fmt_down: str, config, is_mapped: bool, is_hidden_f16: bool, is_fixed: bool = False):
    """is_mapped as for tile_slot_device. is_hidden_f16: the hidden scratch is float16, so the down
    product may run the fused loop (which reads float16 X only). is_fixed: out is int64 fixed-point sums."""
    bm, bn, acc_size = config.block_m, config.block_n, config.acc_size
    tiles = tiles_device(config, 1)
    is_unfused = isinstance(config, MmaConfig) and not is_hidden_f16
    loop = mainloop_device(fmt_down, config._replace(fused=False) if is_unfused else config)
    add_weighted = _add_weighted_device(config, is_fixed)
    tile_slot = tile_slot_device(is_mapped)

    @jit(**jit_options(config))
    def down_kernel(hidden, dq, ds, de, pair_token, pair_weight, tile_expert, tile_start, tile_rows, num_tiles,
                    slot_of_expert, out):
        tile = cuda.blockIdx.y
        expert = tile_slot(tile_expert, num_tiles, slot_of_expert, tile)
        if expert < 0:  # past the tiles in use, or not in this batch (another launch of the grouping has it)
            return
        tid = cuda.threadIdx.x
        dim = out.shape[1]
        start, rows = tile_start[tile], tile_rows[tile]
        x_rows = cuda.shared.array(bm, np.int32)
        xs, ws = tiles()
        if tid < bm:
            x_rows[tid] = start + tid if tid < rows else -1
        acc = cuda.local.array(acc_size, np.float32)
        for i in range(acc_size):
            acc[i] = np.float32(0.0)
        cuda.syncthreads()
        n0 = cuda.blockIdx.x * bn
        loop(hidden, x_rows, dq, ds, de, expert * dim + n0, expert * dim + dim, xs, ws, acc, tid)
        add_weighted(out, acc, pair_token, pair_weight, start, rows, n0, tid)

    return down_kernel


@functools.cache
def _add_weighted_device(config, is_fixed: bool = False):
    """device(out, acc, pair_token, pair_weight, start, rows, n0, tid): out[pair_token[start + m], n0 + n] +=
    pair_weight[start + m] * acc of every accumulator (m, n) of the thread inside the tile's rows and out's
    columns. With tensor cores (mma fragments: entries 2i and 2i + 1 are columns n, n + 1 of one row, n even)
    one call adds each pair; otherwise one atomic add an entry. is_fixed: out is int64 sums in units of 2^-32
    (fixed_sums.py), whose adds give the same bits in any order."""
    coords, acc_size = acc_coords_device(config), config.acc_size
    if not (isinstance(config, MmaConfig) and config.is_native):
        @cuda.jit(device=True)
        def add_each(out, acc, pair_token, pair_weight, start, rows, n0, tid):
            for idx in range(acc_size):
                m, n = coords(tid, idx)
                n += n0
                if m < rows and n < out.shape[1]:
                    product = pair_weight[start + m] * acc[idx]
                    if is_fixed:
                        cuda.atomic.add(out, (pair_token[start + m], n), to_units(product))
                    else:
                        cuda.atomic.add(out, (pair_token[start + m], n), product)

        return add_each
    from . import tensor_core

    ffi = tensor_core.ffi()
    add2 = tensor_core.declare("strata_fixed_add2", (types.CPointer(types.int64), types.float32, types.float32),
                               "reduce.cu") if is_fixed else \
        tensor_core.declare("strata_red_add2", (tensor_core.FLOAT_PTR, types.float32, types.float32), "reduce.cu")

    @cuda.jit(device=True)
    def add_pairs(out, acc, pair_token, pair_weight, start, rows, n0, tid):
        for idx in range(0, acc_size, 2):
            m, n = coords(tid, idx)
            n += n0
            if m < rows and n < out.shape[1]:  # n even and the width even: n + 1 is inside too
                w = pair_weight[start + m]
                add2(ffi.from_buffer(out[pair_token[start + m], n:]), w * acc[idx], w * acc[idx + 1])

    return add_pairs


def _check_experts(gate, up, down, num_experts, dim):
    check_positive("num_experts", num_experts)
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        check_packed(name, w)
        if w.num_rows % num_experts:
            raise ValueError(f"{name} has {w.num_rows} rows, not a whole stack of {num_experts} experts")
    ffn = gate.num_rows // num_experts
    if gate.num_cols != dim or up.num_cols != dim or up.num_rows != gate.num_rows:
        raise ValueError(f"gate and up must both be [{num_experts} * F, {dim}]")
    if down.num_rows != num_experts * dim or down.num_cols != ffn:
        raise ValueError(f"down must be [{num_experts} * {dim}, {ffn}], got [{down.num_rows}, {down.num_cols}]")
    if dim % BLOCK_K or ffn % BLOCK_K:
        raise ValueError(f"hidden size {dim} and FFN size {ffn} must be multiples of {BLOCK_K}")
    return ffn


@dataclasses.dataclass(frozen=True)
class StagedPrefill:
    """One layer's X as its expert products read it, and their hidden scratch: made once for every launch
    over the layer's routed pairs (the cached experts', then each ring batch's). Sharing them is safe on one
    stream: X is read only, and each launch writes the hidden rows of its own tiles and reads them back
    before the next launch starts."""

    x: object  # [T, H] float16 (moe_rows.stage_x's column order on its kernels) or float32
    hidden: object  # [P, F] float16, or float32 on the FFMA tiles
    is_rows: bool  # moe_rows' kernels run the launches


def stage_prefill(x, groups: MoeGroups, gate: PackedMatrix, up: PackedMatrix, down: PackedMatrix, *,
                  num_experts: int, reuse: StagedPrefill | None = None) -> StagedPrefill:
    """x [T, H] staged and the hidden scratch for ``moe_prefill_launches`` on its default configs, with
    these groups and experts. reuse: an earlier layer's, whose float16 X and hidden buffers are written
    again where their shapes and dtypes fit (its launches queued on this stream before these)."""
    ffn = _check_experts(gate, up, down, num_experts, x.shape[1])
    num_pairs = groups.pair_token.shape[0]
    is_rows = moe_rows.is_supported(groups, gate, up, down)
    if not is_rows and groups.block_m not in DEFAULT_BLOCK_MS:
        raise ValueError(f"the groups' tiles are {groups.block_m} pairs, but the default tiles have "
                         f"{DEFAULT_BLOCK_MS} rows: group with gemm_config.moe_block_m(num_pairs, num_experts)")
    config = None if is_rows else default_config(gate.fmt, up.fmt, down.fmt, block_m=groups.block_m).validate()
    hidden_dtype = np.float16 if is_rows or isinstance(config, MmaConfig) else np.float32
    x_out = _fitting(reuse and reuse.x, tuple(x.shape), np.float16)
    hidden = _fitting(reuse and reuse.hidden, (num_pairs, ffn), hidden_dtype)
    if hidden is None:
        hidden = empty((num_pairs, ffn), hidden_dtype, x)
    staged_x = moe_rows.stage_x(x, x_out) if is_rows else staged_input(x, config, gate.fmt, up.fmt, out=x_out)
    return StagedPrefill(staged_x, hidden, is_rows)


def _fitting(array, shape: tuple, dtype):
    """``array`` where it has this shape and dtype, else None."""
    if array is None or tuple(array.shape) != shape or array.dtype != np.dtype(dtype):
        return None
    return array


def moe_prefill_launches(x, groups: MoeGroups, gate: PackedMatrix, up: PackedMatrix, down: PackedMatrix, out, *,
                         num_experts: int, hidden=None, hidden_dtype=None, config=None, down_config=None,
                         slot_of_expert=None, staged: StagedPrefill | None = None):
    """``moe_experts_prefill``'s two launches, checked and bound: (gate_up, down), each launching when
    called; down reads the hidden scratch that gate_up writes. Benchmarks time them apart. On
    moe_rows' kernels X is staged (moe_rows.stage_x) when they are bound: they read x as it was then.

    out [T, H] float32 += the routed experts of every token, or out [T, H] int64: their sums in 64-bit fixed
    point (fixed_sums.py: the same bits whatever order the tiles add in; ``add_fixed_sums`` adds them into the
    residual); x [T, H] float32/float16.

    groups must come from moe_group(..., block_m=config.block_m), or, where config is None, with one
    of gemm_config.DEFAULT_BLOCK_MS (gemm_config.moe_block_m picks it; the FFMA tiles' own without tensor cores).
    hidden: optional [P, F] scratch (P = T * k) of hidden_dtype (float32 or float16; by default float16
    under an MmaConfig, whose loops stage it as float16 anyway, else float32). config: GemmConfig (FFMA)
    or MmaConfig (tensor cores); default gemm_config.default_config(<the three formats>, block_m=groups.block_m).
    down_config: the down launch's tiles (the same block_m: one grouping serves both); default config
    where config is given, else gemm.default_down_config(<the three formats>, block_m=groups.block_m).
    slot_of_expert: optional [N] int32, when the groups name expert ids: tile t computes expert e
    with the weights of slot slot_of_expert[e], and is skipped where that is -1 (one grouping serves
    several launches, each with the slots of the experts it has staged).
    staged: ``stage_prefill``'s X and hidden scratch for these groups and experts, in place of x's staging and
    a new hidden (with the default configs only).

    Launch config: two launches of gemm's blocks: gate_up grid (ceil(F / config.block_n), max_tiles)
    of config.threads, down grid (ceil(H / down_config.block_n), max_tiles) of down_config.threads;
    blocks of tiles beyond num_tiles exit at once. On moe_rows' kernels (neither config given, groups of
    moe_rows.TILE_ROWS pairs, experts it serves, hidden float16 or none): moe_rows' launch config.
    """
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        check_packed(name, w)
    fmts, block_m = (gate.fmt, up.fmt, down.fmt), groups.block_m
    if staged is not None:
        if config is not None or down_config is not None or hidden is not None:
            raise ValueError("staged comes with the default configs and its own hidden scratch")
        hidden = staged.hidden
    if staged.is_rows if staged is not None else (
            config is None and down_config is None and moe_rows.is_supported(groups, gate, up, down) and (
            hidden is None or hidden.dtype == np.float16) and hidden_dtype in (None, np.float16)):
        return _rows_launches(x, groups, gate, up, down, out, num_experts, hidden, slot_of_expert,
                              None if staged is None else staged.x)
    if config is None and block_m not in DEFAULT_BLOCK_MS:
        raise ValueError(f"the groups' tiles are {block_m} pairs, but the default tiles have {DEFAULT_BLOCK_MS} rows: "
                         "group with gemm_config.moe_block_m(num_pairs, num_experts), or pass config")
    if down_config is None:
        down_config = config if config is not None else default_down_config(*fmts, block_m=block_m)
    config = (config or default_config(*fmts, block_m=block_m)).validate()
    down_config = down_config.validate()
    check_array("x", x, dtypes=(np.float32, np.float16), ndim=2)
    num_tokens, dim = x.shape
    ffn = _check_experts(gate, up, down, num_experts, dim)
    check_array("out", out, dtypes=(np.float32, np.int64), shape=(num_tokens, dim))
    if groups.block_m != config.block_m or down_config.block_m != config.block_m:
        raise ValueError(f"the groups' tiles are {groups.block_m} pairs, the GEMM tiles {config.block_m} (config) "
                         f"and {down_config.block_m} (down_config) rows: group with the configs' one block_m")
    num_pairs = groups.pair_token.shape[0]
    if hidden is None:
        if hidden_dtype is None:
            hidden_dtype = np.float16 if isinstance(config, MmaConfig) else np.float32
        hidden = empty((num_pairs, ffn), hidden_dtype, x)
    check_array("hidden", hidden, dtypes=(np.float32, np.float16), shape=(num_pairs, ffn))
    is_mapped = slot_of_expert is not None
    if is_mapped:
        check_array("slot_of_expert", slot_of_expert, dtypes=np.int32, ndim=1)
    table = slot_of_expert if is_mapped else stand_in(groups.tile_expert, np.int32, 1)
    x = staged_input(x, config, gate.fmt, up.fmt) if staged is None else staged.x
    gate_up_kernel = _gate_up_kernel(gate.fmt, up.fmt, config, is_mapped)
    down_kernel = _down_kernel(down.fmt, down_config, is_mapped, hidden.dtype == np.float16, out.dtype == np.int64)
    tiles = (groups.tile_expert, groups.tile_start, groups.tile_rows, groups.num_tiles, table)

    def launch_gate_up():
        launch(gate_up_kernel, (ceil_div(ffn, config.block_n), groups.max_tiles), config.threads,
               dynamic_bytes(config, 2), x, gate.quants, gate.scales, gate.extra, up.quants, up.scales, up.extra,
               groups.pair_token, *tiles, hidden)

    def launch_down():
        launch(down_kernel, (ceil_div(dim, down_config.block_n), groups.max_tiles), down_config.threads,
               dynamic_bytes(down_config, 1), hidden, down.quants, down.scales, down.extra, groups.pair_token,
               groups.pair_weight, *tiles, out)

    return launch_gate_up, launch_down


def prefill_tile_rows(num_pairs: int, num_experts: int, fmts: tuple = (), dim: int = 0, ffn: int = 0) -> int:
    """The grouping's block_m for a prefill chunk of num_pairs routed pairs over experts of these formats
    (gate, up, down) and sizes: moe_rows' tokens a tile where its kernels serve them (faster at every chunk
    size measured), else gemm_config.moe_block_m's choice for the tile kernels (an empty fmts: unknown experts)."""
    if moe_rows.serves(fmts, dim, ffn):
        return moe_rows.TILE_ROWS
    return moe_block_m(num_pairs, num_experts)


def prefill_tile_row_choices(fmts: tuple = (), dim: int = 0, ffn: int = 0) -> tuple:
    """Every block_m prefill_tile_rows may pick for these experts (each its own compiled kernels), with
    tensor cores; with no experts named, every block_m it may pick for any. The FFMA tiles' one shape
    is the caller's to name."""
    if moe_rows.serves(fmts, dim, ffn):
        return (moe_rows.TILE_ROWS,)
    return DEFAULT_BLOCK_MS if fmts else tuple(sorted({*DEFAULT_BLOCK_MS, moe_rows.TILE_ROWS}))


def _rows_launches(x, groups, gate, up, down, out, num_experts, hidden, slot_of_expert, staged_x=None):
    """moe_prefill_launches on moe_rows' kernels: the same checks, float16 X and hidden; staged_x: x as
    moe_rows.stage_x gave it already."""
    check_array("x", x, dtypes=(np.float32, np.float16), ndim=2)
    num_tokens, dim = x.shape
    ffn = _check_experts(gate, up, down, num_experts, dim)
    check_array("out", out, dtypes=(np.float32, np.int64), shape=(num_tokens, dim))
    num_pairs = groups.pair_token.shape[0]
    if hidden is None:
        hidden = empty((num_pairs, ffn), np.float16, x)
    check_array("hidden", hidden, dtypes=np.float16, shape=(num_pairs, ffn))
    is_mapped = slot_of_expert is not None
    if is_mapped:
        check_array("slot_of_expert", slot_of_expert, dtypes=np.int32, ndim=1)
    table = slot_of_expert if is_mapped else stand_in(groups.tile_expert, np.int32, 1)
    x = moe_rows.stage_x(x) if staged_x is None else staged_x  # float16, column quads in the kernels' K order
    return moe_rows.rows_launches(x, groups, gate, up, down, out, hidden, table, is_mapped)


def moe_experts_prefill(x, groups: MoeGroups, gate: PackedMatrix, up: PackedMatrix, down: PackedMatrix, out, *,
                        num_experts: int, hidden=None, hidden_dtype=None, config=None, down_config=None,
                        slot_of_expert=None, staged: StagedPrefill | None = None):
    """out [T, H] float32 (or int64 fixed-point sums) += the routed experts of every token:
    ``moe_prefill_launches``' two launches."""
    gate_up, down_launch = moe_prefill_launches(x, groups, gate, up, down, out, num_experts=num_experts, hidden=hidden,
                                                hidden_dtype=hidden_dtype, config=config, down_config=down_config,
                                                slot_of_expert=slot_of_expert, staged=staged)
    gate_up()
    down_launch()
    return out


@functools.cache
def _decode_kernels(fmt_gate: str, fmt_up: str, fmt_down: str, config: GemvConfig, has_norm: bool):
    threads, lanes, num_rows = config.threads, config.lanes_per_row, config.rows_per_group
    rows_per_block, red_size = config.rows_per_block, threads * num_rows
    gate_dot = rows_dot_device(fmt_gate, lanes, num_rows, has_norm)
    up_dot = rows_dot_device(fmt_up, lanes, num_rows, has_norm)
    down_dot = rows_dot_device(fmt_down, lanes, num_rows, False)
    lane_sum = lane_sum_device(lanes, num_rows)

    @jit
    def gate_up_kernel(x, norm_w, eps, ids, gq, gs, ge, uq, us, ue, hidden):  # hidden [T * k, F]
        tid = cuda.threadIdx.x
        lane, group = tid % lanes, tid // lanes
        pair = cuda.blockIdx.y
        token = pair // ids.shape[1]
        ffn = hidden.shape[1]
        expert = ids[token, pair % ids.shape[1]]
        red = cuda.shared.array(red_size, np.float32)
        inv_rms = np.float32(1.0)
        if has_norm:
            inv_rms = device_inv_rms(x, token, eps, red, tid, threads)
            cuda.syncthreads()
        n0 = cuda.blockIdx.x * rows_per_block + group * num_rows
        acc_g = cuda.local.array(num_rows, np.float32)
        acc_u = cuda.local.array(num_rows, np.float32)
        for r in range(num_rows):
            acc_g[r] = np.float32(0.0)
            acc_u[r] = np.float32(0.0)
        num_octets = x.shape[1] // OCTET
        row0, row_end = expert * ffn + n0, expert * ffn + ffn
        if expert < 0 or expert >= gq.shape[0] // ffn:  # no such expert (NaN logits): contribute nothing
            row0, row_end = 0, 0
        gate_dot(gq, gs, ge, row0, row_end, x, token, norm_w, inv_rms, num_octets, lane, acc_g)
        up_dot(uq, us, ue, row0, row_end, x, token, norm_w, inv_rms, num_octets, lane, acc_u)
        g = lane_sum(acc_g, red, group, lane)
        cuda.syncthreads()
        u = lane_sum(acc_u, red, group, lane)
        if lane < num_rows and n0 + lane < ffn:
            hidden[pair, n0 + lane] = device_silu_mul(g, u)

    @jit
    def down_kernel(hidden, ids, weights, dq, ds, de, out):  # out [T, H] +=
        tid = cuda.threadIdx.x
        lane, group = tid % lanes, tid // lanes
        token = cuda.blockIdx.y
        top_k = ids.shape[1]
        dim = out.shape[1]
        red = cuda.shared.array(red_size, np.float32)
        n0 = cuda.blockIdx.x * rows_per_block + group * num_rows
        acc = cuda.local.array(num_rows, np.float32)
        part = cuda.local.array(num_rows, np.float32)
        for r in range(num_rows):
            acc[r] = np.float32(0.0)
        num_octets = hidden.shape[1] // OCTET
        for j in range(top_k):
            expert = ids[token, j]
            if expert < 0 or expert >= dq.shape[0] // dim:
                continue
            for r in range(num_rows):
                part[r] = np.float32(0.0)
            down_dot(dq, ds, de, expert * dim + n0, expert * dim + dim, hidden, token * top_k + j, hidden[0],
                     np.float32(1.0), num_octets, lane, part)
            for r in range(num_rows):
                acc[r] += weights[token, j] * part[r]
        total = lane_sum(acc, red, group, lane)
        if lane < num_rows and n0 + lane < dim:
            out[token, n0 + lane] += total

    return gate_up_kernel, down_kernel


def moe_experts_decode(x, ids, weights, gate: PackedMatrix, up: PackedMatrix, down: PackedMatrix, out, *,
                       num_experts: int, norm_weight=None, eps: float = 1e-6, hidden=None,
                       config: GemvConfig = DEFAULT_GEMV_CONFIG, native: bool | None = None, stream=0):
    """out [T, H] += routed experts for a few tokens; x [T, H] float32 (RMSNorm-ed here when
    norm_weight [H] is given), ids/weights [T, k] from moe_route (an id outside [0, num_experts)
    contributes nothing); hidden: optional [T * k, F] float32 scratch.

    Launch config: two launches with gemv's block (config.threads threads): gate_up grid
    (ceil(F / rows_per_block), T * k), down grid (ceil(H / rows_per_block), T); or, where
    gemv_native can run the stacks (native as in gemv), its two launches.
    """
    config = config.validate()
    check_array("x", x, dtypes=np.float32, ndim=2)
    num_tokens, dim = x.shape
    ffn = _check_experts(gate, up, down, num_experts, dim)
    check_array("ids", ids, dtypes=np.int32, shape=(num_tokens, None))
    top_k = ids.shape[1]
    check_array("weights", weights, dtypes=np.float32, shape=(num_tokens, top_k))
    check_array("out", out, dtypes=np.float32, shape=(num_tokens, dim))
    has_norm = norm_weight is not None
    if has_norm:
        check_array("norm_weight", norm_weight, dtypes=np.float32, shape=(dim,))
        if not is_finite_number(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if hidden is None:
        hidden = empty((num_tokens * top_k, ffn), np.float32, x)
    check_array("hidden", hidden, dtypes=np.float32, shape=(num_tokens * top_k, ffn))
    if num_tokens == 0:
        return out
    is_native = experts_supported(gate, up, down, top_k)
    if native and not is_native:
        raise ValueError(f"native expert GEMVs need gate and up of one format, each of {', '.join(NATIVE_FORMATS)}, "
                         "on a GPU with linked CUDA C++; pass native=None to fall back to the Numba kernels")
    if is_native if native is None else native:
        return moe_experts_native(x, ids, weights, gate, up, down, out, hidden, norm_weight=norm_weight, eps=eps,
                                  stream=stream)
    gate_up_kernel, down_kernel = _decode_kernels(gate.fmt, up.fmt, down.fmt, config, has_norm)
    norm_w = norm_weight if has_norm else stand_in(x, np.float32, 1)
    gate_up_kernel[(ceil_div(ffn, config.rows_per_block), num_tokens * top_k), config.threads, stream](
        x, norm_w, np.float32(eps), ids, gate.quants, gate.scales, gate.extra, up.quants, up.scales, up.extra, hidden)
    down_kernel[(ceil_div(dim, config.rows_per_block), num_tokens), config.threads, stream](
        hidden, ids, weights, down.quants, down.scales, down.extra, out)
    return out
