"""Decode attention at HBM speed: K and V read straight from the cache into tensor-core fragments.

attention_decode_mma.py stages each KV tile in shared memory (dequantized to f16 by every warp of
the block) for the one warp that holds the group's query rows, and then combines the splits in a
second launch: on the H200 the F16 / Q8_0 / Q4_0 caches were read at 203 / 105 / 56 GB/s at position
2,048 and 1,598 / 846 / 442 GB/s at 32,768, the quantized caches with too few bytes in flight.
Here (cuda/attention_decode.cu) a block owns one query row's KV head over one KV split and every
warp of it computes: the warps take the split's 16-key tiles in turn, each lane loading its share
of K and V with 16-byte loads into registers, the next step's tiles while the current ones are
multiplied (mma.m16n8k16, the group's heads as rows, dequantized in registers: no staging, no
separate dequantization pass). The warps meet in shared memory; a row whose keys fill one split
writes its output there, else each split writes its partial (O, m, l) and the last of the row's
splits to finish (an atomic counter a row and KV head) combines them in split order, in the same
launch. The splits a row uses follow its position on the device (at least min_split_keys each,
whole tiles), so a captured step replays at any position and short rows take few splits.

Numerics: Q (scaled by scale * log2(e)), K, V and P rounded to f16 as in prefill; products and
sums in f32. Every block computes for its row what a one-row launch computes (the splits depend
only on the row's position and the launch's split count), so decode rows have the bits of one-row
launches. The simulator runs a Numba twin of the same splits, warps' tiles and combines (one thread
a warp and head: products in another order).

Serves head dims 64 and 128 and groups of up to 8 query heads (the A rows g of one warp); F16, Q8_0
and Q4_0 caches whose quants planes are 16-byte aligned; a GPU with tensor cores (and cffi) or the
simulator. attention() sends other decode calls to attention_decode_mma.py or attention_decode.py,
and these too when asked (use_direct_decode=False).

Launch config: grid (T, num_kv_heads, num_splits), 32 * warps threads; static shared memory
4 * max(states + group * (head_dim + 8) / 2, 2 * MAX_SPLITS * group + group) bytes, states = warps * group *
(head_dim + 3) rounded up to a multiple of 4 (35,712 at 8 warps, group 8, head dim 128).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, types

from . import tensor_core
from ._common import IS_SIMULATOR, MAX_STATIC_SHARED_BYTES, ceil_div, check_array, is_device_array
from .attention_mma import LN_2, LOG2_E
from .block_reduce import NEG_INF
from .launcher import jit
from .packing import PackedMatrix
from .quant_device import dequant8_for

WARP = 32
TILE_KEYS = 16  # keys of one mma k-step of P V
HEAD_DIMS = (64, 128)
MAX_GROUP = 8
MAX_SPLITS = 256  # the last block stages the weights of every split in shared memory
ML_STRIDE = 32  # floats of a split's (m, l) record a row and KV head: m of head h at h, l at 16 + h (a line each)
_TILES_PER_STEP = {"F16": 1, "Q8_0": 1, "Q4_0": 2}  # registers: 248 / 182 / 197 a thread at head dim 128 (ptxas)
_INT_PTR = types.CPointer(types.int32)


class DirectDecodeConfig(NamedTuple):
    warps: int = 8  # a block's warps, each its own tiles of the split (1 to 8)
    blocks_per_sm: int = 1  # splits = blocks_per_sm * SMs / KV heads (MAX_SPLITS at most)
    min_split_keys: int = 256  # a row's split holds at least this many keys (fewer splits, less to combine)
    tiles_per_step: int = 0  # 16-key tiles a warp loads at once (1, 2 or 4); 0: the format's default

    def validate(self) -> "DirectDecodeConfig":
        if not 1 <= self.warps <= 8:
            raise ValueError(f"warps must lie in [1, 8], got {self.warps}")
        if self.blocks_per_sm < 1:
            raise ValueError(f"blocks_per_sm must be positive, got {self.blocks_per_sm}")
        if self.min_split_keys < TILE_KEYS or self.min_split_keys % TILE_KEYS:
            raise ValueError(f"min_split_keys must be a positive multiple of {TILE_KEYS}, got {self.min_split_keys}")
        if self.tiles_per_step not in (0, 1, 2, 4):
            raise ValueError(f"tiles_per_step must be 0 (the format's), 1, 2 or 4, got {self.tiles_per_step}")
        return self

    def tiles_for(self, fmt: str) -> int:
        return self.tiles_per_step or _TILES_PER_STEP[fmt]


DEFAULT_CONFIG = DirectDecodeConfig()


def shared_floats(head_dim: int, group: int, warps: int) -> int:
    """The warps' states [warps, group, head_dim + 3] (O rows of head_dim + 1 floats, then m and l) and, 16-byte
    aligned after them, the group's Q as f16 [group, head_dim + 8], reused by the last block for every split's
    weights."""
    states = ceil_div(warps * group * (head_dim + 3), 4) * 4
    return max(states + group * (head_dim + 8) // 2, 2 * MAX_SPLITS * group + group)


def is_supported(head_dim: int, group: int, k_cache: PackedMatrix | None = None,
                 config: DirectDecodeConfig = DEFAULT_CONFIG) -> bool:
    """Whether this kernel serves a decode call: the shapes above, and on a GPU tensor cores and a
    16-byte aligned quants plane (its loads are 16 bytes wide; the scales are read 2 bytes at a time,
    and an F16 cache's placeholder scales not at all)."""
    if head_dim not in HEAD_DIMS or not 1 <= group <= MAX_GROUP:
        return False
    if 4 * shared_floats(head_dim, group, config.warps) > MAX_STATIC_SHARED_BYTES:
        return False
    if IS_SIMULATOR:
        return True
    if not tensor_core.is_available():
        return False
    quants = None if k_cache is None else k_cache.quants
    return not is_device_array(quants) or quants.device_ctypes_pointer.value % 16 == 0


def default_num_splits(kv_len: int, num_kv_heads: int, num_sms: int,
                       config: DirectDecodeConfig = DEFAULT_CONFIG) -> int:
    """KV splits of a decode launch over kv_len cells: blocks_per_sm blocks an SM over the KV heads."""
    by_sms = ceil_div(config.blocks_per_sm * num_sms, num_kv_heads)
    return max(1, min(by_sms, ceil_div(max(kv_len, 1), config.min_split_keys), MAX_SPLITS))


def workspace_specs(num_splits: int, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> tuple:
    """(shape, dtype) of the workspace: o_part [S, T, Hq, d], ml_part [S, T, Hkv, 32] float32, and the
    counters [T, Hkv] int32, which must be zero before the first launch (each launch leaves them zero)."""
    return (((num_splits, num_tokens, num_q_heads, head_dim), np.float32),
            ((num_splits, num_tokens, num_kv_heads, ML_STRIDE), np.float32),
            ((num_tokens, num_kv_heads), np.int32))


def split_keys(span: int, num_splits: int, min_keys: int) -> int:
    """Keys of each split of a row that attends `span` keys (the kernels' formula, on the host)."""
    share = ceil_div(ceil_div(span, num_splits), TILE_KEYS) * TILE_KEYS
    return max(share, min_keys)


def active_splits(span: int, keys: int) -> int:
    return max(1, ceil_div(span, keys))


@jit
def _zero_counters(counters):  # [T, Hkv]
    i = cuda.grid(1)
    if i < counters.shape[0] * counters.shape[1]:
        counters[i // counters.shape[1], i % counters.shape[1]] = 0


def attention_decode(q, k_cache: PackedMatrix, v_cache: PackedMatrix, q_positions, out, *, num_q_heads: int,
                     num_kv_heads: int, head_dim: int, kv_len: int, num_splits: int, scale: float, workspace=None,
                     config: DirectDecodeConfig = DEFAULT_CONFIG, stream=0):
    """attention()'s decode rows on this kernel (arguments checked there): row t attends keys
    0 .. min(q_positions[t], kv_len - 1). workspace: workspace_specs' arrays, or None (allocated here,
    the counters zeroed by a kernel on `stream`)."""
    config = config.validate()
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must lie in [1, {MAX_SPLITS}] for the direct decode kernel, got {num_splits}")
    group = num_q_heads // num_kv_heads
    num_tokens = q.shape[0]
    specs = workspace_specs(num_splits, num_tokens, num_q_heads, num_kv_heads, head_dim)
    if workspace is None:
        workspace = tuple(cuda.device_array(shape, dtype) if is_device_array(q) else np.zeros(shape, dtype)
                          for shape, dtype in specs)
        if is_device_array(q):
            counters = workspace[2]
            _zero_counters[ceil_div(counters.size, 128), 128, stream](counters)
    for name, part, (shape, dtype) in zip(("o_part", "ml_part", "counters"), workspace, specs):
        check_array(f"workspace {name}", part, dtypes=dtype, shape=shape)
    q_scale = np.float32(scale * LOG2_E)
    tiles = config.tiles_for(k_cache.fmt)
    grid = (num_tokens, num_kv_heads, num_splits)
    if IS_SIMULATOR:
        kernel = _twin_kernel(k_cache.fmt, head_dim, group, config.warps, tiles)
        kernel[grid, config.warps * group, stream](
            q, k_cache.quants, k_cache.scales, k_cache.extra, v_cache.quants, v_cache.scales, v_cache.extra,
            q_positions, kv_len, config.min_split_keys, q_scale, out, *workspace)
    else:
        kernel = _cpp_kernel(k_cache.fmt, head_dim, group, config.warps, tiles)
        kernel[grid, config.warps * WARP, stream](q, k_cache.quants, k_cache.scales, v_cache.quants, v_cache.scales,
                                                  q_positions, kv_len, config.min_split_keys, q_scale, out, *workspace)
    return out


@functools.cache
def _cpp_kernel(fmt: str, head_dim: int, group: int, warps: int, tiles: int):
    name = f"strata_attention_decode_{fmt}_d{head_dim}_g{group}_w{warps}_u{tiles}"
    line = f"\nSTRATA_ATTENTION_DECODE({fmt}, {head_dim}, {group}, {warps}, {tiles})\n"
    quant_ptr = tensor_core.HALF_PTR if fmt == "F16" else types.CPointer(types.uint32)
    i32, f32_ptr = tensor_core.INT32, tensor_core.FLOAT_PTR
    argtypes = (f32_ptr, quant_ptr, tensor_core.HALF_PTR, quant_ptr, tensor_core.HALF_PTR, i32, i32, _INT_PTR, i32,
                i32, types.float32, f32_ptr, f32_ptr, f32_ptr, _INT_PTR, f32_ptr)
    block = tensor_core.declare(name, argtypes, "attention_decode.cu", line)
    ffi = tensor_core.ffi()
    smem_size = shared_floats(head_dim, group, warps)
    halves_per_word = 2 if fmt == "F16" else 1  # an F16 plane's row counts halves, the C++ counts words

    @jit
    def kernel(q, k_quants, k_scales, v_quants, v_scales, q_positions, kv_len, min_keys, q_scale, out, o_part,
               ml_part, counters):
        smem = cuda.shared.array(smem_size, np.float32, alignment=16)
        block(ffi.from_buffer(q), ffi.from_buffer(k_quants), ffi.from_buffer(k_scales), ffi.from_buffer(v_quants),
              ffi.from_buffer(v_scales), np.int32(k_quants.shape[1] // halves_per_word), np.int32(k_scales.shape[1]),
              ffi.from_buffer(q_positions), np.int32(kv_len), np.int32(min_keys), np.float32(q_scale),
              ffi.from_buffer(out), ffi.from_buffer(o_part), ffi.from_buffer(ml_part), ffi.from_buffer(counters),
              ffi.from_buffer(smem))

    return kernel


@cuda.jit(device=True)
def device_split_range(position, kv_len, min_keys):
    """(begin, end, active) of this block's split (blockIdx.z) of its row: the C++ formula."""
    span = max(0, min(kv_len, position + 1))
    num_splits = cuda.gridDim.z
    share = ((span + num_splits - 1) // num_splits + TILE_KEYS - 1) // TILE_KEYS * TILE_KEYS
    keys = max(share, min_keys)
    active = max(1, (span + keys - 1) // keys)
    begin = min(cuda.blockIdx.z * keys, span)
    return begin, min(begin + keys, span), active


@cuda.jit(device=True)
def _weight(m, m_max):
    return np.float32(0.0) if m == NEG_INF else np.float32(math.exp((m - m_max) * LN_2))


@functools.cache
def _twin_kernel(fmt: str, head_dim: int, group: int, warps: int, tiles: int):
    """The simulator's kernel: thread (w, h) runs warp w's tiles for head h in f32 over f16 roundings, then
    the block combines as the C++ does (the warps in order; the last split's block, the splits in order)."""
    dequant8 = dequant8_for(fmt)
    threads = warps * group
    octets = head_dim // 8
    ws_size = 2 * MAX_SPLITS * group + group
    o_size, ml_size = warps * group * head_dim, warps * group

    @jit
    def kernel(q, k_quants, k_scales, k_extra, v_quants, v_scales, v_extra, q_positions, kv_len, min_keys, q_scale,
               out, o_part, ml_part, counters):
        tid = cuda.threadIdx.x
        w, h = tid // group, tid % group
        row, kvh, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        begin, end, active = device_split_range(q_positions[row], kv_len, min_keys)
        if split >= active:
            return
        o_s = cuda.shared.array(o_size, np.float32)
        m_s = cuda.shared.array(ml_size, np.float32)
        l_s = cuda.shared.array(ml_size, np.float32)
        w_s = cuda.shared.array(ws_size, np.float32)
        flag = cuda.shared.array(1, np.int32)
        qv = cuda.local.array(head_dim, np.float32)
        o = cuda.local.array(head_dim, np.float32)
        kv = cuda.local.array(head_dim, np.float32)
        s = cuda.local.array(TILE_KEYS, np.float32)
        wl = cuda.local.array(8, np.float32)
        head = kvh * group + h
        for d in range(head_dim):
            qv[d] = np.float32(np.float16(q[row, head * head_dim + d] * q_scale))
            o[d] = np.float32(0.0)
        m_i = NEG_INF
        l_i = np.float32(0.0)
        num_tiles = (end - begin + TILE_KEYS - 1) // TILE_KEYS
        for tile0 in range(w * tiles, num_tiles, warps * tiles):
            for tile in range(tile0, min(tile0 + tiles, num_tiles)):
                key0 = begin + TILE_KEYS * tile
                tile_max = NEG_INF
                for j in range(TILE_KEYS):
                    s[j] = NEG_INF
                    if key0 + j < end:
                        acc = np.float32(0.0)
                        for oc in range(octets):
                            dequant8(k_quants, k_scales, k_extra, key0 + j, kvh * octets + oc, wl, 0)
                            for i in range(8):
                                acc += qv[oc * 8 + i] * np.float32(np.float16(wl[i]))
                        s[j] = acc
                    tile_max = max(tile_max, s[j])
                m_new = max(m_i, tile_max)
                alpha = _weight(m_i, m_new)
                row_sum = np.float32(0.0)
                for d in range(head_dim):
                    o[d] *= alpha
                for j in range(TILE_KEYS):
                    p = _weight(s[j], m_new)
                    row_sum += p
                    if p != 0:
                        for oc in range(octets):
                            dequant8(v_quants, v_scales, v_extra, key0 + j, kvh * octets + oc, wl, 0)
                            for i in range(8):
                                kv[oc * 8 + i] = np.float32(np.float16(wl[i]))
                        p16 = np.float32(np.float16(p))
                        for d in range(head_dim):
                            o[d] += p16 * kv[d]
                l_i = l_i * alpha + row_sum
                m_i = m_new
        for d in range(head_dim):
            o_s[(w * group + h) * head_dim + d] = o[d]
        m_s[w * group + h] = m_i
        l_s[w * group + h] = l_i
        cuda.syncthreads()
        for idx in range(tid, group * head_dim, threads):
            hh, d = idx // head_dim, idx % head_dim
            m_max = NEG_INF
            for ww in range(warps):
                m_max = max(m_max, m_s[ww * group + hh])
            l_sum = np.float32(0.0)
            o_sum = np.float32(0.0)
            for ww in range(warps):
                weight = _weight(m_s[ww * group + hh], m_max)
                l_sum += l_s[ww * group + hh] * weight
                o_sum += o_s[(ww * group + hh) * head_dim + d] * weight
            if active == 1:
                out[row, (kvh * group + hh) * head_dim + d] = o_sum / l_sum if l_sum > 0 else np.float32(0.0)
            else:
                o_part[split, row, kvh * group + hh, d] = o_sum
                if d == 0:
                    ml_part[split, row, kvh, hh] = m_max
                    ml_part[split, row, kvh, 16 + hh] = l_sum
        if active == 1:
            return
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            arrived = cuda.atomic.add(counters, (row, kvh), 1)
            flag[0] = 1 if arrived == active - 1 else 0
            if arrived == active - 1:
                counters[row, kvh] = 0
        cuda.syncthreads()
        if flag[0] == 0:
            return
        for idx in range(tid, active * group, threads):
            w_s[idx] = ml_part[idx // group, row, kvh, idx % group]
            w_s[MAX_SPLITS * group + idx] = ml_part[idx // group, row, kvh, 16 + idx % group]
        cuda.syncthreads()
        if tid < group:
            m_max = NEG_INF
            for sp in range(active):
                m_max = max(m_max, w_s[sp * group + tid])
            l_sum = np.float32(0.0)
            for sp in range(active):
                weight = _weight(w_s[sp * group + tid], m_max)
                w_s[sp * group + tid] = weight
                l_sum += w_s[MAX_SPLITS * group + sp * group + tid] * weight
            w_s[2 * MAX_SPLITS * group + tid] = l_sum
        cuda.syncthreads()
        for idx in range(tid, group * head_dim, threads):
            hh, d = idx // head_dim, idx % head_dim
            acc = np.float32(0.0)
            for sp in range(active):
                acc += w_s[sp * group + hh] * o_part[sp, row, kvh * group + hh, d]
            l_tot = w_s[2 * MAX_SPLITS * group + hh]
            out[row, (kvh * group + hh) * head_dim + d] = acc / l_tot if l_tot > 0 else np.float32(0.0)

    return kernel
