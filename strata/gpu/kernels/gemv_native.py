"""Decode GEMVs whose inner loop is linked CUDA C++ (cuda/gemv_rows.cu): 16-byte loads, warp shuffles.

The Numba GEMVs (gemv.py, gemv_multi.py, moe.py's decode kernels) give each lane 8 elements at a
time with 32-bit loads and walk a row's octets one after another; at decode sizes (a few thousand
rows) that leaves too few loads in flight to cover HBM latency, and the H200 measured 10-27% of
its bandwidth. Here one warp computes whole rows: every lane loads all of its 16-byte quant chunks
of an iteration before any arithmetic (16-byte streaming loads, which Numba cannot issue: hence
C++), and the warp's partial sums meet in shuffles (which the simulator lacks: a GPU-only path).

Each kernel first stages its activations into shared memory as float32 (RMSNorm-ed on the way when
a norm weight is given, as the Numba kernels do), each 32-element group padded to 36 floats so
that lanes reading neighbouring groups start on different banks, then its warps call C++: gemv one
loop over each warp's row groups (loading a group's rows while it multiplies the group before), the
others one function per row group (or row pair). gemv stages a Q4_K matrix's activations in a layout of
its own (each super-block's 8 groups Q4_K_SB_STRIDE floats apart, each group's two half sums in its
padding), which its loop's 32-byte items read. Formats (FORMATS, those whose GPU tests passed on the reference
H200): Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_S, and F32 / F16 rows (the routers); the
expert kernels (EXPERT_FORMATS) take the quantized ones but IQ3_S and IQ2_S (an IQ3_XXS mix's attention
projections, not its experts). The I-quants' output-head launch shapes (head_config) are tested but have not
run on the GPU yet. The Numba
kernels remain the path for the other formats, the simulator, and the reference the GPU tests compare this one
against (same roundings of x, sums in another order).

Launch config: blocks of `warps` warps; gemv: grid ceil(N / (warps * rows_per_warp)), at most
`blocks_per_sm` per SM when set (each block then loops over row groups); experts (ExpertsConfig):
gate/up grid (blocks, T), each warp taking row pairs (one expert's gate and up rows) of its block's token
in turn; down grid (blocks, T), each warp taking output rows over all k experts' chunks (a block stages
all k rows of its token's hidden activations); blocks per token as the config caps them.
"""

from __future__ import annotations

import functools
import math
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
from numba import cuda, types

from . import tensor_core
from ._common import IS_SIMULATOR, ceil_div, is_c_contiguous, is_device_array, stand_in
from .block_reduce import device_warp_sum
from .launcher import jit

# every format cuda/gemv_rows.cu has rows for, and the expert formats of its gate/up pair and down loops
BUILT_FORMATS = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_S", "F32", "F16")
BUILT_EXPERT_FORMATS = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS")
# the formats a GEMV or an expert product is sent through the C++ rows in: those whose GPU tests passed on the H200
FORMATS = BUILT_FORMATS
EXPERT_FORMATS = BUILT_EXPERT_FORMATS
X_GROUP, X_STRIDE = 32, 36
# gemv's Q4_K activations: each 256-element super-block's 8 groups 4 floats further on than 8 groups, so that
# the C++ loop's lanes of two super-blocks start on other banks (cuda/gemv_rows.cu's Q4K_SB_STRIDE)
Q4_K_BLOCK, Q4_K_SB_STRIDE = 256, 8 * X_STRIDE + 4
_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_S")  # rows of whole 256-element super-blocks
_WORD_SCALE_FORMATS = ("Q4_K", "Q5_K")  # d and dmin read as one word, the 12 scale bytes as three
_WARP = 32
_MAX_SHARED_BYTES = 48 * 1024
# headroom for the kernels' other shared arrays (the norm's per-warp sums of each staged row: 320 bytes for five
# rows at 16 warps), small enough that a verify step's five rows of 2,048 columns (9-9.1 KiB each staged) fit one
# launch; it bounds the rows a launch stages (_MAX_X_ROWS)
_RESERVED_SHARED_BYTES = 1024
_MAX_WARPS = 16  # a GEMV block's warps at most (NativeGemvConfig.warps)
_MAX_X_ROWS = _RESERVED_SHARED_BYTES // (4 * _MAX_WARPS)
_ALIGN_BYTES = 16
_MAX_STAGE_REGISTERS = 64  # a thread's staged activations held in registers at most (past it they would spill)
_MIN_REGISTERS, _MAX_REGISTERS = 24, 255  # a thread's register cap where one is asked (ptxas's range)
_U32_PTR, _U8_PTR = types.CPointer(types.uint32), types.CPointer(types.uint8)
_I32_PTR, _I64 = types.CPointer(types.int32), types.int64
_PLANES = (_U32_PTR, tensor_core.HALF_PTR, _U8_PTR)
_STRIDES = (tensor_core.INT32,) * 3


class NativeGemvConfig(NamedTuple):
    warps: int = 8
    rows_per_warp: int = 2  # 1, 2 or 4: rows sharing each lane's activation loads
    # 0: a block per warps * rows_per_warp rows; else at most this many blocks per SM, each going on
    # to further rows after its first ones, so that a block stages (and norms) its activations once
    # for many rows: a vocabulary-sized head has ~5,000 row groups and spent as long staging as multiplying
    blocks_per_sm: int = 0
    x_rows: int = 0  # rows of activations a launch stages: 0, as many as shared memory holds

    def validate(self) -> "NativeGemvConfig":
        if self.warps not in (1, 2, 4, 8, _MAX_WARPS):
            raise ValueError(f"warps must be one of 1, 2, 4, 8, {_MAX_WARPS}, got {self.warps}")
        if self.rows_per_warp not in (1, 2, 4):
            raise ValueError(f"rows_per_warp must be 1, 2 or 4, got {self.rows_per_warp}")
        if self.blocks_per_sm < 0:
            raise ValueError(f"blocks_per_sm must be 0 (no limit) or positive, got {self.blocks_per_sm}")
        if self.x_rows < 0:
            raise ValueError(f"x_rows must be 0 (as many as fit) or positive, got {self.x_rows}")
        return self

    def grid(self, num_rows: int) -> int:
        """Blocks for num_rows rows."""
        grid = ceil_div(num_rows, self.warps * self.rows_per_warp)
        return min(grid, self.blocks_per_sm * _num_sms()) if self.blocks_per_sm else grid

    @property
    def threads(self) -> int:
        return self.warps * _WARP


