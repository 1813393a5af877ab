"""MoE prefill expert products for chunks of few routed rows an expert (cuda/moe_rows.cu; GPU only).

moe.py's tiles put the routed tokens on the mma's M (16 rows a fragment) and stage each tile's
dequantized weights in shared memory; at 32 rows an expert (512 tokens routed top-8 of 128 experts)
half of a 64-row tile is padding, and the staging of the weights is most of the loop. Here the roles
swap: a block's warps each own 16 weight rows and run them against all the tokens of the tile, 8 at
a time (the mma's N), so a tile of up to TILE_ROWS tokens pays for whole 8-token groups only; each
weight element is dequantized once a tile, from a cp.async ring of raw quant blocks (the packed planes
as packing.py lays them out) straight into A fragments in registers. The tile's number of 8-token
groups picks one of eight compiled loops (a switch on the tile's rows), so a tile of 32 tokens runs
exactly 4 groups' mma and holds their accumulators only. Gate and up take one format, down its own
(each of FORMATS: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS, every one GPU-tested on the reference H200);
other experts take moe.py's tiles.

Same contract and numerics as moe_prefill_launches' tensor-core path (f16 X and hidden, weights the
f16 roundings of gguf-py's float32 values: d * (q - 8), d * q, d * sc * q - dmin * m (Q4_K, Q5_K),
d * sc * (q - 32) (Q6_K), d * (ls - 32) * level (IQ4_XS), d * (0.5 + ls) * 0.5 * magnitude, signed (IQ3_XXS);
f32 sums): the
two agree up to summation order (and both give Inf where silu(gate) * up passes float16's 65,504,
then NaN or Inf in out). The kernels read X, and gate/up writes hidden, with each aligned quad
of columns in the order (0, 2, 1, 3) (stage_x): that is the K order in which one mask of a quant word
yields a pair of weights.

Launch config: gate_up grid (ceil(F / BLOCK_COLS), max_tiles), down grid (ceil(H / DOWN_BLOCK_COLS),
max_tiles), blocks of THREADS threads with shared_bytes(format) of static shared memory (both launches
stage two 64-row weights: gate and up, or two halves of down's 128 rows); blocks of tiles beyond
num_tiles, or whose expert is not in the batch, exit at once.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from . import tensor_core
from ._common import (
    IS_SIMULATOR,
    ceil_div,
    check_array,
    empty,
    is_c_contiguous,
    is_device_array,
)
from .launcher import jit
from .moe_route import MoeGroups, tile_slot_device

# each a template argument of cuda/moe_rows.cu (kRows<..>)
BUILT_FORMATS = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS")
# the formats a chunk's experts are sent through these kernels in: those whose GPU tests passed on the H200
FORMATS = BUILT_FORMATS
TILE_ROWS = 64  # the groups' block_m: the tokens of a tile, 8 groups of 8
BLOCK_COLS = 64  # gate/up: weight rows of a block (of gate and of up), 4 warps of 16
DOWN_BLOCK_COLS = 128  # down: two 64-row halves, each warp 16 rows of both
THREADS = 128
STEP_K = 64  # K staged a step: both dims must be multiples of it
_ALIGN_BYTES = 16  # cp.async copies 16 bytes of quants (and 4 of scales and scale bytes) at a time
_MAX_REGISTERS = 128  # 4 blocks of THREADS an SM: the register file is 64 K registers
# cuda/moe_rows.cu's Stage<F>: (stages, a weight row's quant bytes a step, its scale bytes a step)
_STAGE_SHAPES = {"Q4_0": (3, STEP_K // 2, 4), "Q8_0": (2, STEP_K, 4), "Q4_K": (3, STEP_K // 2, 16),
                 "Q5_K": (2, STEP_K, 16), "Q6_K": (2, STEP_K, 16), "IQ4_XS": (3, STEP_K // 2, 16),
                 "IQ3_XXS": (3, STEP_K // 2, 4)}
_RECORD_FORMATS = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # a record a row and step: scales and the extra plane's bytes
_LONE_D_FORMATS = ("Q6_K", "IQ4_XS", "IQ3_XXS")  # one f16 d a super-block: read in the aligned word that holds it
_ODD_EXTRA_FORMATS = ("IQ4_XS",)  # 6 scale bytes a super-block: read in the two aligned words that hold them


def shared_bytes(fmt: str = "Q4_0") -> int:
    """A block's shared memory for weights of ``fmt`` (cuda/moe_rows.cu's Stage<F>: both launches stage two
    64-row weights): a stage holds X, then the two weights' raw quant bytes (Q5_K, Q6_K: their nibbles and high
    bits), then their scales (K-quants: a 16-byte record of the super-block a row)."""
    stages, row_bytes, scale_bytes = _STAGE_SHAPES[fmt]
    x_stage = 2 * TILE_ROWS * STEP_K
    return stages * (x_stage + 2 * BLOCK_COLS * (row_bytes + scale_bytes))


@jit
def _stage_x_kernel(x, out):  # one thread an aligned quad of columns: out [T, H] f16 = x's, quads as (0, 2, 1, 3)
    i = cuda.grid(1)
    num_quads = x.shape[1] // 4
    if i < x.shape[0] * num_quads:
        row, c = i // num_quads, 4 * (i % num_quads)
        out[row, c] = np.float16(x[row, c])
        out[row, c + 1] = np.float16(x[row, c + 2])
        out[row, c + 2] = np.float16(x[row, c + 1])
        out[row, c + 3] = np.float16(x[row, c + 3])


def stage_x(x, out=None, *, threads: int = 256):
    """x [T, H] (float32 or float16, H a multiple of 4) as these kernels read it: float16 (round to nearest
    even), each aligned quad of columns in the order (0, 2, 1, 3).

    Launch config: grid ceil(T * H / 4 / threads), block `threads`; one quad per thread.
    """
    check_array("x", x, dtypes=(np.float32, np.float16), ndim=2)
    if x.shape[1] % 4:
        raise ValueError(f"x has {x.shape[1]} columns: stage_x permutes aligned quads, so it needs a multiple of 4")
    if out is None:
        out = empty(tuple(x.shape), np.float16, x)
    check_array("out", out, dtypes=np.float16, shape=tuple(x.shape))
    num_quads = x.shape[0] * x.shape[1] // 4
    if num_quads:
        _stage_x_kernel[ceil_div(num_quads, threads), threads](x, out)
    return out


def _is_aligned(w) -> bool:
    """The planes' rows as cp.async reads them: quants in 16-byte chunks, scales (and the K-quants' scale bytes) in
    4-byte words (Q6_K's, IQ4_XS's and IQ3_XXS's one f16 d a super-block in the aligned word that holds it, so their
    rows take any pitch; IQ4_XS's 6 scale bytes a super-block in the two aligned words that hold them, so its rows
    take any even pitch); a plane's row pitch may be wider than its format's (an expert cache of mixed types)."""
    is_extra_read = w.fmt in _RECORD_FORMATS
    extra_multiple = 2 if w.fmt in _ODD_EXTRA_FORMATS else 4
    return (is_device_array(w.quants) and is_c_contiguous(w.quants) and is_c_contiguous(w.scales)
            and w.quants.device_ctypes_pointer.value % _ALIGN_BYTES == 0
            and w.quants.shape[1] * 4 % _ALIGN_BYTES == 0
            and w.scales.device_ctypes_pointer.value % 4 == 0
            and (w.fmt in _LONE_D_FORMATS or w.scales.shape[1] % 2 == 0)
            and (not is_extra_read or (is_c_contiguous(w.extra) and w.extra.device_ctypes_pointer.value % 4 == 0
                                       and w.extra.shape[1] % extra_multiple == 0)))


def serves(fmts: tuple, dim: int, ffn: int) -> bool:
    """True when these kernels run experts of these formats (gate, up, down) and sizes, given groups of
    TILE_ROWS pairs and aligned planes: a GPU with tensor cores, gate and up of one format and down of one, each
    of FORMATS, hidden and FFN sizes multiples of STEP_K (the K-quants' rows are whole 256-element blocks
    anyway)."""
    return (tensor_core.is_available() and len(fmts) == 3 and all(fmt in FORMATS for fmt in fmts)
            and fmts[0] == fmts[1] and dim > 0 and ffn > 0 and dim % STEP_K == 0 and ffn % STEP_K == 0)


def is_supported(groups: MoeGroups, gate, up, down) -> bool:
    """True when these kernels can run the chunk: serves() its experts, groups of TILE_ROWS pairs, X and
    hidden indexed in 32 bits (the kernels' row offsets are int), gate's and up's planes of one pitch, and
    the planes aligned for cp.async."""
    num_pairs = groups.pair_token.shape[0]  # X has at most as many rows, hidden as many
    is_one_pitch = all(getattr(gate, p).shape[1] == getattr(up, p).shape[1] for p in ("quants", "scales", "extra"))
    return (groups.block_m == TILE_ROWS and serves((gate.fmt, up.fmt, down.fmt), gate.num_cols, down.num_cols)
            and num_pairs * max(gate.num_cols, down.num_cols) < 2**31 and is_one_pitch
            and all(_is_aligned(w) for w in (gate, up, down)))


def instance(launch: str, fmt: str) -> str:
    """The text appended to cuda/moe_rows.cu that exports its ``launch`` ("gate_up", "down" or "down_fixed": into
    fixed-point sums) for ``fmt`` as strata_moe_rows_<launch>_<fmt>: a kernel links that instantiation only, not
    every format's."""
    return f"STRATA_MOE_ROWS_{launch.upper()}({fmt.lower()}, kRows{fmt})\n"


_U32_PTR, _U8_PTR, _I32_PTR = types.CPointer(types.uint32), types.CPointer(types.uint8), types.CPointer(types.int32)
_I64_PTR = types.CPointer(types.int64)
_I32, _HALF, _FLOAT = tensor_core.INT32, tensor_core.HALF_PTR, tensor_core.FLOAT_PTR


@functools.cache
def _gate_up_kernel(fmt: str, is_mapped: bool):
    fn = tensor_core.declare(f"strata_moe_rows_gate_up_{fmt.lower()}",
                             (_HALF, _I32, _I32, _I32_PTR, _I32, _I32, _U32_PTR, _HALF, _U8_PTR, _U32_PTR, _HALF,
                              _U8_PTR, _I32, _I32, _I32, _I32, _I32, _HALF, _I32, _I32, _U8_PTR), "moe_rows.cu",
                             instance("gate_up", fmt))
    ffi, tile_slot, num_bytes = tensor_core.ffi(), tile_slot_device(is_mapped), shared_bytes(fmt)

    @jit
    def gate_up_kernel(x, gq, gs, ge, uq, us, ue, pair_token, tile_expert, tile_start, tile_rows, num_tiles,
                       slot_of_expert, hidden):
        tile = cuda.blockIdx.y
        expert = tile_slot(tile_expert, num_tiles, slot_of_expert, tile)
        if expert < 0:  # past the tiles in use, or not in this batch (another launch of the grouping has it)
            return
        smem = cuda.shared.array(num_bytes, np.uint8, alignment=16)
        ffn = hidden.shape[1]
        col0 = cuda.blockIdx.x * BLOCK_COLS
        fn(ffi.from_buffer(x), np.int32(x.shape[1]), np.int32(x.shape[1] // 32), ffi.from_buffer(pair_token),
           tile_start[tile], tile_rows[tile], ffi.from_buffer(gq), ffi.from_buffer(gs), ffi.from_buffer(ge),
           ffi.from_buffer(uq), ffi.from_buffer(us), ffi.from_buffer(ue), np.int32(gq.shape[1]),
           np.int32(gs.shape[1]), np.int32(ge.shape[1]), np.int32(expert * ffn + col0), np.int32(expert * ffn + ffn),
           ffi.from_buffer(hidden), np.int32(ffn), np.int32(col0), ffi.from_buffer(smem))

    return gate_up_kernel


@functools.cache
def _down_kernel(fmt: str, is_mapped: bool, is_fixed: bool = False):
    """is_fixed: out is int64 fixed-point sums (fixed_sums.py), not the float32 residual."""
    launch = "down_fixed" if is_fixed else "down"
    fn = tensor_core.declare(f"strata_moe_rows_{launch}_{fmt.lower()}",
                             (_HALF, _I32, _I32, _I32_PTR, _FLOAT, _I32, _I32, _U32_PTR, _HALF, _U8_PTR, _I32, _I32,
                              _I32, _I32, _I32, _I64_PTR if is_fixed else _FLOAT, _I32, _I32, _U8_PTR), "moe_rows.cu",
                             instance(launch, fmt))
    ffi, tile_slot, num_bytes = tensor_core.ffi(), tile_slot_device(is_mapped), shared_bytes(fmt)

    # at 129 registers (as built without a cap) an SM holds 3 of these blocks, at 128 four; only GPU builds
    # take the cap (the simulator's jit has no such option, and never runs these kernels)
    @jit(**({} if IS_SIMULATOR else {"max_registers": _MAX_REGISTERS}))
    def down_kernel(hidden, dq, ds, de, pair_token, pair_weight, tile_expert, tile_start, tile_rows, num_tiles,
                    slot_of_expert, out):
        tile = cuda.blockIdx.y
        expert = tile_slot(tile_expert, num_tiles, slot_of_expert, tile)
        if expert < 0:  # past the tiles in use, or not in this batch (another launch of the grouping has it)
            return
        smem = cuda.shared.array(num_bytes, np.uint8, alignment=16)
        dim = out.shape[1]
        col0 = cuda.blockIdx.x * DOWN_BLOCK_COLS
        fn(ffi.from_buffer(hidden), np.int32(hidden.shape[1]), np.int32(hidden.shape[1] // 32),
           ffi.from_buffer(pair_token), ffi.from_buffer(pair_weight), tile_start[tile], tile_rows[tile],
           ffi.from_buffer(dq), ffi.from_buffer(ds), ffi.from_buffer(de), np.int32(dq.shape[1]),
           np.int32(ds.shape[1]), np.int32(de.shape[1]), np.int32(expert * dim + col0), np.int32(expert * dim + dim),
           ffi.from_buffer(out), np.int32(dim), np.int32(col0), ffi.from_buffer(smem))

    return down_kernel


def rows_launches(x, groups: MoeGroups, gate, up, down, out, hidden, table, is_mapped: bool):
    """The (gate_up, down) launches of moe.moe_prefill_launches on these kernels; the caller checked the
    arguments and is_supported(groups, gate, up, down). x [T, H] float16 from stage_x, hidden [P, F] float16
    (its columns in stage_x's order); table: the slot of each expert (is_mapped), else a stand-in; out [T, H]
    float32, or int64 fixed-point sums (fixed_sums.py)."""
    ffn, dim = hidden.shape[1], out.shape[1]
    gate_up_kernel = _gate_up_kernel(gate.fmt, is_mapped)
    down_kernel = _down_kernel(down.fmt, is_mapped, out.dtype == np.int64)
    tiles = (groups.tile_expert, groups.tile_start, groups.tile_rows, groups.num_tiles, table)

    def launch_gate_up():
        gate_up_kernel[(ceil_div(ffn, BLOCK_COLS), groups.max_tiles), THREADS](
            x, gate.quants, gate.scales, gate.extra, up.quants, up.scales, up.extra, groups.pair_token, *tiles,
            hidden)

    def launch_down():
        down_kernel[(ceil_div(dim, DOWN_BLOCK_COLS), groups.max_tiles), THREADS](
            hidden, down.quants, down.scales, down.extra, groups.pair_token, groups.pair_weight, *tiles, out)

    return launch_gate_up, launch_down
