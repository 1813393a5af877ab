"""Attention of one decode token on tensor cores: attention_mma.py's KV loop over one KV split.

A block owns one KV head's GQA group for one split of the KV range. Its query rows are the group's
heads (8 for Qwen3-30B-A3B), padded with rows that see no key: on a GPU with tensor cores the
block is 4 warps running the C++ fused loop (cuda/attention_mma.cu), which all stage the K/V
tiles (dequantized to f16, double-buffered) while the warp holding real rows multiplies them
with mma.m16n8k16; the padding warps skip their products. In the simulator the same block runs
the per-tile Numba twin with as few warps as the group needs. Either way Q, K, V and P are
rounded to f16 and products accumulate in f32, as in prefill.

attention_decode.py's FFMA kernel spends a multiply-add and a shared-memory load of q per key
element and query head; here a 16 x 8 x 16 product does 2,048 of them in one instruction.

Splits write the unnormalized partials (O, m, l) attention.py's combine reduces (m converted
from the loop's base-2 units); one split writes the normalized output. Each split covers whole
KV tiles from its start, so keys a tile holds past the split's end belong to the next split or
lie past the position, where the causal mask drops them.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from . import tensor_core
from .attention_mma import (
    CPP_HEAD_DIMS, LOG2_E, ROW_PAD_HALVES, ROWS_PER_WARP, _block_rows, _kv_loop, default_kv_tile, fused_buffer_size, fused_loop,
    shared_bytes, state_size,
)
from ._common import IS_SIMULATOR, OCTET, ceil_div
from .kvcache import KV_FORMATS

FUSED_WARPS = 4  # every warp stages; only the first ceil(group / 16) multiply
FUSED_STAGES = 2
LN_2 = np.float32(math.log(2.0))


def is_supported(head_dim: int, group: int, fmt: str) -> bool:
    """Whether this kernel serves a one-token call: a head dim the C++ loop exports, a group of at
    most the fused block's rows, a tensor-core GPU (or the simulator, which runs the twin)."""
    return head_dim in CPP_HEAD_DIMS and fmt in KV_FORMATS and 0 < group <= FUSED_WARPS * ROWS_PER_WARP and \
        (tensor_core.is_available() or IS_SIMULATOR)


def launch_shape(head_dim: int, group: int, is_twin: bool) -> tuple:
    """(warps, kv_tile) of a block."""
    if is_twin:
        warps = ceil_div(group, ROWS_PER_WARP)
        return warps, default_kv_tile(head_dim, True, warps)
    return FUSED_WARPS, default_kv_tile(head_dim, False, FUSED_WARPS, True, FUSED_STAGES)


