"""Causal GQA prefill attention on tensor cores: flash-attention 2 over a KV cache (F16, Q8_0, Q4_0).

A block of 4 warps owns 64 query rows; a row is a (token, query head) pair of one KV head's group,
rows numbered token-major (row = token * group + head in group), so every K/V tile the block
stages serves the whole group. Q is scaled by softmax_scale * log2(e) and staged as f16 once. Per
KV tile (up to the block's last causal key) the block dequantizes K and V into shared memory as f16
(rows padded to head_dim + 8 halves), then each warp runs one tile step on its 16 rows: S = Q K^T
with mma.m16n8k16, the causal mask, the online-softmax update in registers (running max m and sum l
per row, base-2 exponentials), O += P V with P rounded to f16. O, m and l live in a per-thread local
array between tiles.

The tile step is CUDA C++ (cuda/attention_mma.cu) on a GPU with tensor cores; its pure-Numba twin
below has the same fragment layout and order of operations, and is what the simulator runs. The
twin has no warp shuffles: lanes write their scores to shared memory and each lane recomputes the
row max and the quad's sum from there. Decode (few query rows, split KV) stays in attention.py.

Options (MmaAttentionConfig): `warps` 8 gives a block 128 rows, so each staged K/V tile serves twice
the rows. `fused` moves the whole KV loop into C++ (GPU only): Q fragments are loaded once into
registers (Q's shared memory is then reused for the K/V tiles), O, m and l stay in registers across
tiles, K/V are staged with 16-byte stores (cp.async for F16, dequantized octets for Q8_0 / Q4_0), and
with `stages` 2 tile j + 1 is loaded while tile j is multiplied, one barrier per tile. Its numerics are
those of the per-tile step, so the simulator runs the twin for it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, types

from . import tensor_core
from ._common import (
    MAX_STATIC_SHARED_BYTES,
    OCTET,
    ceil_div,
    check_array,
    check_positive,
    empty,
    is_device_array,
)
from .block_reduce import NEG_INF
from .kvcache import KV_FORMATS, dequantize_kv
from .launcher import jit
from .packing import PackedMatrix, check_packed
from .quant_device import dequant8_for

WARPS_PER_BLOCK = 4  # the default; MmaAttentionConfig.warps
BLOCK_WARPS = (4, 8)
ROWS_PER_WARP = tensor_core.MMA_M
FUSED_STAGES = (1, 2)
ROW_PAD_HALVES = 8  # row stride head_dim + 8: the 8 rows of a fragment load fall on distinct banks
CPP_HEAD_DIMS = (64, 128)  # the head dims cuda/attention_mma.cu exports
KV_TILES = (64, 48, 32, 16)  # the tile sizes it exports, largest first
LOG2_E = 1.4426950408889634
LN_2 = np.float32(math.log(2.0))
INT_PTR = types.CPointer(types.int32)


class MmaAttentionConfig(NamedTuple):
    """Defaults are the per-tile step; ``SERVING_CONFIG`` is what attention() uses."""

    kv_tile: int = 0  # keys per staged tile, a multiple of 16; 0: the largest that fits the shared memory
    use_tensor_cores: bool | None = None  # None: the C++ tile step when available, else the Numba twin
    lto: bool = False  # link-time optimization (lets the tile step inline into the kernel)
    warps: int = WARPS_PER_BLOCK  # warps per block (16 query rows each): 4 or 8
    fused: bool = False  # the whole KV loop in C++, Q and O in registers (the twin runs unfused)
    stages: int = 2  # fused only: K/V tile buffers, 2 overlaps loading tile j + 1 with tile j


# fused KV loop, 4 warps, double-buffered tiles: fastest measured on the H200 (F16 cache: 126 / 198
# TFLOP/s at 4k / 32k against 64 / 84 for the per-tile step; Q8_0 and Q4_0 caches 81-135)
SERVING_CONFIG = MmaAttentionConfig(fused=True)


def shared_bytes(head_dim: int, kv_tile: int, is_twin: bool, warps: int = WARPS_PER_BLOCK, fused: bool = False,
                 stages: int = 2) -> int:
    stride = head_dim + ROW_PAD_HALVES
    rows = warps * ROWS_PER_WARP
    if fused and not is_twin:  # Q, then `stages` K/V buffer pairs, share one array
        return 2 * stride * max(rows, 2 * stages * kv_tile) + 4 * rows
    num_bytes = 2 * stride * (rows + 2 * kv_tile) + 4 * rows
    return num_bytes + (4 * rows * kv_tile if is_twin else 0)  # the twin's score rows


def default_kv_tile(head_dim: int, is_twin: bool = False, warps: int = WARPS_PER_BLOCK, fused: bool = False,
                    stages: int = 2) -> int:
    for kv_tile in KV_TILES:
        if shared_bytes(head_dim, kv_tile, is_twin, warps, fused, stages) <= MAX_STATIC_SHARED_BYTES:
            return kv_tile
    raise ValueError(f"head_dim {head_dim} leaves no room for a KV tile in {MAX_STATIC_SHARED_BYTES} bytes")


def state_size(head_dim: int) -> int:
    """Floats of per-thread state: O fragments [head_dim / 8][4] = head_dim / 2, then m[2], l[2]."""
    return head_dim // 2 + 4


def is_supported(head_dim: int, fmt: str) -> bool:
    """Whether the C++ tile step (or, in the simulator, its twin at the same shapes) serves this case."""
    return head_dim in CPP_HEAD_DIMS and fmt in KV_FORMATS


def _twin_tile_step(head_dim: int, kv_tile: int):
    """The Numba twin of strata_attention_mma_d{head_dim}_k{kv_tile}; every thread of the block calls it."""
    stride = head_dim + ROW_PAD_HALVES
    num_score_tiles = kv_tile // 8
    num_out_tiles = head_dim // 8
    m_off = head_dim // 2

    @cuda.jit(device=True)
    def score(qs, ks, q_row, key):  # f16 inputs, f32 products and sum
        s = np.float32(0.0)
        for c in range(head_dim):
            s += np.float32(qs[q_row * stride + c]) * np.float32(ks[key * stride + c])
        return s

    @cuda.jit(device=True)
    def prob(s, m):
        return np.float32(0.0) if s == NEG_INF else np.float32(math.exp((s - m) * LN_2))

    @cuda.jit(device=True)
    def row_max(scores, row):
        tile_max = NEG_INF
        for key in range(kv_tile):
            tile_max = max(tile_max, scores[row * kv_tile + key])
        return tile_max

    @cuda.jit(device=True)
    def quad_sum(scores, row):  # each quad lane's partial sum in the C++ order, then the two xor-shuffle steps
        part0 = part1 = part2 = part3 = np.float32(0.0)
        for j in range(num_score_tiles):
            for e in range(2):
                part0 += scores[row * kv_tile + 8 * j + e]
                part1 += scores[row * kv_tile + 8 * j + 2 + e]
                part2 += scores[row * kv_tile + 8 * j + 4 + e]
                part3 += scores[row * kv_tile + 8 * j + 6 + e]
        return (part0 + part1) + (part2 + part3)

    @cuda.jit(device=True)
    def tile_step(qs, ks, vs, row_last, scores, warp, key0, state):
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        t = lane % 4
        row0 = warp * ROWS_PER_WARP + g  # rows row0 and row0 + 8 of the block
        # S = Q K^T for this lane's fragment elements, masked, into the shared score rows [64, kv_tile]
        for j in range(num_score_tiles):
            for r in range(4):
                row = row0 + 8 * (r // 2)
                key = 8 * j + 2 * t + r % 2
                s = score(qs, ks, row, key)
                scores[row * kv_tile + key] = NEG_INF if key > row_last[row] - key0 else s
        cuda.syncthreads()
        m_new0 = max(state[m_off], row_max(scores, row0))
        m_new1 = max(state[m_off + 1], row_max(scores, row0 + 8))
        cuda.syncthreads()  # the quad has read the scores; each lane now turns its own into P
        for j in range(num_score_tiles):
            for r in range(4):
                row = row0 + 8 * (r // 2)
                key = 8 * j + 2 * t + r % 2
                scores[row * kv_tile + key] = prob(scores[row * kv_tile + key], m_new0 if r < 2 else m_new1)
        cuda.syncthreads()
        for h in range(2):
            row = row0 + 8 * h
            m_old = state[m_off + h]
            m_new = m_new0 if h == 0 else m_new1
            alpha = np.float32(0.0) if m_old == NEG_INF else np.float32(math.exp((m_old - m_new) * LN_2))
            state[m_off + 2 + h] = state[m_off + 2 + h] * alpha + quad_sum(scores, row)
            state[m_off + h] = m_new
            for n in range(num_out_tiles):
                for e in range(2):
                    dim = 8 * n + 2 * t + e
                    acc = state[4 * n + 2 * h + e] * alpha
                    for key in range(kv_tile):
                        acc += np.float32(np.float16(scores[row * kv_tile + key])) * np.float32(vs[key * stride + dim])
                    state[4 * n + 2 * h + e] = acc
        cuda.syncthreads()  # P is read before the next tile rewrites the score rows

    return tile_step


def _cpp_tile_step(head_dim: int, kv_tile: int):
    """The tile step as a call into cuda/attention_mma.cu; `scores` is unused."""
    argtypes = (tensor_core.HALF_PTR, tensor_core.HALF_PTR, tensor_core.HALF_PTR, INT_PTR, tensor_core.INT32,
                tensor_core.FLOAT_PTR)  # q, k, v, row_last, key0, state
    step = tensor_core.declare(f"strata_attention_mma_d{head_dim}_k{kv_tile}", argtypes, "attention_mma.cu")
    ffi = tensor_core.ffi()
    q_warp_halves = ROWS_PER_WARP * (head_dim + ROW_PAD_HALVES)

    @cuda.jit(device=True)
    def tile_step(qs, ks, vs, row_last, scores, warp, key0, state):
        step(ffi.from_buffer(qs[warp * q_warp_halves:]), ffi.from_buffer(ks), ffi.from_buffer(vs),
             ffi.from_buffer(row_last[warp * ROWS_PER_WARP:]), np.int32(key0), ffi.from_buffer(state))

    return tile_step


def block_rows(head_dim: int, group: int, warps: int):
    """Device functions for a block's query rows: staging Q and row_last, the last key, the output."""
    stride = head_dim + ROW_PAD_HALVES
    rows = warps * ROWS_PER_WARP
    threads = 32 * warps
    m_off = head_dim // 2

    @cuda.jit(device=True)
    def stage_q(q, q_scale, kvh, row_base, q_positions, kv_len, qs, row_last):
        num_tokens = q.shape[0]
        tid = cuda.threadIdx.x
        for idx in range(tid, rows * head_dim, threads):
            r = idx // head_dim
            c = idx % head_dim
            t = (row_base + r) // group
            h = kvh * group + (row_base + r) % group
            qs[r * stride + c] = np.float16(q[t, h * head_dim + c] * q_scale) if t < num_tokens else np.float16(0.0)
        for r in range(tid, rows, threads):
            t = (row_base + r) // group
            row_last[r] = min(q_positions[t], kv_len - 1) if t < num_tokens else -1

    @cuda.jit(device=True)
    def key_end(row_last):  # one past the last key any row of the block sees
        end = 0
        for r in range(rows):
            end = max(end, row_last[r] + 1)
        return end

    @cuda.jit(device=True)
    def write_out(state, kvh, row_base, out):
        warp = cuda.threadIdx.x // 32
        g = cuda.threadIdx.x % 32 // 4
        tq = cuda.threadIdx.x % 4
        for h in range(2):
            row = row_base + warp * ROWS_PER_WARP + g + 8 * h
            t = row // group
            if t < out.shape[0]:
                l_row = state[m_off + 2 + h]
                inv_l = np.float32(1.0) / l_row if l_row > 0 else np.float32(0.0)
                col0 = (kvh * group + row % group) * head_dim
                for n in range(head_dim // 8):
                    for e in range(2):
                        out[t, col0 + 8 * n + 2 * tq + e] = state[4 * n + 2 * h + e] * inv_l

    return stage_q, key_end, write_out


def _kv_loop(fmt: str, head_dim: int, kv_tile: int, is_twin: bool, warps: int):
    """The per-tile KV loop as a device function: every thread of the block calls
    kv_loop(qs, ks, vs, row_last, scores, state, wl, <the cache's six planes>, kvh, begin, end), which
    zeroes the state and runs the tile step over keys begin .. end - 1, tiles of kv_tile from begin.
    Keys a tile holds from `end` on are staged as zeros and must be masked by row_last: `end` is one
    past the last key any row sees, or begin plus a multiple of kv_tile."""
    dequant8 = dequant8_for(fmt)
    tile_step = _twin_tile_step(head_dim, kv_tile) if is_twin else _cpp_tile_step(head_dim, kv_tile)
    stride = head_dim + ROW_PAD_HALVES
    threads = 32 * warps
    octets_per_row = head_dim // OCTET
    m_off = head_dim // 2

    @cuda.jit(device=True)
    def stage_kv(k_quants, k_scales, k_extra, v_quants, v_scales, v_extra, kvh, key0, end, ks, vs, wl):
        for idx in range(cuda.threadIdx.x, kv_tile * octets_per_row, threads):
            jj = idx // octets_per_row
            oc = idx % octets_per_row
            base = jj * stride + oc * OCTET
            if key0 + jj < end:
                dequant8(k_quants, k_scales, k_extra, key0 + jj, kvh * octets_per_row + oc, wl, 0)
                for i in range(OCTET):
                    ks[base + i] = np.float16(wl[i])
                dequant8(v_quants, v_scales, v_extra, key0 + jj, kvh * octets_per_row + oc, wl, 0)
                for i in range(OCTET):
                    vs[base + i] = np.float16(wl[i])
            else:  # zeros, never garbage: a NaN in V would survive P = 0
                for i in range(OCTET):
                    ks[base + i] = np.float16(0.0)
                    vs[base + i] = np.float16(0.0)

    @cuda.jit(device=True)
    def kv_loop(qs, ks, vs, row_last, scores, state, wl, k_quants, k_scales, k_extra, v_quants, v_scales, v_extra,
                kvh, begin, end):
        warp = cuda.threadIdx.x // 32
        for i in range(m_off):
            state[i] = np.float32(0.0)
        for h in range(2):
            state[m_off + h] = NEG_INF
            state[m_off + 2 + h] = np.float32(0.0)
        for key0 in range(begin, end, kv_tile):
            cuda.syncthreads()  # every warp is done with the previous tile
            stage_kv(k_quants, k_scales, k_extra, v_quants, v_scales, v_extra, kvh, key0, end, ks, vs, wl)
            cuda.syncthreads()
            tile_step(qs, ks, vs, row_last, scores, warp, key0, state)

    return kv_loop


@functools.cache
def block_attend(fmt: str, head_dim: int, group: int, kv_tile: int, warps: int, is_twin: bool, fused: bool,
                 stages: int = 2):
    """attend(q, q_scale, kvh, row_base, q_positions, kv_len, state, <the cache's six planes>, begin, end),
    called by every thread of a block: stages the block's query rows (row_base on, scaled by q_scale)
    and runs the KV loop over keys begin .. end - 1 into state (end < 0: one past the last key any
    row sees). The per-tile loop (the Numba twin, or the C++ tile step), or with `fused` the C++
    fused loop (GPU only). The state's layout is state_size()'s; block_rows' write_out normalizes it."""
    stage_q, key_end, _ = block_rows(head_dim, group, warps)
    stride = head_dim + ROW_PAD_HALVES
    rows = warps * ROWS_PER_WARP
    if fused:
        loop = fused_loop(fmt, head_dim, kv_tile, warps, stages)
        ffi = tensor_core.ffi()
        buf_size = fused_buffer_size(head_dim, kv_tile, warps, stages)

        @cuda.jit(device=True)
        def attend_fused(q, q_scale, kvh, row_base, q_positions, kv_len, state, k_quants, k_scales, k_extra, v_quants,
                         v_scales, v_extra, begin, end):
            buf = cuda.shared.array(buf_size, np.float16, alignment=16)  # 16-byte copies and ldmatrix
            row_last = cuda.shared.array(rows, np.int32)
            stage_q(q, q_scale, kvh, row_base, q_positions, kv_len, buf, row_last)
            cuda.syncthreads()
            if end < 0:
                end = key_end(row_last)
            loop(ffi.from_buffer(buf), ffi.from_buffer(row_last), np.int32(begin), np.int32(end),
                 ffi.from_buffer(k_quants), ffi.from_buffer(k_scales), ffi.from_buffer(v_quants),
                 ffi.from_buffer(v_scales), np.int32(k_quants.shape[1]), np.int32(k_scales.shape[1]),
                 np.int32(kvh * head_dim), ffi.from_buffer(state))

        return attend_fused

    kv_loop = _kv_loop(fmt, head_dim, kv_tile, is_twin, warps)
    q_size, kv_size = rows * stride, kv_tile * stride
    scores_size = rows * kv_tile if is_twin else 4

    @cuda.jit(device=True)
    def attend(q, q_scale, kvh, row_base, q_positions, kv_len, state, k_quants, k_scales, k_extra, v_quants, v_scales,
               v_extra, begin, end):
        # f16 shared arrays are only 2-byte aligned (the simulator takes no alignment): each a multiple
        # of 16 bytes keeps each one on a 16-byte boundary, as the C++ 32-bit fragment loads need
        qs = cuda.shared.array(q_size, np.float16)  # [rows, stride]
        ks = cuda.shared.array(kv_size, np.float16)  # [kv_tile, stride]
        vs = cuda.shared.array(kv_size, np.float16)  # [kv_tile, stride]
        row_last = cuda.shared.array(rows, np.int32)
        scores = cuda.shared.array(scores_size, np.float32)  # [rows, kv_tile], twin only
        wl = cuda.local.array(OCTET, np.float32)
        stage_q(q, q_scale, kvh, row_base, q_positions, kv_len, qs, row_last)
        cuda.syncthreads()
        if end < 0:
            end = key_end(row_last)
        kv_loop(qs, ks, vs, row_last, scores, state, wl, k_quants, k_scales, k_extra, v_quants, v_scales, v_extra,
                kvh, begin, end)

    return attend


@functools.cache
def _prefill_kernel(fmt: str, head_dim: int, group: int, kv_tile: int, warps: int, is_twin: bool, fused: bool,
                    stages: int, lto: bool):
    attend = block_attend(fmt, head_dim, group, kv_tile, warps, is_twin, fused, stages)
    _, _, write_out = block_rows(head_dim, group, warps)
    rows = warps * ROWS_PER_WARP
    num_state = state_size(head_dim)
    jit_options = {"lto": True} if lto else {}  # the C++ declarations link their source

    @jit(**jit_options)
    def kernel(q, k_quants, k_scales, k_extra, v_quants, v_scales, v_extra, q_positions, kv_len, q_scale, out):
        kvh = cuda.blockIdx.y
        row_base = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * rows  # the longest rows start first
        state = cuda.local.array(num_state, np.float32)
        attend(q, q_scale, kvh, row_base, q_positions, kv_len, state, k_quants, k_scales, k_extra, v_quants, v_scales,
               v_extra, 0, -1)
        write_out(state, kvh, row_base, out)

    return kernel


def fused_loop(fmt: str, head_dim: int, kv_tile: int, warps: int, stages: int):
    """The C++ fused KV loop, declared: fused_loop(smem, row_last, begin, end, k_quants, k_scales, v_quants,
    v_scales, quant_pitch, scale_pitch, col0, state), arguments as cuda/attention_mma.cu's attention_fused
    takes them (pointers through tensor_core.ffi().from_buffer); GPU only. The source is linked with
    the one instantiation the kernel calls appended."""
    name = f"strata_attention_mma_fused_{fmt}_d{head_dim}_k{kv_tile}_w{warps}_s{stages}"
    line = f"\nSTRATA_ATTENTION_FUSED({fmt}, {head_dim}, {kv_tile}, {warps}, {stages})\n"
    quant_ptr = tensor_core.HALF_PTR if fmt == "F16" else types.CPointer(types.uint32)
    i32 = tensor_core.INT32
    argtypes = (tensor_core.HALF_PTR, INT_PTR, i32, i32, quant_ptr, tensor_core.HALF_PTR, quant_ptr,
                tensor_core.HALF_PTR, i32, i32, i32, tensor_core.FLOAT_PTR)
    return tensor_core.declare(name, argtypes, "attention_mma.cu", line)


def fused_buffer_size(head_dim: int, kv_tile: int, warps: int, stages: int) -> int:
    """Halves of the fused loop's shared buffer: [rows, stride] Q, then [stages][2][kv_tile, stride] K/V."""
    return (head_dim + ROW_PAD_HALVES) * max(warps * ROWS_PER_WARP, 2 * stages * kv_tile)


def _check_config(config: MmaAttentionConfig, head_dim: int, is_twin: bool) -> int:
    """The KV tile size the config asks for, validated against the shared memory limit."""
    if config.warps not in BLOCK_WARPS:
        raise ValueError(f"warps must be one of {BLOCK_WARPS}, got {config.warps}")
    if config.stages not in FUSED_STAGES:
        raise ValueError(f"stages must be one of {FUSED_STAGES}, got {config.stages}")
    layout = (config.warps, bool(config.fused), config.stages)
    kv_tile = config.kv_tile or default_kv_tile(head_dim, is_twin, *layout)
    if kv_tile % tensor_core.MMA_K or (not is_twin and kv_tile not in KV_TILES):
        raise ValueError(f"kv_tile must be one of {KV_TILES}, got {kv_tile}")
    num_shared_bytes = shared_bytes(head_dim, kv_tile, is_twin, *layout)
    if num_shared_bytes > MAX_STATIC_SHARED_BYTES:
        raise ValueError(f"kv_tile {kv_tile} needs {num_shared_bytes} bytes of shared memory per block (limit "
                         f"{MAX_STATIC_SHARED_BYTES})")
    return kv_tile


def check_attention_io(q, k_cache: PackedMatrix, v_cache: PackedMatrix, q_positions, out, kv_len: int | None,
                       num_q_heads: int, num_kv_heads: int, head_dim: int):
    """The checks every attention wrapper makes of its arrays: returns (num_tokens, kv_len, out), kv_len
    derived from host positions and out allocated when they are None."""
    width = num_kv_heads * head_dim
    check_packed("k_cache", k_cache, num_cols=width, formats=KV_FORMATS)
    check_packed("v_cache", v_cache, num_cols=width, formats=(k_cache.fmt,))
    check_array("q", q, dtypes=np.float32, shape=(None, num_q_heads * head_dim))
    num_tokens = q.shape[0]
    check_array("q_positions", q_positions, dtypes=np.int32, shape=(num_tokens,))
    if kv_len is None:
        if is_device_array(q_positions):
            raise ValueError("kv_len is required when q_positions is a device array")
        kv_len = int(q_positions.max()) + 1 if num_tokens else 0
    if not 0 <= kv_len <= k_cache.num_rows:
        raise ValueError(f"kv_len must lie in [0, {k_cache.num_rows}], got {kv_len}")
    if out is None:
        out = empty((num_tokens, num_q_heads * head_dim), np.float32, q, k_cache.quants)
    check_array("out", out, dtypes=np.float32, shape=(num_tokens, num_q_heads * head_dim))
    return num_tokens, kv_len, out


def attention_mma(q, k_cache: PackedMatrix, v_cache: PackedMatrix, q_positions, out=None, *, num_q_heads: int,
                  num_kv_heads: int, head_dim: int, kv_len: int | None = None, scale: float | None = None,
                  config: MmaAttentionConfig = MmaAttentionConfig(), f16_scratch=None):
    """softmax(q k^T * scale + causal mask) v per query head on tensor cores; q, out [T, num_q_heads * head_dim] f32.

    k_cache / v_cache: [num_positions, num_kv_heads * head_dim] in F16, Q8_0 or Q4_0 (kvcache.py);
    q_positions: [T] int32, token t sees cache rows 0..q_positions[t]; kv_len as in attention.py.
    Inputs are rounded to f16 (Q after scaling, K, V, P); products accumulate in f32.
    f16_scratch: optional (K, V) F16 matrices of the cache's width and at least kv_len rows; a Q8_0 /
    Q4_0 cache is then first dequantized into them (kvcache.dequantize_kv, the values the kernel
    would stage) and the F16 kernel runs on them: the same sums, and on the H200 the F16 kernel's
    16-byte asynchronous copies outrun dequantizing every tile in every block.

    Launch config: grid (ceil(T * group / rows), num_kv_heads), rows = 16 * config.warps (64 by
    default), 32 * warps threads; static shared memory 2 * (head_dim + 8) * (rows + 2 * kv_tile) + 4 * rows
    bytes (the twin adds 4 * rows * kv_tile for its score rows; fused: 2 * (head_dim + 8) * max(rows,
    2 * stages * kv_tile) + 4 * rows), at most 48 KiB: by default kv_tile 48 at head_dim 128, 64 at 64.
    """
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check_positive(name, value)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim % tensor_core.MMA_K:
        raise ValueError(f"head_dim must be a multiple of {tensor_core.MMA_K}, got {head_dim}")
    is_twin = not (tensor_core.is_available() if config.use_tensor_cores is None else config.use_tensor_cores)
    if not is_twin and head_dim not in CPP_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} has no tensor-core tile step; supported: {CPP_HEAD_DIMS}")
    kv_tile = _check_config(config, head_dim, is_twin)
    group = num_q_heads // num_kv_heads
    num_tokens, kv_len, out = check_attention_io(q, k_cache, v_cache, q_positions, out, kv_len, num_q_heads,
                                                 num_kv_heads, head_dim)
    if num_tokens == 0:
        return out
    if f16_scratch is not None and k_cache.fmt != "F16":
        dequantize_kv(k_cache, v_cache, kv_len, *f16_scratch)
        k_cache, v_cache = f16_scratch
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lto = bool(config.lto) and not is_twin
    kernel = _prefill_kernel(k_cache.fmt, head_dim, group, kv_tile, config.warps, is_twin,
                             bool(config.fused) and not is_twin, config.stages, lto)
    grid = (ceil_div(num_tokens * group, config.warps * ROWS_PER_WARP), num_kv_heads)
    kernel[grid, 32 * config.warps](q, k_cache.quants, k_cache.scales, k_cache.extra, v_cache.quants, v_cache.scales,
                                    v_cache.extra, q_positions, kv_len, np.float32(scale * LOG2_E), out)
    return out