# Measured on the H200 (graph-timed, Qwen3-30B-A3B shapes): 8 warps of 2 rows for the layers'
# matrices (2,048-4,096 rows are latency-bound: more rows per warp is fewer warps in flight). A
# vocabulary-sized head runs blocks that loop over row groups (at most blocks_per_sm blocks an SM), each
# warp loading its next group while it multiplies the last, in the fastest shape of a sweep of 151,936 x
# 2,048 heads (docs/performance-log.md, 2026-12-01): Q4_0 16 x 2 at 1 an SM, 2,971 GB/s (2,919 at 2 an SM);
# Q8_0 8 x 1 at 8, 3,498 (3,492 for 16 x 1 at 4); Q4_K 16 x 4 at 1, 2,789-2,822 (2,692-2,697 for 16 x 2). Float
# heads keep 8 x 2 at 4, unmeasured. The head's call sites ask for head_config(fmt), so that a slice of
# the head (the warm-up's) runs the same compiled kernel as the whole head. These stage one row of x a
# launch: with several, the 16-warp shapes ran out of registers on the H200 (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES:
# 512 threads may hold 128 registers each). Several rows (a speculative verify's) take _HEAD_ROWS_CONFIGS' shapes,
# blocks of 8 warps, which always launch; a row's sums are the same whatever the shape (each lane adds its items
# in increasing order, then the warp's shuffles). Four rows of a 151,936 x 2,048 head on the H200: 8 x 2 at 2 an SM
# 130 us Q4_0 / 161 Q8_0 (one row: 62-70 / 102-106); 8 x 1 at 2, 193 / 214; 8 x 2 at 1, 138 / 200; 16 x 1 at 1, 190
# / 222. Q5_K, Q6_K, IQ4_XS and IQ3_XXS take Q4_K's shapes, unmeasured.
LAYER_CONFIG = NativeGemvConfig(warps=8, rows_per_warp=2)
_HEAD_CONFIGS = MappingProxyType({
    "Q4_0": NativeGemvConfig(warps=16, rows_per_warp=2, blocks_per_sm=1, x_rows=1),
    "Q8_0": NativeGemvConfig(warps=8, rows_per_warp=1, blocks_per_sm=8, x_rows=1),
    "Q4_K": NativeGemvConfig(warps=16, rows_per_warp=4, blocks_per_sm=1, x_rows=1),
    "Q5_K": NativeGemvConfig(warps=16, rows_per_warp=4, blocks_per_sm=1, x_rows=1),
    "Q6_K": NativeGemvConfig(warps=16, rows_per_warp=4, blocks_per_sm=1, x_rows=1),
    "IQ4_XS": NativeGemvConfig(warps=16, rows_per_warp=4, blocks_per_sm=1, x_rows=1),
    "IQ3_XXS": NativeGemvConfig(warps=16, rows_per_warp=4, blocks_per_sm=1, x_rows=1),
    "IQ3_S": NativeGemvConfig(warps=16, rows_per_warp=4, blocks_per_sm=1, x_rows=1),
    "IQ2_S": NativeGemvConfig(warps=16, rows_per_warp=4, blocks_per_sm=1, x_rows=1),
    "F32": NativeGemvConfig(warps=8, rows_per_warp=2, blocks_per_sm=4, x_rows=1),
    "F16": NativeGemvConfig(warps=8, rows_per_warp=2, blocks_per_sm=4, x_rows=1),
})
_HEAD_ROWS_CONFIG = NativeGemvConfig(warps=8, rows_per_warp=2, blocks_per_sm=2)


def head_config(fmt: str) -> NativeGemvConfig:
    """The launch shape of an output head in format ``fmt``. A format the C++ rows do not serve
    (Q4_1, Q5_0) gets Q4_0's: gemv runs such a head with its Numba kernel, which does not read it."""
    return _HEAD_CONFIGS.get(fmt, _HEAD_CONFIGS["Q4_0"])


def head_rows_config(fmt: str, num_x_rows: int) -> NativeGemvConfig:
    """The launch shape of an output head's product with num_x_rows rows of x (head_config's for one)."""
    return head_config(fmt) if num_x_rows == 1 else _HEAD_ROWS_CONFIG


@functools.cache
def _num_sms() -> int:
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


def x_floats(num_cols: int, is_q4_k_layout: bool = False) -> int:
    """Shared floats for one staged activation row of num_cols elements (in gemv's Q4_K layout when asked)."""
    if is_q4_k_layout:
        return num_cols // Q4_K_BLOCK * Q4_K_SB_STRIDE
    return num_cols // X_GROUP * X_STRIDE