@functools.cache
def decode_kernel(fmt: str, head_dim: int, group: int, is_split: bool, is_twin: bool):
    """Arguments as attention_decode.decode_kernel's (scale the softmax scale); launch grid (1,
    num_kv_heads, num_splits), 32 * launch_shape()[0] threads."""
    warps, kv_tile = launch_shape(head_dim, group, is_twin)
    rows = warps * ROWS_PER_WARP
    num_state = state_size(head_dim)
    m_off = head_dim // 2
    stage_q, _, write_out = _block_rows(head_dim, group, warps)
    attend = (_twin_attend if is_twin else _fused_attend)(fmt, head_dim, kv_tile, warps, stage_q)

    @cuda.jit(device=True)
    def split_range(q_positions, kv_len, split_len):
        """Keys begin .. end - 1 of this block's split: whole tiles from its start."""
        span = min(kv_len, q_positions[0] + 1)
        split_rows = split_len
        if split_rows == 0:  # from the position on the device: a captured step replays at any position
            split_rows = (span + cuda.gridDim.z - 1) // cuda.gridDim.z
        split_rows = (split_rows + kv_tile - 1) // kv_tile * kv_tile
        begin = cuda.blockIdx.z * split_rows
        return begin, min(begin + split_rows, span)

    @cuda.jit(device=True)
    def write_partial(state, kvh, split, o_part, m_part, l_part):
        warp = cuda.threadIdx.x // 32
        g = cuda.threadIdx.x % 32 // 4
        tq = cuda.threadIdx.x % 4
        for h in range(2):
            row = warp * ROWS_PER_WARP + g + 8 * h  # the row's query head within the group
            if row < group:
                head = kvh * group + row
                for n in range(head_dim // OCTET):
                    for e in range(2):
                        o_part[split, 0, head, OCTET * n + 2 * tq + e] = state[4 * n + 2 * h + e]
                if tq == 0:
                    m_part[split, 0, head] = state[m_off + h] * LN_2  # the combine's natural-log units
                    l_part[split, 0, head] = state[m_off + 2 + h]

    @cuda.jit
    def kernel(q, k_quants, k_scales, k_extra, v_quants, v_scales, v_extra, q_positions, kv_len, split_len, scale,
               out, o_part, m_part, l_part):
        kvh = cuda.blockIdx.y
        state = cuda.local.array(num_state, np.float32)
        row_last = cuda.shared.array(rows, np.int32)
        begin, end = split_range(q_positions, kv_len, split_len)
        attend(q, scale * np.float32(LOG2_E), kvh, q_positions, kv_len, row_last, state, k_quants, k_scales, k_extra,
               v_quants, v_scales, v_extra, begin, end)
        if is_split:
            write_partial(state, kvh, cuda.blockIdx.z, o_part, m_part, l_part)
        else:
            write_out(state, kvh, 0, out)

    return kernel


def _twin_attend(fmt: str, head_dim: int, kv_tile: int, warps: int, stage_q):
    """attend(q, q_scale, kvh, q_positions, kv_len, row_last, state, <six cache planes>, begin, end): the
    block's rows staged, then the per-tile Numba loop over keys begin .. end - 1 into state."""
    kv_loop = _kv_loop(fmt, head_dim, kv_tile, True, warps)
    stride = head_dim + ROW_PAD_HALVES
    rows = warps * ROWS_PER_WARP
    q_size, kv_size, scores_size = rows * stride, kv_tile * stride, rows * kv_tile

    @cuda.jit(device=True)
    def attend(q, q_scale, kvh, q_positions, kv_len, row_last, state, k_quants, k_scales, k_extra, v_quants, v_scales,
               v_extra, begin, end):
        qs = cuda.shared.array(q_size, np.float16)  # [rows, stride]
        ks = cuda.shared.array(kv_size, np.float16)  # [kv_tile, stride]
        vs = cuda.shared.array(kv_size, np.float16)
        scores = cuda.shared.array(scores_size, np.float32)  # [rows, kv_tile]
        wl = cuda.local.array(OCTET, np.float32)
        stage_q(q, q_scale, kvh, 0, q_positions, kv_len, qs, row_last)
        cuda.syncthreads()
        kv_loop(qs, ks, vs, row_last, scores, state, wl, k_quants, k_scales, k_extra, v_quants, v_scales, v_extra,
                kvh, begin, end)

    return attend


def _fused_attend(fmt: str, head_dim: int, kv_tile: int, warps: int, stage_q):
    """As _twin_attend, through the C++ fused loop (GPU only)."""
    loop = fused_loop(fmt, head_dim, kv_tile, warps, FUSED_STAGES)
    ffi = tensor_core.ffi()
    buf_size = fused_buffer_size(head_dim, kv_tile, warps, FUSED_STAGES)

    @cuda.jit(device=True)
    def attend(q, q_scale, kvh, q_positions, kv_len, row_last, state, k_quants, k_scales, k_extra, v_quants, v_scales,
               v_extra, begin, end):
        buf = cuda.shared.array(buf_size, np.float16, alignment=16)  # 16-byte copies and ldmatrix
        stage_q(q, q_scale, kvh, 0, q_positions, kv_len, buf, row_last)
        cuda.syncthreads()
        loop(ffi.from_buffer(buf), ffi.from_buffer(row_last), np.int32(begin), np.int32(end), ffi.from_buffer(k_quants),
             ffi.from_buffer(k_scales), ffi.from_buffer(v_quants), ffi.from_buffer(v_scales),
             np.int32(k_quants.shape[1]), np.int32(k_scales.shape[1]), np.int32(kvh * head_dim),
             ffi.from_buffer(state))

    return attend


def threads(head_dim: int, group: int, is_twin: bool) -> int:
    return 32 * launch_shape(head_dim, group, is_twin)[0]


def num_shared_bytes(head_dim: int, group: int, is_twin: bool) -> int:
    warps, kv_tile = launch_shape(head_dim, group, is_twin)
    return shared_bytes(head_dim, kv_tile, is_twin, warps, not is_twin, FUSED_STAGES)
