"""Attention of one decode token on tensor cores: attention_mma.py's KV loop over one KV split.

A block owns one KV head's GQA group for one split of the KV range. Its query rows are the group's
heads (8 for Qwen3-30B-A3B), padded with rows that see no key: on a GPU with tensor cores the
block is 4 warps running the C++ fused loop (cuda/attention_mma.cu), which all stage the K/V
tiles (dequantized to f16, double-buffered) while the warps holding real rows multiply them
with mma.m16n8k16; the padding warps skip their products. In the simulator the same block runs
the per-tile Numba twin with as few warps as the group needs. Either way Q, K, V and P are
rounded to f16 and products accumulate in f32, as in prefill.

attention_decode.py's FFMA kernel spends a multiply-add and a shared-memory load of q per key
element and query head; here a 16 x 8 x 16 product does 2,048 of them in one instruction.

Splits write the unnormalized partials (O, m, l) attention.py's combine reduces (m converted
from the loop's base-2 units); one split writes the normalized output. Splits are whole KV tiles,
so only the last tile before the position holds keys past its split's end: they are staged as
zeros and masked (they lie past the position).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import tensor_core
from ._common import IS_SIMULATOR, OCTET, ceil_div
from .attention_mma import (
    CPP_HEAD_DIMS,
    LN_2,
    LOG2_E,
    ROWS_PER_WARP,
    block_attend,
    block_rows,
    default_kv_tile,
    state_size,
)
from .launcher import jit

FUSED_WARPS = 4  # every warp stages; only the first ceil(group / 16) multiply
FUSED_BUFFERS = 2  # K/V tile buffers of the fused loop: tile j + 1 loads while tile j multiplies


def is_supported(head_dim: int, group: int) -> bool:
    """Whether this kernel serves a one-token call: a head dim the C++ loop exports, a group of at
    most the fused block's rows, a tensor-core GPU (or the simulator, which runs the twin)."""
    return head_dim in CPP_HEAD_DIMS and group <= FUSED_WARPS * ROWS_PER_WARP and \
        (tensor_core.is_available() or IS_SIMULATOR)


def launch_shape(head_dim: int, group: int, is_twin: bool) -> tuple:
    """(warps, kv_tile) of a block."""
    if is_twin:
        warps = ceil_div(group, ROWS_PER_WARP)
        return warps, default_kv_tile(head_dim, True, warps)
    return FUSED_WARPS, default_kv_tile(head_dim, False, FUSED_WARPS, True, FUSED_BUFFERS)


@functools.cache
def decode_kernel(fmt: str, head_dim: int, group: int, is_split: bool, is_twin: bool):
    """Arguments as attention_decode.decode_kernel's (scale the softmax scale); launch grid (T,
    num_kv_heads, num_splits), 32 * launch_shape()[0] threads: a block row per query row, each
    computing what a one-token launch computes for it."""
    warps, kv_tile = launch_shape(head_dim, group, is_twin)
    num_state = state_size(head_dim)
    m_off = head_dim // 2
    _, _, write_out = block_rows(head_dim, group, warps)
    attend = block_attend(fmt, head_dim, group, kv_tile, warps, is_twin, not is_twin, FUSED_BUFFERS)

    @cuda.jit(device=True)
    def split_range(q_position, kv_len, split_len):
        """Keys begin .. end - 1 of this block's split: whole tiles from its start."""
        span = min(kv_len, q_position + 1)
        split_rows = split_len
        if split_rows == 0:  # from the position on the device: a captured step replays at any position
            split_rows = (span + cuda.gridDim.z - 1) // cuda.gridDim.z
        split_rows = (split_rows + kv_tile - 1) // kv_tile * kv_tile
        begin = cuda.blockIdx.z * split_rows
        return begin, min(begin + split_rows, span)

    @cuda.jit(device=True)
    def write_partial(state, kvh, split, t, o_part, m_part, l_part):
        warp = cuda.threadIdx.x // 32
        g = cuda.threadIdx.x % 32 // 4
        tq = cuda.threadIdx.x % 4
        for h in range(2):
            row = warp * ROWS_PER_WARP + g + 8 * h  # the row's query head within the group
            if row < group:
                head = kvh * group + row
                for n in range(head_dim // OCTET):
                    for e in range(2):
                        o_part[split, t, head, OCTET * n + 2 * tq + e] = state[4 * n + 2 * h + e]
                if tq == 0:
                    m_part[split, t, head] = state[m_off + h] * LN_2  # the combine's natural-log units
                    l_part[split, t, head] = state[m_off + 2 + h]

    @jit
    def kernel(q, k_quants, k_scales, k_extra, v_quants, v_scales, v_extra, q_positions, kv_len, split_len, scale,
               out, o_part, m_part, l_part):
        t = cuda.blockIdx.x  # the query row: the block sees it as the one token of a one-token launch
        kvh = cuda.blockIdx.y
        q_t, positions_t = q[t:t + 1], q_positions[t:t + 1]
        state = cuda.local.array(num_state, np.float32)
        begin, end = split_range(positions_t[0], kv_len, split_len)
        attend(q_t, scale * np.float32(LOG2_E), kvh, 0, positions_t, kv_len, state, k_quants, k_scales, k_extra,
               v_quants, v_scales, v_extra, begin, end)
        if is_split:
            write_partial(state, kvh, cuda.blockIdx.z, t, o_part, m_part, l_part)
        else:
            write_out(state, kvh, 0, out[t:t + 1])

    return kernel


def threads(head_dim: int, group: int, is_twin: bool) -> int:
    return 32 * launch_shape(head_dim, group, is_twin)[0]
