"""MoE routing (softmax, top-k, renormalised weights) and grouping of routed tokens by expert.

Routing is llama.cpp's qwen3moe gating: p = softmax(router logits) over all experts, the k most
probable experts (ties to the lower id), their p divided by max(sum, 6.1e-5) when the model
normalizes weights. In a prefill chunk one thread routes one token: 128 experts x 8 picks is ~1k
comparisons, and a chunk has thousands of tokens to spread over the GPU. A few tokens (decode) get
a block each instead, each thread ranking its experts by counting the experts ahead of them (one
thread alone took ~50 µs a layer on the H200, eight block reductions of one pick each ~15 µs).
Both give the same bits: the max and the picks are exact, and the softmax sum runs in expert order
in one thread in both.

Grouping turns the T*k (token, expert) pairs into one contiguous segment per expert, in pair
order within a segment (deterministic, no atomics on global memory), plus a list of row tiles of
`block_m` pairs that the expert GEMMs (moe.py) take one block each:
    count   per chunk of pairs, an expert histogram (shared-memory atomics, exact counts);
    scan    one block: segment offsets, each chunk's write base per expert, the tile list;
    scatter per chunk, each pair's rank among earlier same-expert pairs of its chunk.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np
from numba import cuda

from ._common import (
    IS_SIMULATOR,
    ceil_div,
    check_array,
    check_positive,
    check_power_of_two,
    empty,
)
from .block_reduce import NEG_INF
from .launcher import jit

WEIGHT_SUM_FLOOR = np.float32(6.103515625e-5)  # llama.cpp clamps the top-k sum to the smallest f16 normal
_POS_INF = np.float32(np.inf)
_PAIRS_PER_THREAD = 4
_SUM_CHUNK = 8  # block_route's serial sum: shared loads issued before their adds (a load's latency a chunk, not an add)
BLOCK_ROUTE_MAX_TOKENS = 16  # up to this many tokens a block routes each token
MAX_BLOCK_ROUTE_EXPERTS = 512  # the block kernel stages a token's logits in shared memory
BLOCK_ROUTE_RANKS = 2 * MAX_BLOCK_ROUTE_EXPERTS  # block_route's rank scratch (a constant: Numba's shapes are)
_BLOCK_ROUTE_THREADS = 32 if IS_SIMULATOR else 128  # the simulator runs a Python thread per GPU thread


@functools.cache
def _route_kernel(top_k: int, is_norm: bool):
    @jit
    def route_kernel(logits, ids, weights):  # logits [T, E] -> ids, weights [T, k]
        t = cuda.grid(1)
        if t >= logits.shape[0]:
            return
        num_experts = logits.shape[1]
        top = NEG_INF
        for e in range(num_experts):
            top = max(top, logits[t, e])
        total = np.float32(0.0)
        for e in range(num_experts):
            total += np.float32(math.exp(logits[t, e] - top))
        prev, prev_id = _POS_INF, -1
        picked_sum = np.float32(0.0)
        for j in range(top_k):
            best, best_id = NEG_INF, -1
            for e in range(num_experts):
                v = logits[t, e]
                is_after = v < prev or (v == prev and e > prev_id)  # order: logit down, id up
                if is_after and (best_id < 0 or v > best):
                    best, best_id = v, e
            p = np.float32(math.exp(best - top)) / total
            ids[t, j] = best_id
            weights[t, j] = p
            picked_sum += p
            prev, prev_id = best, best_id
        if is_norm:
            denom = max(picked_sum, WEIGHT_SUM_FLOOR)
            for j in range(top_k):
                weights[t, j] = weights[t, j] / denom

    return route_kernel


@functools.cache
def block_route_device(top_k: int, is_norm: bool, threads: int):
    """device(row, num_experts, exps, ranks, scalars, ids, weights, t, tid): token t's routing from its
    ``num_experts`` logits ``row`` (shared [>= E] float32, filled and synchronized by the caller) into ids[t]
    and weights[t], by every one of the block's ``threads`` threads (it synchronizes them; the caller does
    again before it reads ids or weights). exps [>= E] float32, ranks [>= 2E] int32 and scalars [2] float32
    are the caller's shared scratch."""
    @cuda.jit(device=True)
    def block_route(row, num_experts, exps, ranks, scalars, ids, weights, t, tid):
        picked = cuda.shared.array(top_k, np.float32)  # the weights in pick order
        if tid == 0:
            scalars[0] = NEG_INF
        # an expert's place in the order (logit down, id up) is its count of experts ahead of it:
        # the first k places are the picks, the first is the max; no barrier per pick. With a thread for
        # each expert to spare, two count it, each over half the experts: half the serial loop
        num_parts = 2 if threads >= 2 * num_experts else 1
        half = (num_experts + 1) // 2
        for i in range(tid, num_parts * num_experts, threads):
            e, part = i % num_experts, i // num_experts
            v = row[e]
            rank = 0
            for j in range(part * half, num_experts if part == num_parts - 1 else half):
                w = row[j]
                if w > v or (w == v and j < e):
                    rank += 1
            ranks[i] = rank
        cuda.syncthreads()
        for e in range(tid, num_experts, threads):
            rank = ranks[e] + (ranks[num_experts + e] if num_parts == 2 else 0)
            ranks[e] = rank
            if rank == 0 and row[e] == row[e]:
                scalars[0] = row[e]
        cuda.syncthreads()
        top = scalars[0]
        for e in range(tid, num_experts, threads):
            exps[e] = np.float32(math.exp(row[e] - top))
        cuda.syncthreads()
        if tid == 0:  # in expert order, as the one-thread kernel sums; a chunk's loads issued before its adds
            total = np.float32(0.0)
            chunk = cuda.local.array(_SUM_CHUNK, np.float32)
            e = 0
            while e + _SUM_CHUNK <= num_experts:
                for i in range(_SUM_CHUNK):
                    chunk[i] = exps[e + i]
                for i in range(_SUM_CHUNK):
                    total += chunk[i]
                e += _SUM_CHUNK
            while e < num_experts:
                total += exps[e]
                e += 1
            scalars[1] = total
            for j in range(top_k):  # a place no expert takes (NaN logits): no expert
                ids[t, j] = -1
                picked[j] = np.float32(math.exp(NEG_INF - top)) / total
        cuda.syncthreads()
        total = scalars[1]
        for e in range(tid, num_experts, threads):
            if ranks[e] < top_k and row[e] == row[e]:  # a NaN logit is never picked
                ids[t, ranks[e]] = e
                picked[ranks[e]] = exps[e] / total
        cuda.syncthreads()
        if tid == 0 and is_norm:  # the weights from shared memory, not read back from global after their stores
            picked_sum = np.float32(0.0)
            for j in range(top_k):  # in pick order, as the one-thread kernel sums
                picked_sum += picked[j]
            denom = max(picked_sum, WEIGHT_SUM_FLOOR)
            for j in range(top_k):
                weights[t, j] = picked[j] / denom
        elif tid == 0:
            for j in range(top_k):
                weights[t, j] = picked[j]

    return block_route


