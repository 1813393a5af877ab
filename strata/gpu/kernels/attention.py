"""Causal grouped-query attention over a KV cache (F16, Q8_0, Q4_0), prefill and decode.

One kernel serves both. A block owns `tokens_per_block` query tokens times the `group` query
heads that share one KV head, so every K/V tile it stages (dequantized from the cache into
shared memory) is used by all of them: for decode that is the whole GQA group of one token. Per
KV tile: scores into shared memory, the online-softmax update (running max m, running sum l),
then O += P V; `threads_per_row` threads share a query row, splitting the tile's keys for the
scores and the head dims for O. Query token t sits at q_positions[t] and sees cache rows
0..q_positions[t]; a chunked prefill simply has its earlier chunks in the cache.

For long contexts and few query rows (decode) the KV range is cut into `num_splits` slices, one
block each; blocks write unnormalized partials (O, m, l) and a second launch combines them.

This is the FFMA path. Decode (one query token, or decode rows) goes to attention_decode_direct.py's
kernel where that applies (head dims 64 and 128, groups of up to 8 query heads: K and V read into
tensor-core fragments, the splits combined in the same launch), else to attention_decode_mma.py's
tensor-core kernel where that applies (head dims 64 and 128, its Numba twin in the simulator), else to
attention_decode.py's (a warp per query head, each key read once for the GQA group); prefill with at least
MMA_MIN_TOKENS query tokens, one split and a head dim the tensor-core kernel serves goes to
attention_mma.py (its Numba twin in the simulator).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from . import attention_decode, attention_decode_direct, attention_decode_mma, tensor_core
from ._common import (
    IS_SIMULATOR,
    MAX_STATIC_SHARED_BYTES,
    OCTET,
    ceil_div,
    check_array,
    check_positive,
    check_power_of_two,
    empty,
    stand_in,
)
from .attention_mma import (
    SERVING_CONFIG,
    attention_mma,
    check_attention_io,
    is_supported,
)
from .block_reduce import NEG_INF
from .launcher import jit
from .packing import PackedMatrix
from .quant_device import dequant8_for


class AttentionConfig(NamedTuple):
    tokens_per_block: int = 2
    threads_per_row: int = 8
    kv_tile: int = 32


DECODE_CONFIG = AttentionConfig(tokens_per_block=1, threads_per_row=32, kv_tile=32)  # decode_config(128)
_COMBINE_UNROLL = 4  # splits whose partial outputs are loaded together (their loads in flight at once)
MAX_SPLITS = 512  # KV splits of one decode token (the combine stages their weights in shared memory)
MMA_MIN_TOKENS = 5  # fewer query tokens fill too few 64-row tensor-core tiles


def uses_tensor_cores(num_tokens: int, num_splits: int, head_dim: int, fmt: str) -> bool:
    """Whether attention() sends this call to the tensor-core prefill kernel (attention_mma.py)."""
    is_prefill = num_tokens >= MMA_MIN_TOKENS and num_splits == 1
    return is_prefill and is_supported(head_dim, fmt) and (tensor_core.is_available() or IS_SIMULATOR)


def _shared_bytes(head_dim: int, group: int, config: AttentionConfig) -> int:
    rows = config.tokens_per_block * group
    threads = rows * config.threads_per_row
    floats = rows * head_dim + config.kv_tile * (2 * head_dim + 1) + rows * config.kv_tile + 2 * threads
    return 4 * floats


def decode_config(head_dim: int, group: int = 1) -> AttentionConfig:
    """One query token per block and up to a warp per query head (group query heads share the
    block, at most 1,024 threads): every thread has work and runs the shortest chains of dependent
    loads (a decode block is latency-bound: one KV tile per split at 2k)."""
    threads_per_row = 32
    while threads_per_row > 1 and (head_dim % threads_per_row or group * threads_per_row > 1024):
        threads_per_row //= 2
    return AttentionConfig(tokens_per_block=1, threads_per_row=threads_per_row, kv_tile=32)


def default_num_splits(kv_len: int, num_kv_heads: int, num_sms: int, config: AttentionConfig = DECODE_CONFIG) -> int:
    """KV splits for one decode token: about two blocks per SM, each split at least one KV tile."""
    num_tiles = max(1, ceil_div(kv_len, config.kv_tile))
    return max(1, min(num_tiles, ceil_div(2 * num_sms, num_kv_heads), MAX_SPLITS))


@functools.cache
def _attention_kernel(fmt: str, head_dim: int, group: int, config: AttentionConfig, is_split: bool):
    dequant8 = dequant8_for(fmt)
    bt, tpr, bkv = config
    rows = bt * group
    threads = rows * tpr
    k_stride = head_dim + 1  # pad K rows: lanes reading different keys hit different banks
    octets_per_row = head_dim // OCTET
    dims_per_thread = head_dim // tpr
    keys_per_thread = bkv // tpr
    qs_size, ks_size, vs_size, ps_size = rows * head_dim, bkv * k_stride, bkv * head_dim, rows * bkv

    @jit
    def attention_kernel(q, k_quants, k_scales, k_extra, v_quants, v_scales, v_extra, q_positions, kv_len,
                         split_len, scale, out, o_part, m_part, l_part):
        tid = cuda.threadIdx.x
        r = tid // tpr
        lane = tid % tpr
        kvh = cuda.blockIdx.y
        split = cuda.blockIdx.z
        num_tokens = q.shape[0]
        t = cuda.blockIdx.x * bt + r // group
        h = kvh * group + r % group
        qs = cuda.shared.array(qs_size, np.float32)
        ks = cuda.shared.array(ks_size, np.float32)
        vs = cuda.shared.array(vs_size, np.float32)
        ps = cuda.shared.array(ps_size, np.float32)
        red_max = cuda.shared.array(threads, np.float32)
        red_sum = cuda.shared.array(threads, np.float32)
        wl = cuda.local.array(OCTET, np.float32)
        o = cuda.local.array(dims_per_thread, np.float32)
        q_pos = q_positions[t] if t < num_tokens else -1
        last_pos = -1
        for i in range(bt):
            ti = cuda.blockIdx.x * bt + i
            if ti < num_tokens:
                last_pos = max(last_pos, q_positions[ti])
        for idx in range(tid, qs_size, threads):
            ti = cuda.blockIdx.x * bt + idx // head_dim // group
            hi = kvh * group + (idx // head_dim) % group
            qs[idx] = q[ti, hi * head_dim + idx % head_dim] * scale if ti < num_tokens else np.float32(0.0)
        for c in range(dims_per_thread):
            o[c] = np.float32(0.0)
        m_i = NEG_INF
        l_i = np.float32(0.0)
        span = min(kv_len, last_pos + 1)
        split_rows = split_len
        if split_rows == 0:  # from the positions on the device: a captured step replays at any position
            split_rows = ((span + cuda.gridDim.z - 1) // cuda.gridDim.z + bkv - 1) // bkv * bkv
        start = split * split_rows
        end = min(start + split_rows, span)
        for j0 in range(start, end, bkv):
            cuda.syncthreads()  # the previous tile's readers are done with ks, vs, ps
            for idx in range(tid, bkv * octets_per_row, threads):
                jj = idx // octets_per_row
                oc = idx % octets_per_row
                if j0 + jj < end:
                    dequant8(k_quants, k_scales, k_extra, j0 + jj, kvh * octets_per_row + oc, wl, 0)
                    for i in range(OCTET):
                        ks[jj * k_stride + oc * OCTET + i] = wl[i]
                    dequant8(v_quants, v_scales, v_extra, j0 + jj, kvh * octets_per_row + oc, wl, 0)
                    for i in range(OCTET):
                        vs[jj * head_dim + oc * OCTET + i] = wl[i]
                else:
                    for i in range(OCTET):
                        ks[jj * k_stride + oc * OCTET + i] = np.float32(0.0)
                        vs[jj * head_dim + oc * OCTET + i] = np.float32(0.0)
            cuda.syncthreads()
            tile_max = NEG_INF
            for kk in range(keys_per_thread):
                jj = lane + kk * tpr
                s = NEG_INF
                if j0 + jj < end and j0 + jj <= q_pos:
                    s = np.float32(0.0)
                    for c in range(head_dim):
                        s += qs[r * head_dim + c] * ks[jj * k_stride + c]
                ps[r * bkv + jj] = s
                tile_max = max(tile_max, s)
            red_max[tid] = tile_max
            cuda.syncthreads()
            m_new = m_i
            for i in range(tpr):
                m_new = max(m_new, red_max[r * tpr + i])
            part_sum = np.float32(0.0)
            for kk in range(keys_per_thread):
                jj = lane + kk * tpr
                s = ps[r * bkv + jj]
                p = np.float32(math.exp(s - m_new)) if s != NEG_INF else np.float32(0.0)
                ps[r * bkv + jj] = p
                part_sum += p
            red_sum[tid] = part_sum
            cuda.syncthreads()
            alpha = np.float32(math.exp(m_i - m_new)) if m_i != NEG_INF else np.float32(0.0)
            tile_sum = np.float32(0.0)
            for i in range(tpr):
                tile_sum += red_sum[r * tpr + i]
            l_i = l_i * alpha + tile_sum
            for cc in range(dims_per_thread):
                o[cc] *= alpha
            for jj in range(bkv):  # dims innermost: the unrolled loop keeps o in registers
                p = ps[r * bkv + jj]
                for cc in range(dims_per_thread):
                    o[cc] += p * vs[jj * head_dim + lane + cc * tpr]
            m_i = m_new
        if t >= num_tokens:
            return
        if is_split:
            for cc in range(dims_per_thread):
                o_part[split, t, h, lane + cc * tpr] = o[cc]
            if lane == 0:
                m_part[split, t, h] = m_i
                l_part[split, t, h] = l_i
        else:
            inv_l = np.float32(1.0) / l_i if l_i > 0 else np.float32(0.0)
            for cc in range(dims_per_thread):
                out[t, h * head_dim + lane + cc * tpr] = o[cc] * inv_l

    return attention_kernel


@jit
def _combine_kernel(o_part, m_part, l_part, out):  # o_part [S, T, Hq, d] -> out [T, Hq * d]
    # each split's weight exp(m_s - m) is computed once into shared memory (not once per output
    # dimension): the loop over splits is then independent loads, not a chain of exps
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    num_splits = o_part.shape[0]
    head_dim = o_part.shape[3]
    ms = cuda.shared.array(MAX_SPLITS, np.float32)
    ws = cuda.shared.array(MAX_SPLITS, np.float32)
    lws = cuda.shared.array(MAX_SPLITS, np.float32)
    for s in range(tid, num_splits, cuda.blockDim.x):
        ms[s] = m_part[s, t, h]
    cuda.syncthreads()
    m = NEG_INF
    for s in range(num_splits):
        m = max(m, ms[s])
    for s in range(tid, num_splits, cuda.blockDim.x):
        w = np.float32(math.exp(ms[s] - m)) if ms[s] != NEG_INF else np.float32(0.0)
        ws[s] = w
        lws[s] = l_part[s, t, h] * w
    cuda.syncthreads()
    total_l = np.float32(0.0)
    for s in range(num_splits):
        total_l += lws[s]
    for c in range(tid, head_dim, cuda.blockDim.x):
        acc = cuda.local.array(_COMBINE_UNROLL, np.float32)
        for u in range(_COMBINE_UNROLL):
            acc[u] = np.float32(0.0)
        s0 = 0
        while s0 + _COMBINE_UNROLL <= num_splits:
            for u in range(_COMBINE_UNROLL):
                acc[u] += o_part[s0 + u, t, h, c] * ws[s0 + u]
            s0 += _COMBINE_UNROLL
        for s in range(s0, num_splits):
            acc[0] += o_part[s, t, h, c] * ws[s]
        total = np.float32(0.0)
        for u in range(_COMBINE_UNROLL):
            total += acc[u]
        out[t, h * head_dim + c] = total / total_l if total_l > 0 else np.float32(0.0)


def split_partial_shapes(num_splits: int, num_tokens: int, num_q_heads: int, head_dim: int) -> tuple:
    """Shapes of a split attention's workspace: o_part [S, T, Hq, d], m_part and l_part [S, T, Hq]."""
    return ((num_splits, num_tokens, num_q_heads, head_dim), (num_splits, num_tokens, num_q_heads),
            (num_splits, num_tokens, num_q_heads))