@cuda.jit(device=True)
def device_group_start(group, is_q4_k_layout):
    """The first shared float of staged 32-element group `group`."""
    if is_q4_k_layout:
        return (group // 8) * Q4_K_SB_STRIDE + (group % 8) * X_STRIDE
    return group * X_STRIDE


def is_supported(w, num_x_rows: int = 1, is_dynamic: bool = False) -> bool:
    """True when the linked C++ can run this packed matrix: a real GPU, a format it knows, planes
    C-contiguous and 16-byte aligned, and num_x_rows staged rows of activations fitting in shared memory
    (is_dynamic: in the dynamic block gemv_native_rows takes past the static arrays' 48 KiB)."""
    if not tensor_core.is_available() or w.fmt not in FORMATS or not is_device_array(w.quants):
        return False
    block_elems = Q4_K_BLOCK if w.fmt in _K_QUANTS else X_GROUP
    num_x = x_floats(w.num_cols, w.fmt == "Q4_K")  # the larger of the two layouts
    limit = tensor_core.max_shared_bytes() if is_dynamic else _MAX_SHARED_BYTES
    if w.num_cols % block_elems or 4 * num_x * num_x_rows > limit - _RESERVED_SHARED_BYTES:
        return False
    return (all(is_c_contiguous(p) for p in (w.quants, w.scales, w.extra))
            and w.quants.device_ctypes_pointer.value % _ALIGN_BYTES == 0
            and w.quants.shape[1] * w.quants.dtype.itemsize % _ALIGN_BYTES == 0
            and (w.fmt not in _WORD_SCALE_FORMATS or _is_word_aligned(w.scales, w.extra)))


def _is_word_aligned(*planes) -> bool:
    """True when every plane starts on a 4-byte boundary: the Q4_K and Q5_K rows read a super-block's d and dmin,
    and its 12 scale bytes, as 32-bit words (each row's share of both planes is a whole number of words)."""
    return all(p.device_ctypes_pointer.value % 4 == 0 for p in planes)


def _suffix(fmt: str) -> str:
    return fmt.lower()


def _row_strides(w) -> tuple:
    """(32-bit words, halves, bytes) per row of the quants, scales and extra planes (0 where a plane is a
    stand-in); the quants of a float matrix are its values, counted here in words."""
    num_rows = w.quants.shape[0]
    words = w.quants.shape[1] * w.quants.dtype.itemsize // 4
    return tuple(np.int32(n if p.shape[0] == num_rows else 0)
                 for p, n in ((w.quants, words), (w.scales, w.scales.shape[1]), (w.extra, w.extra.shape[1])))


def register_options(max_registers: int) -> dict:
    """A kernel's jit options for a register cap (0: none; the simulator's jit takes none)."""
    return {"max_registers": max_registers} if max_registers and not IS_SIMULATOR else {}


@functools.cache
def _stage_rows_device(num_cols: int, threads: int, has_norm: bool, num_x_rows: int, num_x: int,
                       is_q4_k_layout: bool = False):
    """device_stage_rows(x, norm_w, eps, red, xs, tid): every row of x [num_x_rows, num_cols] into padded xs,
    row t from xs[t * num_x] (in gemv's Q4_K layout when asked), RMSNorm-ed with norm_w when has_norm: a row's
    sum of squares meets in each warp's shuffles, then the warps' sums in warp order (red: warps * num_x_rows
    floats), x * (inv_rms * w) each. The loads come first, all in flight together: normed, where a thread's
    elements of every row fit in registers (_MAX_STAGE_REGISTERS), it loads them and its norm weights, sums the
    squares, reduces once for all rows and stores each element once; else it keeps them raw in xs as it loads
    (and scales them there after the reduction). One row after another was a load, a reduction and a second load
    each, which a verify step's five rows (and the experts' down projection its k rows of hidden activations)
    paid row by row before any weight arrived. Held in registers on the H100, graph-traced in a decode token:
    q/k/v (normed, one row) 9.3 -> 7.0 us, the experts' gate/up 11.6 -> 9.9; not normed, the output projection
    with the head went 7.7 -> 9.6 us a launch and the down projection stayed (8.9, 8.7): those stream. The
    caller syncs before reading xs."""
    num_warps = threads // _WARP
    num_own = -(-num_cols // threads)  # a row's elements a thread stages
    num_held = num_own * num_x_rows
    is_held = has_norm and num_held + num_own <= _MAX_STAGE_REGISTERS  # the values and the norm's weights

    @cuda.jit(device=True)
    def device_inv_rms_rows(sums, eps, red, tid):
        """sums[t], a thread's sum of squares of row t -> the row's 1 / rms, the same bits in every thread."""
        for t in range(num_x_rows):
            sum_sq = device_warp_sum(sums[t])
            if tid % _WARP == 0:
                red[t * num_warps + tid // _WARP] = sum_sq
        cuda.syncthreads()
        for t in range(num_x_rows):
            total = np.float32(0.0)
            for w in range(num_warps):
                total += red[t * num_warps + w]
            sums[t] = np.float32(1.0) / np.float32(math.sqrt(total / np.float32(num_cols) + eps))

    @cuda.jit(device=True)
    def device_stage_held(x, norm_w, eps, red, xs, tid):  # built only where is_held, so always normed
        values = cuda.local.array(num_held, np.float32)  # [own, R]
        weights = cuda.local.array(num_own, np.float32)
        sums = cuda.local.array(num_x_rows, np.float32)
        for i in range(num_own):
            k = tid + i * threads
            if k < num_cols:
                for t in range(num_x_rows):
                    values[i * num_x_rows + t] = np.float32(x[t, k])
                weights[i] = norm_w[k]
        for t in range(num_x_rows):
            sums[t] = np.float32(0.0)
        for i in range(num_own):
            if tid + i * threads < num_cols:
                for t in range(num_x_rows):
                    v = values[i * num_x_rows + t]
                    sums[t] += v * v
        device_inv_rms_rows(sums, eps, red, tid)
        for i in range(num_own):
            k = tid + i * threads
            if k < num_cols:
                at = device_group_start(k // X_GROUP, is_q4_k_layout) + k % X_GROUP
                for t in range(num_x_rows):
                    xs[t * num_x + at] = values[i * num_x_rows + t] * (sums[t] * weights[i])

    @cuda.jit(device=True)
    def device_stage_streamed(x, norm_w, eps, red, xs, tid):
        sums = cuda.local.array(num_x_rows, np.float32)
        for t in range(num_x_rows):
            sums[t] = np.float32(0.0)
        for k in range(tid, num_cols, threads):
            at = device_group_start(k // X_GROUP, is_q4_k_layout) + k % X_GROUP
            for t in range(num_x_rows):
                v = np.float32(x[t, k])
                xs[t * num_x + at] = v
                if has_norm:
                    sums[t] += v * v
        if has_norm:
            device_inv_rms_rows(sums, eps, red, tid)
            for k in range(tid, num_cols, threads):
                at = device_group_start(k // X_GROUP, is_q4_k_layout) + k % X_GROUP
                for t in range(num_x_rows):
                    xs[t * num_x + at] *= sums[t] * norm_w[k]

    return device_stage_held if is_held else device_stage_streamed


@cuda.jit(device=True)
def device_stage_half_sums_at(xs, xs_off, num_groups, tid, num_threads):
    """The sums of each staged 32-element group's two 16-element halves (gemv's Q4_K layout, from xs_off),
    into the group's padding (floats 32 and 33 from its start), each as four quads of two pairs: the C++
    Q4_K loop reads them for the mins instead of summing them again for every row. The caller syncs before
    (the staging) and after."""
    for half in range(tid, 2 * num_groups, num_threads):
        start = xs_off + device_group_start(half // 2, True)
        base = start + (half % 2) * 16
        total = np.float32(0.0)
        for j in range(4):
            b = base + 4 * j
            total += (xs[b] + xs[b + 1]) + (xs[b + 2] + xs[b + 3])
        xs[start + X_GROUP + half % 2] = total


@cuda.jit(device=True)
def device_stage_half_sums(xs, num_groups, tid, num_threads):
    """device_stage_half_sums_at of the activations staged from xs[0]."""
    device_stage_half_sums_at(xs, 0, num_groups, tid, num_threads)


def _quants_ptr(fmt: str):
    """The C type of a matrix's quants plane as the C++ rows take it (a float matrix's values)."""
    return {"F32": tensor_core.FLOAT_PTR, "F16": tensor_core.HALF_PTR}.get(fmt, _U32_PTR)


# the C++ row functions' format structs and unroll per rows_per_warp, as cuda/gemv_rows.cu instantiates its
# one-row exports (STRATA_GEMV_ROWS / STRATA_GEMV_LOOP): the NX-row exports are the same with NX rows of x
_ROWS_SHAPES = MappingProxyType({
    "Q4_0": ("Q40", {1: 2, 2: 2, 4: 1}), "Q8_0": ("Q80", {1: 2, 2: 2, 4: 1}), "Q4_K": ("Q4K", {1: 2, 2: 2, 4: 1}),
    "Q5_K": ("Q5K", {1: 2, 2: 2, 4: 1}), "Q6_K": ("Q6K", {1: 2, 2: 2, 4: 1}),
    "IQ4_XS": ("IQ4XS", {1: 2, 2: 2, 4: 1}), "IQ3_XXS": ("IQ3XXS", {1: 2, 2: 2, 4: 1}),
    "IQ3_S": ("IQ3S", {1: 2, 2: 2, 4: 1}), "IQ2_S": ("IQ2S", {1: 2, 2: 2, 4: 1}),
    "F32": ("F32", {1: 4, 2: 4, 4: 2}), "F16": ("F16", {1: 4, 2: 4, 4: 2}),
})
_LOOP_SHAPES = MappingProxyType({**_ROWS_SHAPES, "Q4_K": ("Q4KWide", {1: 1, 2: 1, 4: 1})})


def _rows_name(fmt: str, rows_per_warp: int, num_x_rows: int) -> str:
    if num_x_rows == 1:
        return f"strata_gemv_rows_{_suffix(fmt)}_r{rows_per_warp}"
    return f"strata_gemv_rows_x{num_x_rows}_{_suffix(fmt)}_r{rows_per_warp}"


def _rows_instances(fmts, rows_per_warp: int, num_x_rows: int) -> str:
    """The source lines instantiating the NX-row exports of `fmts` (none for one row: the source has those)."""
    if num_x_rows == 1:
        return ""
    lines = []
    for fmt in dict.fromkeys(fmts):
        struct, unroll = _ROWS_SHAPES[fmt]
        lines.append(f"STRATA_GEMV_ROWS_X({_rows_name(fmt, rows_per_warp, num_x_rows)}, {struct}, {rows_per_warp}, "
                     f"{unroll[rows_per_warp]}, {num_x_rows})\n")
    return "".join(lines)


def _declare_rows(fmt: str, rows_per_warp: int, num_x_rows: int = 1, instances: str = ""):
    """The C++ rows of `fmt`: R rows against `num_x_rows` staged rows of x (x_stride floats apart when more
    than one); `instances`: the suffix every NX-row function a kernel links was instantiated in (one object)."""
    x_args = (tensor_core.FLOAT_PTR,) if num_x_rows == 1 else (tensor_core.FLOAT_PTR, tensor_core.INT32)
    return tensor_core.declare(
        _rows_name(fmt, rows_per_warp, num_x_rows),
        (tensor_core.FLOAT_PTR, _quants_ptr(fmt), *_PLANES[1:], _I64, tensor_core.INT32, *_STRIDES, *x_args,
         tensor_core.INT32),
        "gemv_rows.cu", instances)


def _declare_loop(fmt: str, rows_per_warp: int, num_x_rows: int = 1):
    if num_x_rows == 1:
        return tensor_core.declare(
            f"strata_gemv_loop_{_suffix(fmt)}_r{rows_per_warp}",
            (tensor_core.FLOAT_PTR, _quants_ptr(fmt), *_PLANES[1:], _I64, _I64, _I64, *_STRIDES,
             tensor_core.FLOAT_PTR, tensor_core.INT32, tensor_core.INT32),
            "gemv_rows.cu")
    name = f"strata_gemv_loop_x{num_x_rows}_{_suffix(fmt)}_r{rows_per_warp}"
    struct, unroll = _LOOP_SHAPES[fmt]
    instance = f"STRATA_GEMV_LOOP_X({name}, {struct}, {rows_per_warp}, {unroll[rows_per_warp]}, {num_x_rows})\n"
    return tensor_core.declare(
        name,
        (tensor_core.FLOAT_PTR, _I64, _quants_ptr(fmt), *_PLANES[1:], _I64, _I64, _I64, *_STRIDES,
         tensor_core.FLOAT_PTR, tensor_core.INT32, tensor_core.INT32, tensor_core.INT32),
        "gemv_rows.cu", instance)


def max_x_rows(w, is_dynamic: bool = False) -> int:
    """Rows of activations one launch of the C++ rows stages for w (the rest go to further launches): in static
    shared memory, or is_dynamic, in as much dynamic shared memory as a block may have (gemv_native_rows)."""
    num_x = x_floats(w.num_cols, w.fmt == "Q4_K")
    limit = tensor_core.max_shared_bytes() if is_dynamic else _MAX_SHARED_BYTES
    return max(1, min(_MAX_X_ROWS, (limit - _RESERVED_SHARED_BYTES) // (4 * num_x)))


def _dynamic_stage_bytes(num_floats: int) -> int:
    """The dynamic shared memory a launch staging num_floats of activations passes: 0 where they are static."""
    return 4 * num_floats if 4 * num_floats > _MAX_SHARED_BYTES - _RESERVED_SHARED_BYTES else 0


def _x_row_chunks(num_x_rows: int, per_launch: int):
    """(first, count) of each launch's activation rows: full launches of per_launch rows, then the rest."""
    return [(t0, min(per_launch, num_x_rows - t0)) for t0 in range(0, num_x_rows, per_launch)]


def _loop_call(loop_fn, num_cols: int, num_x: int, num_x_rows: int, is_accumulate: bool):
    """device_loop_call(y, quants, scales, extra, row_begin, row_step, num_rows, words, halves, extra_bytes, xs):
    loop_fn, the C++ loop of one row of x (the source's own exports) or of num_x_rows rows num_x floats apart
    into y [R * num_rows], which takes both strides."""
    ffi = tensor_core.ffi()
    x_stride, accumulate = np.int32(num_x), np.int32(is_accumulate)
    if num_x_rows == 1:
        @cuda.jit(device=True)
        def device_loop_call(y, quants, scales, extra, row_begin, row_step, num_rows, words, halves, extra_bytes, xs):
            loop_fn(ffi.from_buffer(y), ffi.from_buffer(quants), ffi.from_buffer(scales), ffi.from_buffer(extra),
                    row_begin, row_step, num_rows, words, halves, extra_bytes, ffi.from_buffer(xs), num_cols,
                    accumulate)
    else:
        @cuda.jit(device=True)
        def device_loop_call(y, quants, scales, extra, row_begin, row_step, num_rows, words, halves, extra_bytes, xs):
            loop_fn(ffi.from_buffer(y), num_rows, ffi.from_buffer(quants), ffi.from_buffer(scales),
                    ffi.from_buffer(extra), row_begin, row_step, num_rows, words, halves, extra_bytes,
                    ffi.from_buffer(xs), x_stride, num_cols, accumulate)
    return device_loop_call


def _staged_device(red_size: int, xs_size: int):
    """device_staged() -> (red float32 [red_size], xs float32 [xs_size] 16-byte aligned): static shared arrays,
    or where xs is more than static arrays may hold (several rows of a long row of x: a verify step's output
    projection), xs in the dynamic block the launch passes (_dynamic_stage_bytes), so that one launch reads the
    weights for every row. (Numba takes a tuple of arrays a device function made, not one array.)"""
    if not _dynamic_stage_bytes(xs_size):
        @cuda.jit(device=True)
        def device_staged():
            red = cuda.shared.array(red_size, np.float32)
            xs = cuda.shared.array(xs_size, np.float32, alignment=16)
            return red, xs

        return device_staged

    @cuda.jit(device=True)
    def device_dynamic_staged():
        red = cuda.shared.array(red_size, np.float32)
        xs = cuda.shared.array(0, np.float32, alignment=16)
        return red, xs[:xs_size]

    return device_dynamic_staged


@functools.cache
def _gemv_kernel(fmt: str, num_cols: int, config: NativeGemvConfig, has_norm: bool, is_accumulate: bool,
                 num_x_rows: int = 1):
    warps, rows_per_warp, threads = config.warps, config.rows_per_warp, config.threads
    loop_fn = _declare_loop(fmt, rows_per_warp, num_x_rows)
    is_q4_k = fmt == "Q4_K"  # its loop reads the Q4_K layout, with the half sums staged in the padding
    num_x = x_floats(num_cols, is_q4_k)
    stage_rows = _stage_rows_device(num_cols, threads, has_norm, num_x_rows, num_x, is_q4_k)
    xs_size, red_size = num_x * num_x_rows, warps * num_x_rows  # sized here: Numba takes a constant shape
    loop_call = _loop_call(loop_fn, num_cols, num_x, num_x_rows, is_accumulate)
    staged = _staged_device(red_size, xs_size)

    # no launch bounds or register cap: with either (512 threads, 128 registers) the heads measured 4-10%
    # slower on the H200; the loops' registers fit a 512-thread block without (they launch at 16 warps)
    @jit
    def gemv_kernel(quants, scales, extra, words, halves, extra_bytes, x, norm_w, eps, y):  # x [R, K], y [R * N]
        tid = cuda.threadIdx.x
        red, xs = staged()  # xs [R, num_x]: read as float4 by the C++
        stage_rows(x, norm_w, eps, red, xs, tid)
        cuda.syncthreads()
        if is_q4_k:
            for t in range(num_x_rows):
                device_stage_half_sums_at(xs, t * num_x, num_cols // X_GROUP, tid, threads)
            cuda.syncthreads()
        # each warp's row groups, row_step apart: the C++ loads a group's rows while it multiplies the last ones
        row_begin = (cuda.blockIdx.x * warps + tid // _WARP) * rows_per_warp
        loop_call(y, quants, scales, extra, row_begin, cuda.gridDim.x * warps * rows_per_warp, y.shape[0] // num_x_rows,
                  words, halves, extra_bytes, xs)

    return gemv_kernel


def gemv_native(w, x, y, *, norm_weight=None, eps: float = 1e-6, accumulate: bool = False,
                config: NativeGemvConfig = LAYER_CONFIG, stream=0):
    """gemv.gemv's product through the linked C++ rows; the caller validated the inputs and is_supported(w)."""
    return gemv_native_rows(w, x.reshape(1, w.num_cols), y.reshape(1, w.num_rows), norm_weight=norm_weight, eps=eps,
                            accumulate=accumulate, config=config, stream=stream)


def gemv_native_rows(w, x, y, *, norm_weight=None, eps: float = 1e-6, accumulate: bool = False,
                     config: NativeGemvConfig = LAYER_CONFIG, stream=0):
    """gemv.gemv_rows's product through the linked C++ rows: x [R, K], y [R, N]; the caller validated the
    inputs and is_supported(w). Each launch stages max_x_rows(w, is_dynamic=True) rows of x (or the rest) and
    reads W once for them; row t's sums are the C++ loop's for x[t] alone."""
    config = config.validate()
    has_norm = norm_weight is not None
    norm_w = norm_weight if has_norm else stand_in(x, np.float32, 1)
    chunks = _x_row_chunks(x.shape[0], min(config.x_rows or x.shape[0], max_x_rows(w, is_dynamic=True)))
    num_x = x_floats(w.num_cols, w.fmt == "Q4_K")
    for t0, count in chunks:
        # the kernel is the same whatever the grid: one compile for every blocks_per_sm
        kernel = _gemv_kernel(w.fmt, w.num_cols, config._replace(blocks_per_sm=0), has_norm, accumulate, count)
        x_part, y_part = (x, y) if len(chunks) == 1 else (x[t0:t0 + count], y[t0:t0 + count])
        kernel[config.grid(w.num_rows), config.threads, stream, _dynamic_stage_bytes(num_x * count)](
            w.quants, w.scales, w.extra, *_row_strides(w), x_part, norm_w, np.float32(eps),
            y_part.reshape(count * w.num_rows))
    return y


def _rows_call(rows_fn, num_cols: int, num_x: int, num_x_rows: int):
    """device_rows_call(out, quants, scales, extra, row0, count, words, halves, extra_bytes, xs): rows_fn, the C++
    rows of one row of x (the source's own exports) or of num_x_rows rows num_x floats apart, which take the stride."""
    ffi = tensor_core.ffi()
    x_stride = np.int32(num_x)
    if num_x_rows == 1:
        @cuda.jit(device=True)
        def device_rows_call(out, quants, scales, extra, row0, count, words, halves, extra_bytes, xs):
            rows_fn(ffi.from_buffer(out), ffi.from_buffer(quants), ffi.from_buffer(scales), ffi.from_buffer(extra),
                    row0, count, words, halves, extra_bytes, ffi.from_buffer(xs), num_cols)
    else:
        @cuda.jit(device=True)
        def device_rows_call(out, quants, scales, extra, row0, count, words, halves, extra_bytes, xs):
            rows_fn(ffi.from_buffer(out), ffi.from_buffer(quants), ffi.from_buffer(scales), ffi.from_buffer(extra),
                    row0, count, words, halves, extra_bytes, ffi.from_buffer(xs), x_stride, num_cols)
    return device_rows_call


@functools.cache
def _gemv3_kernel(fmts: tuple, num_cols: int, config: NativeGemvConfig, has_norm: bool, num_x_rows: int = 1):
    warps, rows_per_warp, threads = config.warps, config.rows_per_warp, config.threads
    instances = _rows_instances(fmts, rows_per_warp, num_x_rows)  # one linked object for the three
    rows_a, rows_b, rows_c = (_declare_rows(f, rows_per_warp, num_x_rows, instances) for f in fmts)
    num_x = x_floats(num_cols)
    stage_rows = _stage_rows_device(num_cols, threads, has_norm, num_x_rows, num_x)
    xs_size, out_size = num_x * num_x_rows, rows_per_warp * num_x_rows
    red_size = warps * num_x_rows  # sized here: Numba takes a constant shape
    rows_a_call, rows_b_call, rows_c_call = (_rows_call(fn, num_cols, num_x, num_x_rows)
                                             for fn in (rows_a, rows_b, rows_c))

    @jit
    def gemv3_kernel(qa, sa, ea, wa, ha, xa, qb, sb, eb, wb, hb, xb, qc, sc, ec, wc, hc, xc, x, norm_w, eps, blocks_a,
                     blocks_b, ya, yb, yc):  # w*, h*, x*: words, halves and extra bytes per row of each matrix
        tid = cuda.threadIdx.x  # x [R, K], y* [R, N*]
        red = cuda.shared.array(red_size, np.float32)
        xs = cuda.shared.array(xs_size, np.float32, alignment=16)  # [R, num_x]: read as float4 by the C++
        stage_rows(x, norm_w, eps, red, xs, tid)
        cuda.syncthreads()
        lane = tid % _WARP
        block = cuda.blockIdx.x
        segment = 0 if block < blocks_a else (1 if block < blocks_a + blocks_b else 2)
        first = 0 if segment == 0 else (blocks_a if segment == 1 else blocks_a + blocks_b)
        row0 = ((block - first) * warps + tid // _WARP) * rows_per_warp
        num_rows = ya.shape[1] if segment == 0 else (yb.shape[1] if segment == 1 else yc.shape[1])
        if row0 < num_rows:
            out = cuda.local.array(out_size, np.float32)  # [R, rows_per_warp]
            count = min(rows_per_warp, num_rows - row0)
            if segment == 0:
                rows_a_call(out, qa, sa, ea, row0, count, wa, ha, xa, xs)
            elif segment == 1:
                rows_b_call(out, qb, sb, eb, row0, count, wb, hb, xb, xs)
            else:
                rows_c_call(out, qc, sc, ec, row0, count, wc, hc, xc, xs)
            for t in range(num_x_rows):
                for r in range(rows_per_warp):
                    if lane == r and r < count:
                        if segment == 0:
                            ya[t, row0 + r] = out[t * rows_per_warp + r]
                        elif segment == 1:
                            yb[t, row0 + r] = out[t * rows_per_warp + r]
                        else:
                            yc[t, row0 + r] = out[t * rows_per_warp + r]

    return gemv3_kernel


def gemv_multi_native(ws: tuple, x, ys: tuple, *, norm_weight=None, eps: float = 1e-6,
                      config: NativeGemvConfig = NativeGemvConfig(), stream=0):
    """gemv_multi's 2 or 3 products through the linked C++ rows: x [R, K], ys [R, N_i]; the caller validated
    the inputs. Each launch stages as many rows of x as fit (max_x_rows) and reads each matrix once for them."""
    config = config.validate()
    has_norm = norm_weight is not None
    num_cols = ws[0].num_cols
    rows_per_block = config.warps * config.rows_per_warp
    num_outputs = len(ys)
    blocks = [ceil_div(w.num_rows, rows_per_block) for w in ws] + [0]
    if len(ws) == 2:  # the third matrix's segment gets no blocks
        ws, ys = (*ws, ws[1]), (*ys, stand_in(ys[1], np.float32, 2))
    norm_w = norm_weight if has_norm else stand_in(x, np.float32, 1)
    planes = [a for w in ws for a in (w.quants, w.scales, w.extra, *_row_strides(w))]
    if sum(blocks):
        for t0, count in _x_row_chunks(x.shape[0], max_x_rows(ws[0])):
            kernel = _gemv3_kernel(tuple(w.fmt for w in ws), num_cols, config, has_norm, count)
            outs = [y[t0:t0 + count] for y in ys[:num_outputs]] + list(ys[num_outputs:])  # the stand-in whole
            kernel[sum(blocks[:3]), config.threads, stream](*planes, x[t0:t0 + count], norm_w, np.float32(eps),
                                                            blocks[0], blocks[1], *outs)
    return ys[:num_outputs]


def _declare_pair_loop(fmt: str):
    return tensor_core.declare(
        f"strata_pair_loop_{_suffix(fmt)}",
        (tensor_core.FLOAT_PTR, *_PLANES, *_PLANES, tensor_core.INT32, *_STRIDES, _I32_PTR, tensor_core.INT32,
         tensor_core.INT32, tensor_core.INT32, tensor_core.INT32, tensor_core.FLOAT_PTR, tensor_core.INT32),
        "gemv_rows.cu")


def _declare_down_loop(fmt: str):
    return tensor_core.declare(
        f"strata_down_loop_{_suffix(fmt)}",
        (tensor_core.FLOAT_PTR, *_PLANES, tensor_core.INT32, *_STRIDES, _I32_PTR, tensor_core.FLOAT_PTR,
         tensor_core.INT32, tensor_core.INT32, tensor_core.INT32, tensor_core.INT32, tensor_core.FLOAT_PTR,
         tensor_core.INT32, tensor_core.INT32),
        "gemv_rows.cu")


class ExpertsConfig(NamedTuple):
    """Launch shape of a decode step's routed experts: gate/up blocks of `warps` warps, down blocks of
    `down_warps`, each block one token's. blocks_per_sm 0: a warp a row (gate/up: a row pair of one expert;
    down: an output row over all k experts); else at most blocks_per_sm * SMs blocks for all tokens together,
    each warp going on to further rows, loading the next row's quants while it multiplies the last (so that a
    block stages and norms its activations once for many rows, and one wave of blocks covers the launch)."""
    warps: int = 8
    down_warps: int = 8
    blocks_per_sm: int = 3
    # a cap on each thread's registers (0: none, the compiler's choice). Uncapped, the Q4_0 kernels hold 67-72, so
    # 3 blocks of 8 warps fit an SM of the H100 (37.5% occupancy); caps of 64 to 40 spill and were slower in every
    # shape measured (docs/performance-log.md, 2026-12-06): for the sweep in strata.bench.variants
    max_registers: int = 0

    def validate(self) -> "ExpertsConfig":
        # at most 8 warps: a loop holds two steps' items in registers, and a K-quant's (Q6_K) need more than
        # 512 threads may have (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES on the H200 with 16 warps)
        for name, value in (("warps", self.warps), ("down_warps", self.down_warps)):
            if value not in (1, 2, 4, 8):
                raise ValueError(f"{name} must be one of 1, 2, 4, 8, got {value}")
        if self.blocks_per_sm < 0:
            raise ValueError(f"blocks_per_sm must be 0 (a warp a row) or positive, got {self.blocks_per_sm}")
        if self.max_registers and not _MIN_REGISTERS <= self.max_registers <= _MAX_REGISTERS:
            raise ValueError(f"max_registers must be 0 (no cap) or in [{_MIN_REGISTERS}, {_MAX_REGISTERS}], got "
                             f"{self.max_registers}")
        return self

    def blocks_per_token(self, num_rows: int, warps: int, num_tokens: int) -> int:
        """Blocks of one token's num_rows rows."""
        blocks = ceil_div(num_rows, warps)
        if self.blocks_per_sm:
            blocks = min(blocks, max(1, ceil_div(self.blocks_per_sm * _num_sms(), num_tokens)))
        return blocks


# Measured on the H200 (graph-timed, top-8 of 128 Q4_0 experts; docs/PERFORMANCE.md, 2026-12-05): one token 20.2 us
# in every shape within ~1.5 us (latency, not waves), a verify step's five 70.8 us against 87.4 for a warp a row, and
# 65.7 at most 6 blocks an SM. On the H100 (2026-12-06, three sweeps): one wave of blocks (3 an SM, as many as its
# registers let an SM hold) is the fastest for one to three tokens, 16.6-17.2 and 36.4-36.8 us against 17.6-18.3 and
# 38.8-39.2 at 4 and 6 an SM; five tokens take two waves (6 an SM: 59.2-59.3 us against 68.8-69.3 at 3)
EXPERTS_CONFIG = ExpertsConfig()
EXPERTS_ROWS_CONFIG = ExpertsConfig(blocks_per_sm=6)
_ONE_WAVE_TOKENS = 3


def experts_config(num_tokens: int) -> ExpertsConfig:
    """The launch shape of num_tokens tokens' routed experts (the grid only: one compiled kernel for both)."""
    return EXPERTS_CONFIG if num_tokens <= _ONE_WAVE_TOKENS else EXPERTS_ROWS_CONFIG


@functools.cache
def _expert_kernels(fmt_gate_up: str, fmt_down: str, dim: int, ffn: int, top_k: int, warps: int, down_warps: int,
                    has_norm: bool, max_registers: int = 0):
    threads, down_threads = warps * _WARP, down_warps * _WARP
    pair_fn, down_fn = _declare_pair_loop(fmt_gate_up), _declare_down_loop(fmt_down)
    options = register_options(max_registers)
    ffi = tensor_core.ffi()
    num_x, hidden_stride = x_floats(dim), x_floats(ffn)
    stage_x = _stage_rows_device(dim, threads, has_norm, 1, num_x)
    stage_hidden = _stage_rows_device(ffn, down_threads, False, top_k, hidden_stride)  # the token's k rows at once
    num_hidden_x = top_k * hidden_stride

    @jit(**options)
    def gate_up_kernel(x, norm_w, eps, ids, gq, gs, ge, uq, us, ue, words, halves, extra_bytes, num_slots, hidden):
        tid = cuda.threadIdx.x  # grid (B, T): warp w of block (b, t), token t's rows b * warps + w + i * B * warps
        red = cuda.shared.array(warps, np.float32)
        xs = cuda.shared.array(num_x, np.float32, alignment=16)  # read as float4 by the C++
        token = cuda.blockIdx.y
        stage_x(x[token:token + 1], norm_w, eps, red, xs, tid)
        cuda.syncthreads()
        pair_fn(ffi.from_buffer(hidden[token * top_k]), ffi.from_buffer(gq), ffi.from_buffer(gs), ffi.from_buffer(ge),
                ffi.from_buffer(uq), ffi.from_buffer(us), ffi.from_buffer(ue), num_slots, words, halves, extra_bytes,
                ffi.from_buffer(ids[token]), top_k, ffn, cuda.blockIdx.x * warps + tid // _WARP,
                cuda.gridDim.x * warps, ffi.from_buffer(xs), dim)

    @jit(**options)
    def down_kernel(hidden, ids, weights, dq, ds, de, words, halves, extra_bytes, num_slots, out):  # out [T, H] +=
        tid = cuda.threadIdx.x
        xs = cuda.shared.array(num_hidden_x, np.float32, alignment=16)
        token = cuda.blockIdx.y
        stage_hidden(hidden[token * top_k:(token + 1) * top_k], hidden[0], np.float32(0.0), xs, xs, tid)
        cuda.syncthreads()
        down_fn(ffi.from_buffer(out[token]), ffi.from_buffer(dq), ffi.from_buffer(ds), ffi.from_buffer(de), num_slots,
                words, halves, extra_bytes, ffi.from_buffer(ids[token]), ffi.from_buffer(weights[token]), top_k,
                cuda.blockIdx.x * down_warps + tid // _WARP, cuda.gridDim.x * down_warps, dim, ffi.from_buffer(xs),
                hidden_stride, ffn)

    return gate_up_kernel, down_kernel


def experts_supported(gate, up, down, top_k: int) -> bool:
    """True when moe_experts_native can run these expert stacks (gate and up of one format)."""
    return (gate.fmt == up.fmt and gate.fmt in EXPERT_FORMATS and down.fmt in EXPERT_FORMATS
            and is_supported(gate) and is_supported(up) and is_supported(down, top_k)
            and _row_strides(gate) == _row_strides(up))


def moe_experts_native(x, ids, weights, gate, up, down, out, hidden, *, norm_weight=None, eps: float = 1e-6,
                       config: ExpertsConfig | None = None, stream=0):
    """moe.moe_experts_decode's products through the linked C++ rows; the caller validated the inputs
    and experts_supported(gate, up, down, top_k). A row's sums are the same whatever the config (default:
    ``experts_config``)."""
    num_tokens, dim = x.shape
    config = (experts_config(num_tokens) if config is None else config).validate()
    top_k = ids.shape[1]
    ffn = hidden.shape[1]
    has_norm = norm_weight is not None
    gate_up_kernel, down_kernel = _expert_kernels(gate.fmt, down.fmt, dim, ffn, top_k, config.warps,
                                                  config.down_warps, has_norm, config.max_registers)
    num_slots = np.int32(gate.num_rows // ffn)
    norm_w = norm_weight if has_norm else stand_in(x, np.float32, 1)
    gate_up_blocks = config.blocks_per_token(top_k * ffn, config.warps, num_tokens)
    gate_up_kernel[(gate_up_blocks, num_tokens), config.warps * _WARP, stream](
        x, norm_w, np.float32(eps), ids, gate.quants, gate.scales, gate.extra, up.quants, up.scales, up.extra,
        *_row_strides(gate), num_slots, hidden)
    down_blocks = config.blocks_per_token(dim, config.down_warps, num_tokens)
    down_kernel[(down_blocks, num_tokens), config.down_warps * _WARP, stream](
        hidden, ids, weights, down.quants, down.scales, down.extra, *_row_strides(down), num_slots, out)
    return out