@functools.cache
def _route_block_kernel(top_k: int, is_norm: bool, threads: int):
    block_route = block_route_device(top_k, is_norm, threads)

    @jit
    def route_block_kernel(logits, ids, weights):  # logits [T, E] -> ids, weights [T, k]; one block a token
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        num_experts = logits.shape[1]
        row = cuda.shared.array(MAX_BLOCK_ROUTE_EXPERTS, np.float32)
        exps = cuda.shared.array(MAX_BLOCK_ROUTE_EXPERTS, np.float32)
        ranks = cuda.shared.array(BLOCK_ROUTE_RANKS, np.int32)
        scalars = cuda.shared.array(2, np.float32)  # the top logit, the softmax's sum
        for e in range(tid, num_experts, threads):
            row[e] = logits[t, e]
        cuda.syncthreads()
        block_route(row, num_experts, exps, ranks, scalars, ids, weights, t, tid)

    return route_block_kernel


def moe_route(logits, top_k: int, *, norm_weights: bool = True, ids=None, weights=None, threads: int = 128,
              stream=0):
    """Top-k experts per token: logits [T, E] float32 -> ids [T, k] int32, weights [T, k] float32.

    Launch config: up to BLOCK_ROUTE_MAX_TOKENS tokens (E <= 512), grid T, block 128 threads (32 in
    the simulator), one token per block; else grid ceil(T / threads), block `threads` (default
    128), one token per thread.
    """
    check_array("logits", logits, dtypes=np.float32, ndim=2)
    num_tokens, num_experts = logits.shape
    check_positive("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} exceeds the {num_experts} experts")
    check_power_of_two("threads", threads)
    ids = empty((num_tokens, top_k), np.int32, logits) if ids is None else ids
    weights = empty((num_tokens, top_k), np.float32, logits) if weights is None else weights
    check_array("ids", ids, dtypes=np.int32, shape=(num_tokens, top_k))
    check_array("weights", weights, dtypes=np.float32, shape=(num_tokens, top_k))
    if 0 < num_tokens <= BLOCK_ROUTE_MAX_TOKENS and num_experts <= MAX_BLOCK_ROUTE_EXPERTS:
        kernel = _route_block_kernel(top_k, bool(norm_weights), _BLOCK_ROUTE_THREADS)
        kernel[num_tokens, _BLOCK_ROUTE_THREADS, stream](logits, ids, weights)
    elif num_tokens:
        _route_kernel(top_k, bool(norm_weights))[ceil_div(num_tokens, threads), threads, stream](logits, ids, weights)
    return ids, weights


