"""Kernel benchmarks at Qwen3-30B-A3B shapes: `python -m strata.bench.kernels [--tiny] [--expert-formats F,...]`.

Rows: decode GEMVs per format and path (the linked C++ rows and the Numba kernel: GB/s against the
measured 3.9 TB/s HBM copy, timed as 20 launches replayed in one CUDA graph, as decode runs them, each
launch reading another copy of the weights (one token's experts: other experts; decode attention: another
cache) so that they come from HBM, not L2: ROTATION_BYTES), the dense
layers' GEMVs over --x-rows rows of activations (default 3: a depth-2 verify step's; the weights read once) and,
for the routed experts of each --expert-formats format (default Q4_0), one token's routed experts, the
prefill expert products for chunks of 512 / 2,048 / 8,192 tokens routed
top-8 (TFLOP/s of the two bound launches' GPU time, queued back to back behind a GPU wait so that no
launch's host cost is counted, on X as the main loop reads it, float16 for the fused loop; then gate/up
and down each alone, the two as plain calls with the first launch's host cost, and the whole call of
moe_experts_prefill, whose checks and copy of X to float16 run before the first launch), causal attention prefill at
4k / 32k (TFLOP/s), decode attention at positions 2k / 8k / 32k of the benchmark configs' 34,816-cell cache as
the captured decode step launches it (GB/s of KV read, graph-timed; the direct kernel against its bars,
then the tile kernels it replaced), one resident decode layer and a
whole decode token (48 layers, head, sampling) as plain launches, and the launches per token. Each
figure is the median of --repeats CUDA-event timings after --warmup runs. Weights are random packed
planes (fp16 scales kept small and finite), never read from a model. --tiny shrinks every shape so the
script runs under the CUDA simulator, where the figures mean nothing (it checks that the script still
works).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from typing import Callable, NamedTuple

import numpy as np
from numba import cuda

from strata.backend.ops import DECODE_MAX_ROWS
from strata.bench.provenance import code_identity
from strata.gpu.graphs import capture_graph
from strata.gpu.kernels import moe_rows, tensor_core
from strata.gpu.kernels._common import IS_SIMULATOR
from strata.gpu.kernels.attention import (
    DECODE_CONFIG,
    AttentionConfig,
    attention,
    decode_num_splits,
    decode_workspace_specs,
    default_num_splits,
    is_direct_decode,
)
from strata.gpu.kernels.decode_route import decode_route
from strata.gpu.kernels.gemm import staged_input
from strata.gpu.kernels.gemm_config import GemmConfig, MmaConfig, default_config
from strata.gpu.kernels.gemv import GemvConfig, gemv, gemv_rows
from strata.gpu.kernels.gemv_multi import gemv_multi
from strata.gpu.kernels.gemv_native import LAYER_CONFIG, head_config
from strata.gpu.kernels.kvcache import append_kv, empty_kv_layer
from strata.gpu.kernels.moe import (
    moe_experts_decode,
    moe_experts_prefill,
    moe_prefill_launches,
    prefill_tile_rows,
)
from strata.gpu.kernels.moe_route import moe_group, moe_route
from strata.gpu.kernels.packing import FORMATS, PackedMatrix, plane_shapes
from strata.gpu.kernels.rope import head_norm_rope
from strata.gpu.kernels.sample import sample

HBM_BYTES_PER_S = 3.9e12  # Numba copy kernel, read + write, measured on the reference H200
TARGET_GEMV_RATIO = 0.70
TARGET_GEMM_FLOPS = 150e12
TARGET_ATTENTION_FLOPS = 100e12
# decode attention's bars (of the cache bytes read): from LONG_DECODE_CONTEXT on per format, below it one ratio
TARGET_DECODE_ATTENTION_RATIOS = {"F16": 0.70, "Q8_0": 0.60, "Q4_0": 0.60}
LONG_DECODE_CONTEXT, SHORT_DECODE_RATIO = 32768, 0.30
# qkv GEMV; q/k norm + rope + KV write; attention + combine; o; norm + router + route (decode_route); 2 expert
DECODE_LAUNCHES_PER_LAYER = 8
DECODE_LAUNCHES_OUTSIDE = 4  # embedding, final norm + head GEMV (fused), 2 sampling launches
GRAPH_LAUNCHES = 20  # launches a graph-timed figure replays
# A figure's launches rotate over copies of their weights (experts: over routings) this many bytes apart: the same
# 5 MB matrix read twenty times in a row comes from L2 after the first read (50 MB on the H100, 60 on the H200),
# which a decode token, reading each of its 1.7 GB of weights once, never does
ROTATION_BYTES = 128 * 2**20


class Shapes(NamedTuple):
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    ffn: int
    top_k: int
    vocab: int
    num_layers: int
    prefill_tokens: tuple  # chunk sizes whose tokens are routed top_k each
    prefill_contexts: tuple
    decode_contexts: tuple
    decode_cells: int  # the KV cache decode attention runs over (its splits are sized for all of it)
    num_sms: int
    gemv_cols: int  # K of the GEMV rows: the hidden size (tiny: one Q4_K super-block)
    aux_threads: int  # block size of the small kernels (routing, grouping, KV append); 0: their defaults


# decode_cells: the benchmark configs' context_tokens (configs/bench-h200.toml)
QWEN3_30B = Shapes(2048, 32, 4, 128, 128, 768, 8, 151936, 48, (512, 2048, 8192), (4096, 32768), (2048, 8192, 32768),
                   34816, 132, 2048, 0)
TINY = Shapes(32, 4, 2, 16, 3, 32, 2, 40, 2, (4,), (12,), (20,), 24, 2, 256, 8)
TINY_GEMV = GemvConfig(threads=32, lanes_per_row=8, rows_per_group=4)
TINY_GEMM = GemmConfig(block_m=8, block_n=8, thread_m=2, thread_n=2)
TINY_PREFILL = AttentionConfig(tokens_per_block=2, threads_per_row=4, kv_tile=8)
TINY_DECODE = AttentionConfig(tokens_per_block=1, threads_per_row=4, kv_tile=8)


class Row(NamedTuple):
    name: str
    figure: float
    unit: str
    ceiling: float | None  # same unit; None where the row is a count or a latency
    target: float | None  # ratio the issue asks for


def random_packed(fmt: str, num_rows: int, num_cols: int, rng: np.random.Generator) -> PackedMatrix:
    """Device planes of random quants with small finite fp16 scales (float formats: N(0, 1/32))."""
    planes = {}
    for plane, (shape, dtype) in plane_shapes(fmt, num_rows, num_cols).items():
        if np.dtype(dtype).kind == "f":
            host = (rng.standard_normal(shape, dtype=np.float32) / 32).astype(dtype)
        else:
            host = rng.integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype, endpoint=True)
        planes[plane] = cuda.to_device(host)
    placeholder = {"quants": np.uint32, "scales": np.float16, "extra": np.uint8}
    for plane, dtype in placeholder.items():
        planes.setdefault(plane, cuda.to_device(np.zeros((1, 1), dtype)))
    return PackedMatrix(fmt, num_rows, num_cols, planes["quants"], planes["scales"], planes["extra"])


def _aux(s: Shapes) -> dict:
    return {"threads": s.aux_threads} if s.aux_threads else {}


QUEUE_AHEAD_US = 2000  # a GPU wait longer than the host takes to queue any benchmarked call's launches
_MAX_QUEUE_AHEAD_US = 64 * QUEUE_AHEAD_US


@cuda.jit
def _gpu_wait_kernel(num_us):  # one thread sleeping num_us microseconds (nanosleep: roughly)
    for _ in range(num_us):
        cuda.nanosleep(1000)


def median_ms(fn: Callable[[], object], warmup: int, repeats: int, is_queued: bool = False) -> float:
    """Median milliseconds between CUDA events around fn. is_queued: each timed call is queued behind a
    GPU wait, so that the host cost of its launches (Numba's argument handling, up to ~100 µs a launch)
    overlaps the wait instead of falling between the events: fn's GPU time (queued_ms)."""
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    wait_us = QUEUE_AHEAD_US
    while len(times) < repeats:
        if IS_SIMULATOR:  # simulator events record no time: wall clock, meaningless but alive
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = cuda.event(), cuda.event()
        if is_queued:
            _gpu_wait_kernel[1, 1](wait_us)
        start.record()
        fn()
        is_overrun = is_queued and start.query()  # the wait ended before fn was queued: host time counted
        end.record()
        end.synchronize()
        if is_overrun:  # nanosleep may sleep less than asked: wait longer and time this call again
            if wait_us >= _MAX_QUEUE_AHEAD_US:
                raise RuntimeError(f"the host still queued the timed call after a {wait_us} µs GPU wait: the call "
                                   "synchronizes, or the host is too slow to time its GPU work with "
                                   "median_ms(is_queued)")
            wait_us *= 2
            continue
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def queued_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Milliseconds of GPU time of fn's launches (median_ms with is_queued)."""
    return median_ms(fn, warmup, repeats, is_queued=True)


def device_randn(shape, rng, scale=1.0, dtype=np.float32):
    return cuda.to_device((rng.standard_normal(shape) * scale).astype(dtype))


def num_copies(num_bytes: int) -> int:
    """Copies of what a launch reads (``num_bytes``) for the launches of a figure to rotate over, so that a copy
    comes back only after ROTATION_BYTES of others: one in the simulator, where nothing is timed. A figure replays
    at least this many launches (``num_launches``)."""
    return 1 if IS_SIMULATOR else max(1, -(-ROTATION_BYTES // max(1, int(num_bytes))))


def num_launches(copies: int) -> int:
    """Launches a graph-timed figure replays to use each of ``copies`` once."""
    return max(GRAPH_LAUNCHES, copies)


def rotating(items: list) -> Callable[[], object]:
    """A function returning the next of ``items`` at each call, in turn."""
    cycle = itertools.cycle(items)
    return lambda: next(cycle)


def device_copy(a):
    """A device array with ``a``'s shape, dtype and values, at an address of its own (a device-to-device copy)."""
    out = cuda.device_array_like(a)
    out.copy_to_device(a)
    return out


def packed_copies(w: PackedMatrix, count: int) -> list:
    """``w`` and count - 1 device copies of it: the same values at other addresses (L2 keeps addresses)."""
    return [w] + [w._replace(quants=device_copy(w.quants), scales=device_copy(w.scales), extra=device_copy(w.extra))
                  for _ in range(count - 1)]


def graph_ms(launch: Callable[[object], object], timing, count: int = GRAPH_LAUNCHES) -> float:
    """Milliseconds per call of launch(stream) when `count` calls replay as one CUDA graph, as decode
    runs them (a plain launch costs more host time than these kernels take); plain calls in the
    simulator, which has no graphs."""
    if IS_SIMULATOR:
        return median_ms(lambda: launch(0), *timing)
    builder_of = {}

    @contextlib.contextmanager
    def launching_on(builder):
        builder_of["stream"] = builder
        yield

    segment = capture_graph(lambda: [launch(builder_of["stream"]) for _ in range(count)], launching_on,
                            lambda: contextlib.nullcontext([]))
    try:
        return median_ms(segment.replay, *timing) / count
    finally:
        segment.close()


def path_name(native: bool) -> str:
    return "C++ rows" if native else "Numba"


def bench_gemv(s: Shapes, fmt: str, num_rows: int, num_cols: int, cfg: GemvConfig, native: bool, timing,
               num_x_rows: int = 1) -> Row:
    """A decode GEMV as the engine launches it; over ``num_x_rows`` rows of activations in one launch (a verify
    step's dense layers) where more than one: the weights read once, so against the one-row row of the same
    shape its GB/s says what the extra rows cost."""
    rng = np.random.default_rng(1)
    w = random_packed(fmt, num_rows, num_cols, rng)
    copies = packed_copies(w, num_copies(w.nbytes))
    next_w = rotating(copies)
    if num_x_rows == 1:
        x, y = device_randn(num_cols, rng), cuda.device_array(num_rows, np.float32)
        native_config = head_config(fmt) if num_rows == s.vocab else LAYER_CONFIG
        product, shape = gemv, ""
    else:
        x, y = device_randn((num_x_rows, num_cols), rng), cuda.device_array((num_x_rows, num_rows), np.float32)
        native_config, product, shape = LAYER_CONFIG, gemv_rows, f" at {num_x_rows} rows of x"
    ms = graph_ms(lambda stream: product(next_w(), x, y, config=cfg, native=native, native_config=native_config,
                                         stream=stream), timing, num_launches(len(copies)))
    num_bytes = w.nbytes + 4 * num_x_rows * (num_cols + num_rows)
    return Row(f"decode GEMV {fmt} {num_rows}x{num_cols}{shape}, {path_name(native)}", num_bytes / ms / 1e6, "GB/s",
               HBM_BYTES_PER_S / 1e9, TARGET_GEMV_RATIO)


def bench_moe_decode(s: Shapes, experts, cfg: GemvConfig, native: bool, timing) -> Row:
    """One token's routed experts (gate, up, down of top_k distinct experts of the stack); the launches rotate over
    routings that share no expert with the launches just before, as far as the stack allows (routed_ids)."""
    rng = np.random.default_rng(7)
    x = device_randn((1, s.hidden), rng)
    num_bytes = s.top_k * sum(w.nbytes for w in experts) // s.num_experts
    routings = routed_ids(s, 1, num_copies(num_bytes), rng)
    next_ids = rotating(routings)
    weights = cuda.to_device(np.full((1, s.top_k), 1.0 / s.top_k, np.float32))
    out, hidden = cuda.device_array((1, s.hidden), np.float32), cuda.device_array((s.top_k, s.ffn), np.float32)
    ms = graph_ms(lambda stream: moe_experts_decode(x, next_ids(), weights, *experts, out, num_experts=s.num_experts,
                                                    hidden=hidden, config=cfg, native=native, stream=stream), timing,
                  num_launches(len(routings)))
    return Row(f"decode experts {experts[0].fmt}, top-{s.top_k} of {s.num_experts}, {path_name(native)}",
               num_bytes / ms / 1e6, "GB/s", HBM_BYTES_PER_S / 1e9, TARGET_GEMV_RATIO)


def routed_ids(s: Shapes, num_tokens: int, count: int, rng) -> list:
    """``count`` routings [num_tokens, top_k] int32 on the device, each token's experts distinct, taken in turn from
    shuffles of the whole stack: consecutive routings share no expert until a shuffle is used up."""
    per_routing = num_tokens * s.top_k
    order = np.concatenate([rng.permutation(s.num_experts) for _ in range(-(-count * per_routing // s.num_experts)
                                                                             + 1)])
    routings = []
    for i in range(count):
        chunk = order[i * per_routing:(i + 1) * per_routing].reshape(num_tokens, s.top_k)
        for t, row in enumerate(chunk):
            if len(set(row.tolist())) < s.top_k:  # a token across two shuffles may repeat an expert: drawn again
                chunk[t] = rng.choice(s.num_experts, s.top_k, replace=False)
        routings.append(cuda.to_device(chunk.astype(np.int32)))
    return routings


def make_experts(s: Shapes, fmt: str, rng) -> tuple:
    return (random_packed(fmt, s.num_experts * s.ffn, s.hidden, rng),
            random_packed(fmt, s.num_experts * s.ffn, s.hidden, rng),
            random_packed(fmt, s.num_experts * s.hidden, s.ffn, rng))


def bench_moe_prefill(s: Shapes, experts, num_tokens: int, cfg, timing, down_cfg=None,
                      block_m: int | None = None) -> list:
    """Rows: both launches back to back, GPU time (the bar), each alone, the two as plain calls (the first
    launch's host cost counted), the whole moe_experts_prefill call, the grouping. down_cfg: the down
    launch's own tiles (moe_prefill_launches' down_config). cfg None: the engine's choice for groups of
    block_m pairs (moe_rows' kernels where they apply, else the default tiles)."""
    if cfg is None and block_m is None:
        raise ValueError("bench_moe_prefill: cfg None (the engine's kernels) needs the groups' block_m")
    rng = np.random.default_rng(2)
    num_pairs = num_tokens * s.top_k
    block_m = cfg.block_m if cfg is not None else block_m
    fmts = tuple(w.fmt for w in experts)
    tiles = cfg or default_config(*fmts, block_m=block_m)  # the tile kernels' config (or moe_rows' fallback)
    x = device_randn((num_tokens, s.hidden), rng)
    ids, weights = moe_route(device_randn((num_tokens, s.num_experts), rng), s.top_k, **_aux(s))
    out = cuda.to_device(np.zeros((num_tokens, s.hidden), np.float32))
    hidden = cuda.device_array((num_pairs, s.ffn), np.float32 if isinstance(tiles, GemmConfig) else np.float16)
    group_ms = median_ms(lambda: moe_group(ids, weights, s.num_experts, block_m, **_aux(s)), *timing)
    groups = moe_group(ids, weights, s.num_experts, block_m, **_aux(s))
    wrapper_ms = median_ms(lambda: moe_experts_prefill(x, groups, *experts, out, num_experts=s.num_experts,
                                                       hidden=hidden, config=cfg, down_config=down_cfg), *timing)
    # the two launches bound once and queued back to back behind a GPU wait: the expert products' GPU time;
    # then each alone (gate and up are 2 of the 3 products, down the third), and the two as plain calls, which
    # adds the first launch's host cost. The whole call also checks its arguments and, for the fused loop and
    # the rows kernels, copies X to float16 first (the rows kernels' launches are bound to a staged copy:
    # moe_rows.stage_x).
    is_rows = cfg is None and moe_rows.is_supported(groups, *experts)
    x_staged = x if is_rows else staged_input(x, tiles, experts[0].fmt, experts[1].fmt)  # float16 for the fused loop
    gate_up, down = moe_prefill_launches(x_staged, groups, *experts, out, num_experts=s.num_experts, hidden=hidden,
                                         config=cfg, down_config=down_cfg)
    ms = queued_ms(lambda: (gate_up(), down()), *timing)
    gate_up_ms, down_ms = queued_ms(gate_up, *timing), queued_ms(down, *timing)
    plain_ms = median_ms(lambda: (gate_up(), down()), *timing)
    flops = 2.0 * num_pairs * 3 * s.ffn * s.hidden
    if is_rows:
        path = "tensor cores, weight rows on M"
    else:
        path = ("tensor cores" if isinstance(cfg, MmaConfig) and cfg.is_native
                else "FFMA" if isinstance(cfg, GemmConfig)
                else "mma twin" if cfg is not None else "default tiles")
    name = f"prefill experts {experts[0].fmt} ({path}, {block_m}-row tiles), {num_tokens} tokens x top-{s.top_k}"
    return [Row(name, flops / ms / 1e9, "TFLOP/s", TARGET_GEMM_FLOPS / 1e12, 1.0),
            Row(f"  gate and up alone ({gate_up_ms * 1e3:.0f} us)", flops * 2 / 3 / gate_up_ms / 1e9, "TFLOP/s", None,
                None),
            Row(f"  down alone ({down_ms * 1e3:.0f} us)", flops / 3 / down_ms / 1e9, "TFLOP/s", None, None),
            Row(f"  the two as plain calls, the first launch's host cost counted ({plain_ms * 1e3:.0f} us)",
                flops / plain_ms / 1e9, "TFLOP/s", None, None),
            Row(f"  whole moe_experts_prefill call ({wrapper_ms * 1e3:.0f} us)",
                flops / wrapper_ms / 1e9, "TFLOP/s", None, None),
            Row(f"  grouping of {num_pairs} pairs (3 launches)", group_ms * 1e3, "us", None, None)]


def _filled_cache(s: Shapes, fmt: str, num_positions: int, rng):
    k_cache, v_cache = empty_kv_layer(fmt, num_positions, s.num_kv_heads * s.head_dim)
    width, chunk = s.num_kv_heads * s.head_dim, 4096
    for p0 in range(0, num_positions, chunk):
        n = min(chunk, num_positions - p0)
        kv = device_randn((n, width), rng)
        append_kv(k_cache, v_cache, kv, kv, cuda.to_device(np.arange(p0, p0 + n, dtype=np.int32)), **_aux(s))
    return k_cache, v_cache


def bench_attention_prefill(s: Shapes, context: int, fmt: str, cfg: AttentionConfig, timing) -> Row:
    """Causal prefill over a cache of ``fmt``; a quantized cache takes the serving path, dequantized
    into an F16 copy first (timed with it)."""
    rng = np.random.default_rng(3)
    k_cache, v_cache = _filled_cache(s, fmt, context, rng)
    scratch = empty_kv_layer("F16", context, s.num_kv_heads * s.head_dim) if fmt != "F16" else None
    q = device_randn((context, s.num_q_heads * s.head_dim), rng)
    positions = cuda.to_device(np.arange(context, dtype=np.int32))
    out = cuda.device_array(q.shape, np.float32)
    args = dict(num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, kv_len=context, config=cfg,
                f16_scratch=scratch)
    ms = median_ms(lambda: attention(q, k_cache, v_cache, positions, out, **args), *timing)
    flops = 4.0 * s.head_dim * s.num_q_heads * context * (context + 1) / 2
    return Row(f"attention prefill {fmt} cache, causal {context}", flops / ms / 1e9, "TFLOP/s",
               TARGET_ATTENTION_FLOPS / 1e12, 1.0)


def bench_attention_decode(s: Shapes, fmt: str, cfg: AttentionConfig, timing) -> list:
    """One token's attention at each decode context as the engine's captured decode step launches it: a cache
    of s.decode_cells, splits sized for all of it, the KV length read from the position on the device, a
    preallocated workspace; timed as launches replayed in a CUDA graph. The direct kernel's rows (where it
    serves the shapes), then the tile kernels' (attention_decode_mma's, the previous path) for comparison. The
    launches rotate over copies of the cache (num_copies of the bytes read), as a token's layers each read their
    own."""
    rng = np.random.default_rng(4)
    k_cache, v_cache = _filled_cache(s, fmt, s.decode_cells, rng)
    q = device_randn((1, s.num_q_heads * s.head_dim), rng)
    out = cuda.device_array(q.shape, np.float32)
    group = s.num_q_heads // s.num_kv_heads
    rows = []
    for is_direct in (True, False):
        if is_direct and not is_direct_decode(s.head_dim, group, k_cache):
            continue
        splits = decode_num_splits(s.decode_cells, s.num_kv_heads, s.head_dim, group, s.num_sms) if is_direct \
            else default_num_splits(s.decode_cells, s.num_kv_heads, s.num_sms, cfg)
        specs = decode_workspace_specs(splits, 1, s.num_q_heads, s.num_kv_heads, s.head_dim, is_direct)
        workspace = tuple(cuda.to_device(np.zeros(shape, dtype)) for shape, dtype in specs)
        args = dict(num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                    kv_len=s.decode_cells, num_splits=splits, config=cfg, workspace=workspace,
                    is_len_from_positions=True, use_direct_decode=is_direct)
        kernel = "direct" if is_direct else "tiles"
        for context in s.decode_contexts:
            positions = cuda.to_device(np.array([context - 1], np.int32))
            num_bytes = 2 * k_cache.nbytes * context / k_cache.num_rows  # the K and V rows up to the position
            count = num_copies(num_bytes)
            caches = list(zip(packed_copies(k_cache, count), packed_copies(v_cache, count)))
            next_cache = rotating(caches)
            ms = graph_ms(lambda stream: attention(q, *next_cache(), positions, out, stream=stream, **args), timing,
                          num_launches(len(caches)))
            target = TARGET_DECODE_ATTENTION_RATIOS[fmt] if context >= LONG_DECODE_CONTEXT else SHORT_DECODE_RATIO
            rows.append(Row(f"attention decode {fmt}, position {context} of {s.decode_cells}, {kernel}, "
                            f"{splits} splits ({ms * 1e3:.1f} us)", num_bytes / ms / 1e6, "GB/s", HBM_BYTES_PER_S / 1e9,
                            target if is_direct else None))
    return rows


def bench_decode_layer(s: Shapes, experts, fmt: str, gemv_cfg: GemvConfig, attn_cfg: AttentionConfig, timing) -> list:
    """One resident qwen3moe layer at decode, as its DECODE_LAUNCHES_PER_LAYER plain launches; the token sits
    at the first decode context (2k)."""
    rng = np.random.default_rng(5)
    d, hq, hk = s.head_dim, s.num_q_heads, s.num_kv_heads
    wq, wk, wv = (random_packed(fmt, n * d, s.hidden, rng) for n in (hq, hk, hk))
    wo = random_packed(fmt, s.hidden, hq * d, rng)
    router = random_packed("F32", s.num_experts, s.hidden, rng)
    context = s.decode_contexts[0]
    k_cache, v_cache = _filled_cache(s, "F16", context + 1, rng)
    x = device_randn((1, s.hidden), rng)
    ones = cuda.to_device(np.ones(s.hidden, np.float32))
    head_ones = cuda.to_device(np.ones(d, np.float32))
    q, k, v = (cuda.device_array((1, n * d), np.float32) for n in (hq, hk, hk))
    attn_out = cuda.device_array((1, hq * d), np.float32)
    h = cuda.device_array((1, s.hidden), np.float32)  # the residual after attention; rewritten every run
    counters = cuda.to_device(np.zeros(1, np.int32))  # decode_route's, zero between launches
    positions = cuda.to_device(np.array([context], np.int32))
    splits = decode_num_splits(context + 1, hk, d, hq // hk, s.num_sms)

    def layer():
        gemv_multi((wq, wk, wv), x.reshape(s.hidden), (q.reshape(hq * d), k.reshape(hk * d), v.reshape(hk * d)),
                   norm_weight=ones, config=gemv_cfg)
        if d % 32 == 0:  # the KV write in the same launch, as the engine does
            head_norm_rope(q, k, positions, head_dim=d, q_norm_weight=head_ones, k_norm_weight=head_ones, v=v,
                           k_cache=k_cache, v_cache=v_cache)
        else:
            head_norm_rope(q, k, positions, head_dim=d, q_norm_weight=head_ones, k_norm_weight=head_ones)
            append_kv(k_cache, v_cache, k, v, positions, **_aux(s))
        attention(q, k_cache, v_cache, positions, attn_out, num_q_heads=hq, num_kv_heads=hk, head_dim=d,
                  kv_len=context + 1, num_splits=splits, config=attn_cfg)
        gemv(wo, attn_out.reshape(hq * d), h.reshape(s.hidden), config=gemv_cfg)  # the engine accumulates
        normed, ids, weights, _ = decode_route(h, ones, 1e-6, router, s.top_k, counters)
        moe_experts_decode(normed, ids, weights, *experts, h, num_experts=s.num_experts, config=gemv_cfg)

    head = random_packed(fmt, s.vocab, s.hidden, rng)
    vocab_logits, token = cuda.device_array(s.vocab, np.float32), cuda.device_array(1, np.int32)

    def head_and_sample():
        gemv(head, x.reshape(s.hidden), vocab_logits, norm_weight=ones, config=gemv_cfg)
        sample(vocab_logits, top_k=4 if s.aux_threads else 40, temperature=0.8, top_p=0.95, uniform=0.5, token=token,
               **({"threads": s.aux_threads, "num_blocks": 2} if s.aux_threads else {}))

    ms = median_ms(layer, *timing)
    token_ms = ms * s.num_layers + median_ms(head_and_sample, *timing)
    launches = DECODE_LAUNCHES_PER_LAYER * s.num_layers + DECODE_LAUNCHES_OUTSIDE
    return [Row(f"decode layer {fmt}, context {context}, plain launches", ms * 1e3, "us", None, None),
            Row(f"decode token: {s.num_layers} layers + head + sampling, plain launches", 1e3 / token_ms, "tokens/s",
                None, None),
            Row("launches per decode token", launches, "launches", None, None)]


def run(s: Shapes, gemv_cfg, gemm_cfg, prefill_cfg, decode_cfg, timing, is_default_moe: bool = False,
        expert_formats: tuple = ("Q4_0",), gemv_formats: tuple = ("Q4_0", "Q8_0", "Q4_K"),
        x_rows: tuple = (3,)) -> list:
    """is_default_moe: the MoE prefill rows on the engine's kernels for each chunk (cfg None, on
    moe_block_m's tile rows), else on gemm_cfg's. expert_formats: the routed experts' formats of the
    expert rows (the decode layer's experts are the first's); gemv_formats: the head's and the dense
    layers' GEMV rows; x_rows: the rows of activations of the dense layers' rows of several (a verify step's)."""
    paths = (True, False) if tensor_core.is_available() else (False,)
    q_dim = s.num_q_heads * s.head_dim
    rows = [bench_gemv(s, fmt, n, k, gemv_cfg, native, timing) for fmt in gemv_formats
            for n, k in ((s.vocab, s.gemv_cols), (q_dim, s.gemv_cols), (s.hidden, max(q_dim, 256)))
            for native in paths]
    rows += [bench_gemv(s, "F32", s.num_experts, s.gemv_cols, gemv_cfg, native, timing) for native in paths]  # router
    rows += [bench_gemv(s, fmt, n, k, gemv_cfg, native, timing, num_x_rows) for fmt in gemv_formats
             for n, k in ((q_dim, s.gemv_cols), (s.hidden, max(q_dim, 256))) for num_x_rows in x_rows
             for native in paths]
    first_experts = None
    for fmt in expert_formats:
        experts = make_experts(s, fmt, np.random.default_rng(6))
        first_experts = first_experts or experts
        rows += [bench_moe_decode(s, experts, gemv_cfg, native, timing) for native in paths]
        for num_tokens in s.prefill_tokens:
            if is_default_moe:  # the engine's kernels for the chunk: moe_rows' or default tiles, on its tile rows
                block_m = prefill_tile_rows(num_tokens * s.top_k, s.num_experts, (fmt,) * 3, s.hidden, s.ffn)
                rows += bench_moe_prefill(s, experts, num_tokens, None, timing, block_m=block_m)
            else:
                rows += bench_moe_prefill(s, experts, num_tokens, gemm_cfg, timing)
    experts = first_experts
    rows += [bench_attention_prefill(s, c, fmt, prefill_cfg, timing) for c in s.prefill_contexts
             for fmt in ("F16", "Q8_0", "Q4_0")]
    for fmt in ("F16", "Q8_0", "Q4_0"):
        rows += bench_attention_decode(s, fmt, decode_cfg, timing)
    rows += bench_decode_layer(s, experts, expert_formats[0], gemv_cfg, decode_cfg, timing)
    return rows


def format_table(rows: list) -> str:
    lines = [f"| {'figure':<74} | {'value':>12} | {'unit':<9} | {'ceiling':>9} | {'ratio':>6} | {'target':>6} |",
             f"| {'-' * 74} | {'-' * 12}:| {'-' * 9} | {'-' * 9}:| {'-' * 6}:| {'-' * 6}:|"]
    for r in rows:
        ceiling = f"{r.ceiling:9.4g}" if r.ceiling else " " * 9
        ratio = f"{r.figure / r.ceiling:6.3f}" if r.ceiling else " " * 6
        target = f"{r.target:6.2f}" if r.target else " " * 6
        lines.append(f"| {r.name:<74} | {r.figure:12.4g} | {r.unit:<9} | {ceiling} | {ratio} | {target} |")
    return "\n".join(lines)


def _x_rows(text: str) -> tuple[int, ...]:
    """--x-rows: counts in 2..DECODE_MAX_ROWS (a verify step's rows), or 0 for none."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated counts, got {text!r}") from None
    if counts == (0,):
        return ()
    if not all(2 <= count <= DECODE_MAX_ROWS for count in counts):
        raise argparse.ArgumentTypeError(f"each count in 2..{DECODE_MAX_ROWS} (0 alone: none), got {text!r}")
    return counts


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(prog="python -m strata.bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="toy shapes and configs, for the CUDA simulator")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 3, tiny 0)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default 10, tiny 1)")
    parser.add_argument("--expert-formats", default="Q4_0", type=lambda text: tuple(text.split(",")),
                        help="comma-separated formats of the routed experts' rows (default Q4_0), e.g. Q4_0,Q8_0,Q4_K")
    parser.add_argument("--gemv-formats", default="Q4_0,Q8_0,Q4_K", type=lambda text: tuple(text.split(",")),
                        help="comma-separated formats of the head's and dense layers' GEMV rows (default "
                             "Q4_0,Q8_0,Q4_K), e.g. Q5_K,Q6_K,IQ4_XS,IQ3_XXS")
    parser.add_argument("--x-rows", default="3", type=_x_rows,
                        help="comma-separated rows of activations of the dense layers' GEMVs of several rows, a "
                             "verify step's (default 3; 0: none), e.g. 2,3,5")
    args = parser.parse_args(argv)
    for option, formats in (("--expert-formats", args.expert_formats), ("--gemv-formats", args.gemv_formats)):
        unknown = [fmt for fmt in formats if fmt not in FORMATS]
        if unknown:
            parser.error(f"{option}: {', '.join(unknown)} not among {', '.join(FORMATS)}")
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 3)
    repeats = args.repeats if args.repeats is not None else (1 if args.tiny else 10)
    if args.tiny:
        configs = (TINY, TINY_GEMV, TINY_GEMM, TINY_PREFILL, TINY_DECODE)
    else:
        configs = (QWEN3_30B, GemvConfig(), default_config(), AttentionConfig(), DECODE_CONFIG)
    if IS_SIMULATOR:
        device = "CUDA simulator: the figures are not GPU figures"
    else:
        name = cuda.get_current_device().name
        device = name.decode() if isinstance(name, bytes) else str(name)
    print(f"# strata kernel benchmarks on {device}; median of {repeats} after {warmup} warm-up; {code_identity()}")
    rows = run(*configs, (warmup, repeats), is_default_moe=not args.tiny, expert_formats=args.expert_formats,
               gemv_formats=args.gemv_formats, x_rows=args.x_rows)
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
