"""Attention of decode tokens over a long KV cache: a warp per query head, a thread per key.

attention.py's kernel gives each query row `threads_per_row` threads that split every key's head
dims, and stages 32-key tiles of K and V in shared memory with four block barriers per tile.
Here a block owns one KV head's GQA group for one KV split, one warp per query head:

    scores:  thread j dequantizes key j of the tile (kv_tile = the block's threads) in registers
             and dots it with every query head of the group (q broadcast from shared memory):
             each key is read once for the whole group and no K tile is staged;
    softmax: warp h takes head h's scores of the tile: running max m and sum l, as attention.py;
    P V:     V staged in shared memory 32 rows at a time, each lane owns head_dim / 32 dims of
             its warp's head (O in registers).

On the H200 (Q4_0 cache, 32 query over 4 KV heads, 66 splits) a layer at 32k cached tokens took
275 us in attention.py's kernel (~70 GB/s of cache read) and takes 127-129 us here; 31 -> 25 us at
2k, 80 -> 45 at 8k. Two keys a thread, or a key's octet loads issued 2 or 4 at a time before any
is decoded, measured slower (136-143 us at 32k).

Splits write the same unnormalized partials (O, m, l) as attention.py, combined by its combine
kernel; one split writes the normalized output. A few query rows (a speculative verify's tokens,
each at its own position) take a block row each (grid x): every block computes exactly what the
one-token launch computes for that row. Needs head_dim a multiple of 32 and a group whose
scores fit the static shared memory (up to 8 query heads per KV head at head_dim 128: 29 KiB);
attention() sends one-token calls here when they hold and attention_decode_mma.py's tensor-core
kernel does not serve them: head dims other than 64 and 128, groups of more than 64 query heads,
or a GPU without tensor cores (or without cffi).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._common import MAX_STATIC_SHARED_BYTES, OCTET
from .block_reduce import NEG_INF
from .launcher import jit
from .quant_device import dequant8_for

WARP = 32
V_TILE = 32  # V rows staged at a time (16 KiB at head_dim 128)


def shared_bytes(head_dim: int, group: int) -> int:
    threads = group * WARP
    return 4 * (head_dim * group + group * threads + V_TILE * head_dim + threads)  # qs, ps, vs, red


def is_supported(head_dim: int, group: int) -> bool:
    """Whether this kernel serves a one-token call (else attention.py's does)."""
    return head_dim % WARP == 0 and 0 < group * WARP <= 1024 and \
        shared_bytes(head_dim, group) <= MAX_STATIC_SHARED_BYTES


@functools.cache
def decode_kernel(fmt: str, head_dim: int, group: int, is_split: bool):
    dequant8 = dequant8_for(fmt)
    threads = group * WARP
    kv_tile = threads  # key tid of a tile is the thread's
    num_octets = head_dim // OCTET
    dims_per_lane = head_dim // WARP
    # shared and local sizes as closure constants: Numba sizes them at compile time, not from expressions
    qs_size, ps_size, vs_size = head_dim * group, group * kv_tile, V_TILE * head_dim

    @jit
    def kernel(q, k_quants, k_scales, k_extra, v_quants, v_scales, v_extra, q_positions, kv_len, split_len, scale,
               out, o_part, m_part, l_part):
        tid = cuda.threadIdx.x
        head, lane = tid // WARP, tid % WARP  # the warp's query head within the group
        t = cuda.blockIdx.x  # the query row: a block attends as for that row alone
        kvh = cuda.blockIdx.y
        split = cuda.blockIdx.z
        qs = cuda.shared.array(qs_size, np.float32)  # [d, group]: a key element meets every head
        ps = cuda.shared.array(ps_size, np.float32)  # [group, kv_tile] scores, then probabilities
        vs = cuda.shared.array(vs_size, np.float32)
        red = cuda.shared.array(threads, np.float32)
        s = cuda.local.array(group, np.float32)
        wl = cuda.local.array(OCTET, np.float32)
        o = cuda.local.array(dims_per_lane, np.float32)
        for idx in range(tid, head_dim * group, threads):
            d, g = idx // group, idx % group
            qs[idx] = q[t, (kvh * group + g) * head_dim + d] * scale
        for c in range(dims_per_lane):
            o[c] = np.float32(0.0)
        m_i = NEG_INF
        l_i = np.float32(0.0)
        span = min(kv_len, q_positions[t] + 1)
        split_rows = split_len
        if split_rows == 0:  # from the position on the device: a captured step replays at any position
            split_rows = ((span + cuda.gridDim.z - 1) // cuda.gridDim.z + V_TILE - 1) // V_TILE * V_TILE
        start = split * split_rows
        end = min(start + split_rows, span)
        cuda.syncthreads()
        for j0 in range(start, end, kv_tile):
            key = j0 + tid
            for g in range(group):
                s[g] = NEG_INF
            if key < end:
                for g in range(group):
                    s[g] = np.float32(0.0)
                for oc in range(num_octets):
                    dequant8(k_quants, k_scales, k_extra, key, kvh * num_octets + oc, wl, 0)
                    for i in range(OCTET):
                        base = (oc * OCTET + i) * group
                        for g in range(group):
                            s[g] += wl[i] * qs[base + g]
            for g in range(group):
                ps[g * kv_tile + tid] = s[g]
            cuda.syncthreads()
            # the online-softmax step of attention.py's kernel, inline: as a shared device function
            # (lanes an argument or a closure constant) this kernel took 124 registers, not 63 (ptxas, sm_90)
            tile_max = NEG_INF
            for j in range(lane, kv_tile, WARP):
                tile_max = max(tile_max, ps[head * kv_tile + j])
            red[tid] = tile_max
            cuda.syncthreads()
            m_new = m_i
            for i in range(WARP):
                m_new = max(m_new, red[head * WARP + i])
            part_sum = np.float32(0.0)
            for j in range(lane, kv_tile, WARP):
                sj = ps[head * kv_tile + j]
                p = np.float32(math.exp(sj - m_new)) if sj != NEG_INF else np.float32(0.0)
                ps[head * kv_tile + j] = p
                part_sum += p
            cuda.syncthreads()  # every warp has read red's maxima
            red[tid] = part_sum
            cuda.syncthreads()
            tile_sum = np.float32(0.0)
            for i in range(WARP):
                tile_sum += red[head * WARP + i]
            alpha = np.float32(math.exp(m_i - m_new)) if m_i != NEG_INF else np.float32(0.0)
            l_i = l_i * alpha + tile_sum
            for c in range(dims_per_lane):
                o[c] *= alpha
            m_i = m_new
            for v0 in range(j0, min(j0 + kv_tile, end), V_TILE):
                cuda.syncthreads()  # the previous V rows' readers are done
                for idx in range(tid, V_TILE * num_octets, threads):
                    j, oc = idx // num_octets, idx % num_octets
                    if v0 + j < end:  # rows past the end are never read below
                        dequant8(v_quants, v_scales, v_extra, v0 + j, kvh * num_octets + oc, wl, 0)
                        for i in range(OCTET):
                            vs[j * head_dim + oc * OCTET + i] = wl[i]
                cuda.syncthreads()
                for j in range(min(V_TILE, end - v0)):
                    p = ps[head * kv_tile + v0 - j0 + j]
                    for c in range(dims_per_lane):
                        o[c] += p * vs[j * head_dim + lane + c * WARP]
            cuda.syncthreads()  # the tile's probabilities are read before the next tile's scores
        h = kvh * group + head
        if is_split:
            for c in range(dims_per_lane):
                o_part[split, t, h, lane + c * WARP] = o[c]
            if lane == 0:
                m_part[split, t, h] = m_i
                l_part[split, t, h] = l_i
        else:
            inv_l = np.float32(1.0) / l_i if l_i > 0 else np.float32(0.0)
            for c in range(dims_per_lane):
                out[t, h * head_dim + lane + c * WARP] = o[c] * inv_l

    return kernel