class MoeGroups(NamedTuple):
    """Routed pairs grouped by expert (all device or all host arrays, int32 unless noted).

    counts [E]; offsets [E + 1]; pair_token [P] (token of the p-th grouped pair); pair_weight [P]
    float32 (its routing weight); tile_expert, tile_start, tile_rows [max_tiles] (a tile is up to
    block_m consecutive grouped pairs of one expert); num_tiles [1] (tiles in use).
    """

    block_m: int
    counts: Any
    offsets: Any
    pair_token: Any
    pair_weight: Any
    tile_expert: Any
    tile_start: Any
    tile_rows: Any
    num_tiles: Any

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.shape[0]


@functools.cache
def tile_slot_device(is_mapped: bool):
    """device(tile_expert, num_tiles, slot_of_expert, tile) -> the slot holding tile's expert, -1: skip the
    tile (past num_tiles[0], or its expert not in the batch). is_mapped: tiles name expert ids and
    slot_of_expert [N] maps them to slots; otherwise tiles name slots already (slot_of_expert unused)."""
    @cuda.jit(device=True)
    def tile_slot(tile_expert, num_tiles, slot_of_expert, tile):
        if tile >= num_tiles[0]:
            return -1
        expert = tile_expert[tile]
        return slot_of_expert[expert] if is_mapped else expert

    return tile_slot


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e ceil(count_e / block_m) over any routing of num_pairs pairs."""
    return ceil_div(num_pairs, block_m) + min(num_experts, num_pairs)


@functools.cache
def _group_kernels(num_experts: int, threads: int, top_k: int):
    chunk = threads * _PAIRS_PER_THREAD

    @jit
    def count_kernel(pair_expert, chunk_counts):  # [P] -> [C, E]
        c = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        hist = cuda.shared.array(num_experts, np.int32)
        for e in range(tid, num_experts, threads):
            hist[e] = 0
        cuda.syncthreads()
        for i in range(_PAIRS_PER_THREAD):
            p = c * chunk + i * threads + tid
            if p < pair_expert.shape[0] and 0 <= pair_expert[p] < num_experts:  # foreign ids are dropped
                cuda.atomic.add(hist, pair_expert[p], 1)
        cuda.syncthreads()
        for e in range(tid, num_experts, threads):
            chunk_counts[c, e] = hist[e]

    @jit
    def scan_kernel(chunk_counts, block_m, counts, offsets, chunk_base, tile_expert, tile_start, tile_rows, num_tiles):
        tid = cuda.threadIdx.x
        for e in range(tid, num_experts, threads):
            running = 0
            for c in range(chunk_counts.shape[0]):
                chunk_base[c, e] = running
                running += chunk_counts[c, e]
            counts[e] = running
        cuda.syncthreads()
        if tid == 0:
            offsets[0] = 0
            tiles = 0
            for e in range(num_experts):
                offsets[e + 1] = offsets[e] + counts[e]
                for s in range(0, counts[e], block_m):
                    tile_expert[tiles] = e
                    tile_start[tiles] = offsets[e] + s
                    tile_rows[tiles] = min(block_m, counts[e] - s)
                    tiles += 1
            num_tiles[0] = tiles
        cuda.syncthreads()
        for e in range(tid, num_experts, threads):
            for c in range(chunk_counts.shape[0]):
                chunk_base[c, e] += offsets[e]

    @jit
    def scatter_kernel(pair_expert, pair_weight_in, chunk_base, pair_token, pair_weight):
        c = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        cursor = cuda.shared.array(num_experts, np.int32)
        batch = cuda.shared.array(threads, np.int32)
        for e in range(tid, num_experts, threads):
            cursor[e] = chunk_base[c, e]
        for i in range(_PAIRS_PER_THREAD):
            p = c * chunk + i * threads + tid
            e = pair_expert[p] if p < pair_expert.shape[0] else -1
            e = e if e < num_experts else -1
            batch[tid] = e
            cuda.syncthreads()
            rank = 0
            for j in range(tid):
                if batch[j] == e:
                    rank += 1
            if e >= 0:
                dest = cursor[e] + rank
                pair_token[dest] = p // top_k
                pair_weight[dest] = pair_weight_in[p]
            cuda.syncthreads()
            if e >= 0:
                cuda.atomic.add(cursor, e, 1)
            cuda.syncthreads()

    return count_kernel, scan_kernel, scatter_kernel


def moe_group(ids, weights, num_experts: int, block_m: int, *, threads: int = 256,
              scratch: dict | None = None) -> MoeGroups:
    """Group the pairs of ids/weights [T, k] by expert into tiles of block_m (the GEMM's block_m).

    Ids outside [0, num_experts) are dropped. scratch: arrays by role that an earlier grouping left (a
    layer's, for the next layer of the chunk), taken where their shape and dtype fit and kept there for the
    next; the launches that read the earlier grouping must be queued on this grouping's stream before it.
    Launch config: three launches, block `threads` (default 256): count and scatter grid
    ceil(P / (4 * threads)) (a chunk of 4 pairs per thread), scan grid 1.
    """
    check_array("ids", ids, dtypes=np.int32, ndim=2)
    num_tokens, top_k = ids.shape
    check_array("weights", weights, dtypes=np.float32, shape=(num_tokens, top_k))
    check_positive("num_experts", num_experts)
    check_power_of_two("block_m", block_m)
    check_power_of_two("threads", threads)
    num_pairs = num_tokens * top_k
    num_chunks = max(1, ceil_div(num_pairs, threads * _PAIRS_PER_THREAD))
    n_tiles = max(1, max_tiles(num_pairs, num_experts, block_m))

    def alloc(role: str, shape, dtype=np.int32):
        shape = shape if isinstance(shape, tuple) else (shape,)
        found = scratch.get(role) if scratch is not None else None
        if found is None or tuple(found.shape) != shape or found.dtype != np.dtype(dtype):
            found = empty(shape, dtype, ids)
            if scratch is not None:
                scratch[role] = found
        return found

    groups = MoeGroups(block_m, alloc("counts", num_experts), alloc("offsets", num_experts + 1),
                       alloc("pair_token", max(num_pairs, 1)), alloc("pair_weight", max(num_pairs, 1), np.float32),
                       alloc("tile_expert", n_tiles), alloc("tile_start", n_tiles), alloc("tile_rows", n_tiles),
                       alloc("num_tiles", 1))
    chunk_counts = alloc("chunk_counts", (num_chunks, num_experts))
    chunk_base = alloc("chunk_base", (num_chunks, num_experts))
    count_kernel, scan_kernel, scatter_kernel = _group_kernels(num_experts, threads, top_k)
    if num_pairs:
        pair_expert, pair_weight_in = ids.reshape(num_pairs), weights.reshape(num_pairs)
    else:
        pair_expert, pair_weight_in = empty((0,), np.int32, ids), empty((0,), np.float32, ids)
    count_kernel[num_chunks, threads](pair_expert, chunk_counts)
    scan_kernel[1, threads](chunk_counts, block_m, groups.counts, groups.offsets, chunk_base, groups.tile_expert,
                            groups.tile_start, groups.tile_rows, groups.num_tiles)
    scatter_kernel[num_chunks, threads](pair_expert, pair_weight_in, chunk_base, groups.pair_token, groups.pair_weight)
    return groups