def is_direct_decode(head_dim: int, group: int, k_cache: PackedMatrix | None = None, is_asked: bool = True) -> bool:
    """Whether attention() sends decode calls over ``k_cache`` (its planes' alignment; None: any the
    allocator gives) to attention_decode_direct.py's kernel."""
    return is_asked and attention_decode_direct.is_supported(head_dim, group, k_cache)


def decode_num_splits(kv_len: int, num_kv_heads: int, head_dim: int, group: int, num_sms: int,
                      is_direct: bool = True, k_cache: PackedMatrix | None = None) -> int:
    """KV splits of a decode launch over kv_len cells of ``k_cache``, for the kernel attention() picks."""
    if is_direct_decode(head_dim, group, k_cache, is_direct):
        return attention_decode_direct.default_num_splits(kv_len, num_kv_heads, num_sms)
    return default_num_splits(kv_len, num_kv_heads, num_sms)


def decode_workspace_specs(num_splits: int, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                           is_direct: bool = True, k_cache: PackedMatrix | None = None) -> tuple:
    """(shape, dtype) of each array of a decode call's split workspace over ``k_cache``, for the kernel
    attention() picks (the direct kernel's int32 counters must start at zero; the other kernels ignore
    theirs with one split)."""
    if is_direct_decode(head_dim, num_q_heads // num_kv_heads, k_cache, is_direct):
        return attention_decode_direct.workspace_specs(num_splits, num_tokens, num_q_heads, num_kv_heads, head_dim)
    return tuple((shape, np.float32) for shape in split_partial_shapes(num_splits, num_tokens, num_q_heads, head_dim))


def attention(q, k_cache: PackedMatrix, v_cache: PackedMatrix, q_positions, out=None, *, num_q_heads: int,
              num_kv_heads: int, head_dim: int, kv_len: int | None = None, scale: float | None = None,
              num_splits: int = 1, config: AttentionConfig = AttentionConfig(), workspace=None,
              is_len_from_positions: bool = False, is_decode_rows: bool = False, stream=0, f16_scratch=None,
              use_direct_decode: bool = True):
    """softmax(q k^T * scale + causal mask) v per query head; q, out [T, num_q_heads * head_dim] float32.

    k_cache / v_cache: [num_positions, num_kv_heads * head_dim] in F16, Q8_0 or Q4_0 (kvcache.py).
    q_positions: [T] int32. kv_len: cache rows in use (> every position); needed when q_positions
    is on the device. num_splits > 1 splits the KV range over blocks and combines (decode);
    workspace: optional preallocated (o_part [S, T, Hq, d], m_part [S, T, Hq], l_part [S, T, Hq]).
    is_len_from_positions: the KV range ends after the last query position, read on the device, and
    the splits divide that range (kv_len only bounds it): the launch's arguments do not depend on
    the position, so a captured decode step replays at any position.
    is_decode_rows: each of the T query rows is attended exactly as a one-token call of it would be
    (the decode kernels below, a block row per query row; config's tokens_per_block must be 1): a
    speculative verify's rows then have the bits of plain decode.
    stream: 0 (the default stream), a Numba stream or a graph builder capturing the launches.
    f16_scratch: (K, V) F16 matrices for the tensor-core prefill of a quantized cache (attention_mma).
    use_direct_decode: decode calls go to attention_decode_direct.py's kernel where it serves them
    (``is_direct_decode``; its workspace is decode_workspace_specs'; the length always comes from the
    positions); False keeps the kernels below (the previous decode path).

    Prefill (see uses_tensor_cores) runs attention_mma() instead, config unused, inputs rounded to f16.

    Launch config: grid (ceil(T / tokens_per_block), num_kv_heads, num_splits), block
    tokens_per_block * group * threads_per_row threads; static shared memory (rows * head_dim +
    kv_tile * (2 * head_dim + 1) + rows * kv_tile + 2 * threads) float32 with rows =
    tokens_per_block * group, at most 48 KiB (44 KiB for the default at head_dim 128, group 8).
    One token (or is_decode_rows) where attention_decode_mma.is_supported: its kernel, grid (T,
    num_kv_heads, num_splits), block attention_decode_mma.threads() (4 warps on a GPU), inputs rounded
    to f16 as in prefill; else where attention_decode.is_supported: attention_decode's kernel, grid (T,
    num_kv_heads, num_splits), block group * 32 threads (config is still validated, and its kv_tile rounds a
    split length given by kv_len). With num_splits > 1 a second launch combines: grid (T,
    num_q_heads), block min(head_dim, 128).
    """
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("num_splits", num_splits)):
        check_positive(name, value)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits {num_splits} exceeds {MAX_SPLITS}")
    group = num_q_heads // num_kv_heads
    bt, tpr, bkv = config
    for name, value in zip(AttentionConfig._fields, config):
        check_power_of_two(name, value)
    if head_dim % OCTET or head_dim % tpr or bkv % tpr:
        raise ValueError(f"head_dim {head_dim} and kv_tile {bkv} must be multiples of threads_per_row {tpr} and of 8")
    num_shared_bytes = _shared_bytes(head_dim, group, config)
    if num_shared_bytes > MAX_STATIC_SHARED_BYTES:
        raise ValueError(f"this config needs {num_shared_bytes} bytes of shared memory per block (limit "
                         f"{MAX_STATIC_SHARED_BYTES}): lower tokens_per_block or kv_tile")
    num_tokens, kv_len, out = check_attention_io(q, k_cache, v_cache, q_positions, out, kv_len, num_q_heads,
                                                 num_kv_heads, head_dim)
    if num_tokens == 0:
        return out
    is_decode = num_tokens == 1 or is_decode_rows
    if num_tokens > 1 and is_decode_rows and bt != 1:  # the FFMA kernel's blocks would share their rows' keys
        raise ValueError(f"decode rows take a config of one token per block, got tokens_per_block {bt}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if is_decode and is_direct_decode(head_dim, group, k_cache, use_direct_decode):
        return attention_decode_direct.attention_decode(
            q, k_cache, v_cache, q_positions, out, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, kv_len=kv_len, num_splits=num_splits, scale=scale, workspace=workspace, stream=stream)
    if not is_decode and uses_tensor_cores(num_tokens, num_splits, head_dim, k_cache.fmt):
        return attention_mma(q, k_cache, v_cache, q_positions, out, num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, kv_len=kv_len, scale=scale,
                             config=SERVING_CONFIG, f16_scratch=f16_scratch)
    split_len = 0 if is_len_from_positions else ceil_div(ceil_div(max(kv_len, 1), num_splits), bkv) * bkv
    is_split = num_splits > 1
    if is_split:
        shapes = split_partial_shapes(num_splits, num_tokens, num_q_heads, head_dim)
        if workspace is None:
            workspace = tuple(empty(shape, np.float32, q) for shape in shapes)
        for name, part, shape in zip(("o_part", "m_part", "l_part"), workspace, shapes):
            check_array(f"workspace {name}", part, dtypes=np.float32, shape=shape)
    else:
        workspace = (stand_in(out, np.float32, 4), stand_in(out, np.float32, 3), stand_in(out, np.float32, 3))
    if is_decode and attention_decode_mma.is_supported(head_dim, group):
        is_twin = not tensor_core.is_available()
        kernel = attention_decode_mma.decode_kernel(k_cache.fmt, head_dim, group, is_split, is_twin)
        grid, threads = (num_tokens, num_kv_heads, num_splits), attention_decode_mma.threads(head_dim, group, is_twin)
    elif is_decode and attention_decode.is_supported(head_dim, group):
        kernel = attention_decode.decode_kernel(k_cache.fmt, head_dim, group, is_split)
        grid, threads = (num_tokens, num_kv_heads, num_splits), group * attention_decode.WARP
    else:
        kernel = _attention_kernel(k_cache.fmt, head_dim, group, config, is_split)
        grid, threads = (ceil_div(num_tokens, bt), num_kv_heads, num_splits), bt * group * tpr
    kernel[grid, threads, stream](q, k_cache.quants, k_cache.scales, k_cache.extra, v_cache.quants, v_cache.scales,
                                  v_cache.extra, q_positions, kv_len, split_len, np.float32(scale), out, *workspace)
    if is_split:
        _combine_kernel[(num_tokens, num_q_heads), min(head_dim, 128), stream](*workspace, out)
    return out
