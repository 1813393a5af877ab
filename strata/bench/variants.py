"""Kernel variants on the GPU: ``python -m strata.bench.variants [--only NAME]`` (gemm, moe, attention, ..., rows).

The sweeps behind the defaults of ``gemm_config.default_config()`` and ``attention.py``'s
``SERVING_CONFIG`` (docs/performance-log.md): every MmaConfig main-loop variant on the MoE prefill
products (2,048 and 8,192 routed tokens; Q4_0, or --weight-format) and a dense 4096 x 4096 x 2048
GEMM; the MoE prefill's gate/up and down launches on tiles of their own, at 512 / 2,048 / 8,192
routed tokens (behind ``gemm_config.default_config()`` and ``default_down_config()``), and the engine's
choice for the experts ``moe_rows`` serves, its kernels on 64-pair groups; every
MmaAttentionConfig on causal prefill at 4k and 32k per KV format; the direct decode attention's
launch shapes at positions 2k and 32k per KV format; and the native decode GEMVs' block shapes behind
``gemv_native.LAYER_CONFIG`` / ``head_config``, and the decode expert kernels' launch shapes behind
``gemv_native.EXPERTS_CONFIG`` (one token, and a verify step's three and five; each at several register caps),
a decode layer's routing in four launches against ``decode_route``'s one, and a verify step's dense projections
in the GEMVs' block shapes (rows). Each line also reports the
largest difference from a reference output (the GEMM, attention and GEMV sweeps) or from the first
variant's output (the MoE sweep), so a fast but wrong variant shows. Needs a GPU with tensor cores.
"""

from __future__ import annotations

import argparse
import itertools
from types import MappingProxyType

import numpy as np

GEMM_TILES = MappingProxyType({"128x64": {"block_m": 128, "block_n": 64, "warps_m": 4, "warps_n": 2},
                               "64x64": {"block_m": 64, "block_n": 64, "warps_m": 2, "warps_n": 2}})
# the tensor-core GEMM's weights, and moe_rows' (its FORMATS, built here to keep this module's import light)
WEIGHT_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS")
FAST = MappingProxyType({"prefetch_w": True, "ldmatrix": True, "vector_stores": True})
FUSED = MappingProxyType({"stages": 2, "fused": True})  # the C++ K loop; 128 x 128 gate/up tiles: dynamic shared
GEMM_VARIANTS = MappingProxyType({
    "128x128 plain": {}, "128x128 prefetch_w": {"prefetch_w": True}, "128x128 ldmatrix": {"ldmatrix": True},
    "128x128 vector_stores": {"vector_stores": True}, "128x128 fast (default F16 / F32)": dict(FAST),
    "128x128 fast lto": {**FAST, "lto": True},
    "128x64 plain": GEMM_TILES["128x64"], "128x64 fast step_k 64": {**GEMM_TILES["128x64"], **FAST, "step_k": 64},
    "128x64 fast stages 2": {**GEMM_TILES["128x64"], **FAST, "stages": 2},
    "64x64 fast stages 2": {**GEMM_TILES["64x64"], **FAST, "stages": 2},
    "128x64 fused (default)": {**GEMM_TILES["128x64"], **FUSED},
    "128x64 fused step_k 64": {**GEMM_TILES["128x64"], **FUSED, "step_k": 64},
    "128x64 4x1 fused step_k 64": {**GEMM_TILES["128x64"], "warps_n": 1, **FUSED, "step_k": 64},
    "64x64 fused step_k 64": {**GEMM_TILES["64x64"], **FUSED, "step_k": 64},
    "128x64 fused lto": {**GEMM_TILES["128x64"], **FUSED, "lto": True},
    "128x64 4x1 fused": {**GEMM_TILES["128x64"], "warps_n": 1, **FUSED},
    "128x64 4x1 fused lto": {**GEMM_TILES["128x64"], "warps_n": 1, **FUSED, "lto": True},
    "64x64 fused": {**GEMM_TILES["64x64"], **FUSED},
    "128x128 fused": dict(FUSED), "128x128 fused lto": {**FUSED, "lto": True},
    "128x128 4x4 fused": {"warps_n": 4, **FUSED}, "128x128 4x4 fused lto": {"warps_n": 4, **FUSED, "lto": True},
})


# the MoE prefill's tiles: (gate/up, down) as overrides of default_config()'s; the grouping's block_m is both's
_BASE = MappingProxyType({**GEMM_TILES["128x64"], "step_k": 32, "stages": 2})
_DOWN_4X1 = MappingProxyType({**_BASE, "warps_n": 1, "step_k": 64})
_SMALL = MappingProxyType({**GEMM_TILES["64x64"], "step_k": 32, "stages": 2})
MOE_VARIANTS = MappingProxyType({  # the first is the reference of the sweep's max rel diff
    # None: no tiles given, 64-pair groups: moe_rows' kernels where they serve the experts (the engine's
    # choice for the formats it serves, moe_rows.FORMATS), else the default tiles
    "weight rows on M, 64-pair groups (default where moe_rows serves the format)": None,
    "128x64, down 4x1 step_k 64 (default tiles from 96 rows an expert)": (_BASE, _DOWN_4X1),
    "128x64, down on gate/up's tiles": (_BASE, _BASE),
    "64x64, down step_k 64": (_SMALL, {**_SMALL, "step_k": 64}),
    "64x64, both step_k 64": ({**_SMALL, "step_k": 64}, {**_SMALL, "step_k": 64}),
    "64x64, down on gate/up's tiles (default tiles below 96)": (_SMALL, _SMALL),
    "64x64, down 2x1 step_k 64": (_SMALL, {**_SMALL, "warps_n": 1, "step_k": 64}),
    "64x128 2x4, down 64x64 step_k 64": ({**_SMALL, "block_n": 128, "warps_n": 4}, {**_SMALL, "step_k": 64}),
    "64x128 2x2, down 64x64 step_k 64": ({**_SMALL, "block_n": 128}, {**_SMALL, "step_k": 64}),
})


def _attempt(fn) -> str:
    try:
        return fn()
    except Exception as exc:  # a variant that does not fit its shared memory says so and the sweep goes on
        return f"FAILED {type(exc).__name__}: {str(exc)[:100]}"


def gemm_sweep(timing, match: str = "", fmt: str = "Q4_0") -> None:
    from strata.bench import kernels as b
    from strata.gpu.kernels.gemm import gemm
    from strata.gpu.kernels.gemm_config import MmaConfig

    s, rng = b.QWEN3_30B, np.random.default_rng(0)
    experts = b.make_experts(s, fmt, rng)
    w, x = b.random_packed(fmt, 4096, s.hidden, rng), b.device_randn((4096, s.hidden), rng)
    y_first = None
    for name in [name for name in GEMM_VARIANTS if match in name]:
        config = MmaConfig(**GEMM_VARIANTS[name]).validate()
        moe = [_attempt(lambda n=n, c=config: f"{b.bench_moe_prefill(s, experts, n, c, timing)[0].figure:6.1f}")
               for n in (2048, 8192)]
        ms = b.median_ms(lambda c=config: gemm(x, w, config=c), *timing)
        y = gemm(x, w, config=config).copy_to_host()
        y_first = y if y_first is None else y_first
        diff = np.max(np.abs(y - y_first)) / np.max(np.abs(y_first))
        print(f"{name:36s} MoE 2,048 {moe[0]}  8,192 {moe[1]}  dense {2 * 4096 * 4096 * s.hidden / ms / 1e9:6.1f} "
              f"TFLOP/s  max rel diff {diff:.1e}", flush=True)


def moe_sweep(timing, match: str = "", fmt: str = "Q4_0") -> None:
    """The MoE prefill's two launches on each variant's tiles, at 512, 2,048 and 8,192 tokens routed top-8:
    both launches back to back, and each alone, in TFLOP/s; then the largest difference of the output from
    the first variant's (the k experts of a token add in any order, so a few ulps are expected)."""
    from strata.bench import kernels as b
    from strata.gpu.kernels import moe_rows
    from strata.gpu.kernels.gemm_config import default_config
    from strata.gpu.kernels.moe import moe_experts_prefill
    from strata.gpu.kernels.moe_route import moe_group, moe_route

    s, rng = b.QWEN3_30B, np.random.default_rng(0)
    experts = b.make_experts(s, fmt, rng)
    base = default_config(fmt, fmt, fmt)
    x = b.device_randn((512, s.hidden), rng)
    ids, weights = moe_route(b.device_randn((512, s.num_experts), rng), s.top_k)
    first = None
    for name in [name for name in MOE_VARIANTS if match in name]:
        tiles = MOE_VARIANTS[name]
        if tiles is None:
            config = down_config = None
            block_m = moe_rows.TILE_ROWS
        else:
            config, down_config = base._replace(**tiles[0]), base._replace(**tiles[1])
            block_m = config.block_m

        def figures(n, config=config, down_config=down_config, block_m=block_m):
            whole, gate_up, down = b.bench_moe_prefill(s, experts, n, config, timing, down_config,
                                                       block_m=block_m)[:3]
            return f"{whole.figure:6.1f} ({gate_up.figure:5.1f}, {down.figure:5.1f})"

        def diff(config=config, down_config=down_config, block_m=block_m):
            nonlocal first
            out = b.cuda.to_device(np.zeros((512, s.hidden), np.float32))
            groups = moe_group(ids, weights, s.num_experts, block_m)
            moe_experts_prefill(x, groups, *experts, out, num_experts=s.num_experts, config=config,
                                down_config=down_config)
            y = out.copy_to_host()
            first = y if first is None else first
            return f"{np.max(np.abs(y - first)) / np.max(np.abs(first)):.1e}"

        print(f"{name:34s} " + "  ".join(f"{n:,} {_attempt(lambda n=n: figures(n))}" for n in (512, 2048, 8192))
              + f"  max rel diff {_attempt(diff)}", flush=True)


def attention_sweep(timing) -> None:
    from numba import cuda

    from strata.bench import kernels as b
    from strata.gpu.kernels.attention_mma import MmaAttentionConfig as Config
    from strata.gpu.kernels.attention_mma import attention_mma

    s = b.QWEN3_30B
    configs = (Config(), Config(kv_tile=32), Config(warps=8), Config(fused=True), Config(fused=True, stages=1),
               Config(fused=True, warps=8), Config(fused=True, lto=True))
    for fmt in ("F16", "Q8_0", "Q4_0"):
        for context in s.prefill_contexts:
            rng = np.random.default_rng(3)
            k_cache, v_cache = b._filled_cache(s, fmt, context, rng)
            q = b.device_randn((context, s.num_q_heads * s.head_dim), rng)
            out = cuda.device_array(q.shape, np.float32)
            positions = cuda.to_device(np.arange(context, dtype=np.int32))
            flops = 4.0 * s.head_dim * s.num_q_heads * context * (context + 1) / 2
            first = None
            for config in configs:
                def run(config=config):
                    return attention_mma(q, k_cache, v_cache, positions, out, num_q_heads=s.num_q_heads,
                                         num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, kv_len=context,
                                         config=config)

                def line(run=run):
                    ms = b.median_ms(run, *timing)
                    got = out.copy_to_host()
                    nonlocal first
                    first = got if first is None else first
                    return f"{flops / ms / 1e9:6.1f} TFLOP/s  max diff {np.max(np.abs(got - first)):.1e}"

                print(f"{fmt} {context:6d} {config}: {_attempt(line)}", flush=True)


# the direct decode attention's launch shapes (attention_decode_direct.DirectDecodeConfig): (warps, blocks per SM,
# fewest keys a split, tiles a warp step); the first is the default and the sweep's reference output
DECODE_VARIANTS = ((8, 1, 256, 0), (8, 2, 256, 0), (4, 2, 256, 0), (4, 4, 128, 0), (8, 1, 128, 0), (8, 1, 512, 0),
                   (8, 1, 256, 1), (8, 1, 256, 2), (8, 2, 128, 1), (8, 1, 1024, 0),
                   # short positions: more, smaller splits (a 2,048-key row fills 8 of the default's 256-key splits),
                   # or one split a row and no combine
                   (8, 1, 2048, 0), (8, 1, 64, 0), (4, 4, 64, 0), (2, 8, 64, 0), (2, 8, 32, 0), (4, 2, 512, 0),
                   (4, 4, 32, 1))


def decode_sweep(timing, kv_formats: tuple = ("F16", "Q8_0", "Q4_0")) -> None:
    """The direct decode attention's launch shapes on one token at positions 2,048 and 32,768 of the bench's
    34,816-cell cache, per KV format: microseconds per launch replayed in a CUDA graph, GB/s of the cache
    read, and each line's largest difference from the default shape's output."""
    from numba import cuda

    from strata.bench import kernels as b
    from strata.gpu.kernels import attention_decode_direct as direct

    s = b.QWEN3_30B
    for fmt in kv_formats:
        rng = np.random.default_rng(4)
        k_cache, v_cache = b._filled_cache(s, fmt, s.decode_cells, rng)
        q = b.device_randn((1, s.num_q_heads * s.head_dim), rng)
        out = cuda.device_array(q.shape, np.float32)
        for context in (2048, 32768):
            positions = cuda.to_device(np.array([context - 1], np.int32))
            num_bytes = 2 * k_cache.nbytes * context / k_cache.num_rows
            first = None
            for warps, blocks_per_sm, min_split_keys, tiles in DECODE_VARIANTS:
                config = direct.DirectDecodeConfig(warps, blocks_per_sm, min_split_keys, tiles)

                def line(config=config):
                    splits = direct.default_num_splits(s.decode_cells, s.num_kv_heads, s.num_sms, config)
                    workspace = tuple(cuda.to_device(np.zeros(shape, dtype)) for shape, dtype in
                                      direct.workspace_specs(splits, 1, s.num_q_heads, s.num_kv_heads, s.head_dim))

                    def run(stream):
                        return direct.attention_decode(q, k_cache, v_cache, positions, out, num_q_heads=s.num_q_heads,
                                                       num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                                       kv_len=s.decode_cells, num_splits=splits,
                                                       scale=1.0 / np.sqrt(s.head_dim), workspace=workspace,
                                                       config=config, stream=stream)

                    ms = b.graph_ms(run, timing)
                    got = out.copy_to_host()
                    nonlocal first
                    first = got if first is None else first
                    return (f"{splits:3d} splits {ms * 1e3:7.1f} us {num_bytes / ms / 1e6:6.0f} GB/s "
                            f"({num_bytes / ms * 1e3 / b.HBM_BYTES_PER_S:.2f} of HBM)  "
                            f"max diff {np.max(np.abs(got - first)):.1e}")

                print(f"decode {fmt} {context:6d} {config}: {_attempt(line)}", flush=True)


GEMV_SHAPES = (("Q4_0", 151936, 2048, "head"), ("Q8_0", 151936, 2048, "head"), ("Q4_K", 151936, 2048, "head"),
               ("Q4_0", 2048, 4096, "o"), ("Q4_0", 4096, 2048, "q"), ("F32", 128, 2048, "router"))
# (warps, rows per warp, most blocks per SM or 0 for a block per row group)
GEMV_BLOCKS = ((4, 1, 0), (4, 2, 0), (8, 1, 0), (8, 2, 0), (8, 4, 0), (16, 1, 0), (16, 2, 0), (8, 2, 2), (8, 2, 3),
               (8, 2, 4), (8, 2, 5), (8, 2, 6), (4, 2, 8), (8, 1, 8), (8, 4, 2), (16, 4, 1), (16, 2, 2), (8, 1, 4),
               (8, 4, 3), (8, 4, 4), (4, 4, 8), (16, 4, 2), (4, 4, 6), (16, 2, 1))
# (gate/up warps, down warps, most blocks per SM or 0 for a warp a row), each at every register cap of REGISTER_CAPS
# (0: none)
EXPERT_BLOCKS = ((8, 8, 3), (8, 8, 4), (8, 8, 6), (8, 8, 8), (4, 8, 8))
REGISTER_CAPS = (0, 64, 56, 48, 40)


def gemv_sweep(timing) -> None:
    """The native decode GEMVs' block shapes (gemv_native.NativeGemvConfig) at decode shapes; microseconds
    per launch replayed in a CUDA graph, each line with its largest difference from the Numba kernel's output."""
    from numba import cuda

    from strata.bench import kernels as b
    from strata.gpu.kernels import gemv_native
    from strata.gpu.kernels.gemv import gemv

    rng = np.random.default_rng(0)
    for fmt, num_rows, num_cols, name in GEMV_SHAPES:
        w, x = b.random_packed(fmt, num_rows, num_cols, rng), b.device_randn(num_cols, rng)
        ws = b.packed_copies(w, b.num_copies(w.nbytes))  # read from HBM, not L2
        launches = b.num_launches(len(ws))
        y = cuda.device_array(num_rows, np.float32)
        num_bytes = w.nbytes + 4 * (num_cols + num_rows)
        next_w = b.rotating(ws)
        ms = b.graph_ms(lambda stream: gemv(next_w(), x, y, native=False, stream=stream), timing, launches)
        gemv(w, x, y, native=False)
        expected = y.copy_to_host()
        label = f"{fmt} {name} {num_rows}x{num_cols}"
        print(f"{label} Numba: {ms * 1e3:7.1f} us {num_bytes / ms / 1e6:6.0f} GB/s", flush=True)
        for warps, rows_per_warp, blocks_per_sm in GEMV_BLOCKS:
            config = gemv_native.NativeGemvConfig(warps, rows_per_warp, blocks_per_sm)

            def line(config=config):
                next_w = b.rotating(ws)
                ms = b.graph_ms(lambda stream: gemv_native.gemv_native(next_w(), x, y, config=config, stream=stream),
                                timing, launches)
                gemv_native.gemv_native(w, x, y, config=config)
                diff = np.max(np.abs(y.copy_to_host() - expected)) / np.max(np.abs(expected))
                return f"{ms * 1e3:7.1f} us {num_bytes / ms / 1e6:6.0f} GB/s  max rel diff {diff:.1e}"

            cap = f", at most {blocks_per_sm} blocks per SM" if blocks_per_sm else ""
            print(f"{label} {warps} warps x {rows_per_warp} rows{cap}: {_attempt(line)}", flush=True)


def experts_sweep(timing) -> None:
    """The decode expert kernels' launch shapes (gemv_native.ExpertsConfig) on top-8 of 128 Q4_0 experts, for
    one token and for a verify step's three and five (depths 2 and 4); microseconds per launch replayed in a CUDA
    graph, each line saying whether its output has the first shape's bits."""
    from numba import cuda

    from strata.bench import kernels as b
    from strata.gpu.kernels import gemv_native

    s = b.QWEN3_30B
    rng = np.random.default_rng(3)
    experts = b.make_experts(s, "Q4_0", rng)
    for num_tokens in (1, 3, 5):  # a decode token; verify steps at depths 2 and 4
        x = b.device_randn((num_tokens, s.hidden), rng)
        routings = b.routed_ids(s, num_tokens, b.GRAPH_LAUNCHES, rng)  # the launches read other experts in turn
        ids = routings[0]
        weights = cuda.to_device(np.full((num_tokens, s.top_k), 1.0 / s.top_k, np.float32))
        out = cuda.device_array((num_tokens, s.hidden), np.float32)
        hidden = cuda.device_array((num_tokens * s.top_k, s.ffn), np.float32)
        expected = None
        for (warps, down_warps, blocks_per_sm), max_registers in itertools.product(EXPERT_BLOCKS, REGISTER_CAPS):
            config = gemv_native.ExpertsConfig(warps, down_warps, blocks_per_sm, max_registers)

            def run(stream, config=config, ids=ids):  # adds into out
                return gemv_native.moe_experts_native(x, ids, weights, *experts, out, hidden, config=config,
                                                      stream=stream)

            def line(run=run):
                nonlocal expected
                next_ids = b.rotating(routings)
                ms = b.graph_ms(lambda stream: run(stream, ids=next_ids()), timing)
                out.copy_to_device(np.zeros(out.shape, np.float32))
                run(0)
                got = out.copy_to_host()
                expected = got if expected is None else expected
                return f"{ms * 1e3:7.1f} us, equal to the first shape's: {np.array_equal(got, expected)}"

            cap = f", at most {blocks_per_sm} blocks per SM" if blocks_per_sm else ", a warp a row"
            cap += f", at most {max_registers} registers" if max_registers else ""
            print(f"experts Q4_0 top-{s.top_k}, {num_tokens} token(s), {warps} / {down_warps} warps{cap}: "
                  f"{_attempt(line)}", flush=True)


def route_sweep(timing) -> None:
    """A decode layer's norm and routing (F32 router, 128 experts, top-8, ids mapped to cache slots): the four
    launches apart (rms_norm, the router's GEMV, moe_route, the slot map) against decode_route's one, for one
    token and verify steps' three and five; microseconds a call replayed in a CUDA graph, and whether the one launch
    gives the same h (bit for bit) and picks (its logits are its own sums: a near tie may pick otherwise)."""
    from numba import cuda

    from strata.backend.cuda_moe_ops import _map_ids
    from strata.bench import kernels as b
    from strata.gpu.kernels import packing
    from strata.gpu.kernels.decode_route import decode_route
    from strata.gpu.kernels.gemv import gemv_rows
    from strata.gpu.kernels.moe_route import moe_route
    from strata.gpu.kernels.norm import rms_norm

    s, rng = b.QWEN3_30B, np.random.default_rng(4)
    router = packing.to_device(packing.pack((rng.standard_normal((s.num_experts, s.hidden)) * 0.05)
                                            .astype(np.float32), "F32", s.hidden))
    norm_w = cuda.to_device(rng.uniform(0.5, 1.5, s.hidden).astype(np.float32))
    table = cuda.to_device(rng.permutation(s.num_experts).astype(np.int32))
    counters = cuda.to_device(np.zeros(8, np.int32))
    for num_tokens in (1, 3, 5):  # a decode token; verify steps at depths 2 and 4
        x = b.device_randn((num_tokens, s.hidden), rng)

        def apart(stream):
            h = rms_norm(x, norm_w, 1e-6, stream=stream)
            ids, weights = moe_route(gemv_rows(router, h, stream=stream), s.top_k, stream=stream)
            return h, ids, weights, _map_ids(ids, table, to_slots=True, stream=stream)

        def fused(stream):
            return decode_route(x, norm_w, 1e-6, router, s.top_k, counters, slot_table=table, stream=stream)

        results = {}
        for name, run in (("apart (4 launches)", apart), ("decode_route (1 launch)", fused)):
            def line(run=run, name=name):
                ms = b.graph_ms(run, timing)
                results[name] = [a.copy_to_host() for a in run(0)]
                return f"{ms * 1e3:7.1f} us"
            print(f"route F32 {s.num_experts} experts top-{s.top_k}, {num_tokens} token(s), {name}: {_attempt(line)}",
                  flush=True)
        if len(results) == 2:
            (h_a, ids_a, _, slots_a), (h_f, ids_f, _, slots_f) = results.values()
            print(f"  same h: {np.array_equal(h_a, h_f)}, same picks: {np.array_equal(ids_a, ids_f)}, same slots: "
                  f"{np.array_equal(slots_a, slots_f)}", flush=True)


# a verify step's dense launch shapes (warps, rows per warp, most blocks per SM): q/k/v's one launch has no cap
ROWS_BLOCKS = ((8, 2, 0), (8, 1, 0), (4, 1, 0), (4, 2, 0), (16, 1, 0), (16, 2, 0), (8, 4, 0), (4, 4, 0), (8, 2, 1),
               (8, 1, 2), (4, 1, 4), (4, 2, 2), (16, 1, 1))


def rows_sweep(timing) -> None:
    """A decode layer's projections at R rows of activations (a verify step's R = d + 1) in each launch shape of
    ROWS_BLOCKS: q/k/v in one launch with the norm fused, and the output projection added into the residual;
    microseconds a launch replayed in a CUDA graph, the launches reading other copies of the weights in turn (from
    HBM, not L2). A row's bits do not depend on R or the shape (tests/kernels/test_gemv_rows.py), so only the time
    is shown."""
    from strata.bench import kernels as b
    from strata.gpu.kernels import gemv_native

    s, rng = b.QWEN3_30B, np.random.default_rng(5)
    q_rows, kv_rows = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim

    first = (*(b.random_packed("Q4_0", n, s.hidden, rng) for n in (q_rows, kv_rows, kv_rows)),
             b.random_packed("Q4_0", s.hidden, q_rows, rng))  # q, k, v, o
    num_layers = b.num_copies(first[3].nbytes)  # read from HBM, not L2
    layers = list(zip(*(b.packed_copies(w, num_layers) for w in first)))
    norm_w = b.device_randn(s.hidden, rng)
    for num_rows in (1, 3, 5):
        x, attended = b.device_randn((num_rows, s.hidden), rng), b.device_randn((num_rows, q_rows), rng)
        residual = b.device_randn((num_rows, s.hidden), rng)
        ys = tuple(b.device_randn((num_rows, w.num_rows), rng) for w in first[:3])
        for warps, rows_per_warp, blocks_per_sm in ROWS_BLOCKS:
            config = gemv_native.NativeGemvConfig(warps, rows_per_warp, blocks_per_sm)

            def qkv(stream, weights, x=x, ys=ys, config=config):
                return gemv_native.gemv_multi_native(weights[:3], x, ys, norm_weight=norm_w, eps=1e-6,
                                                     config=config, stream=stream)

            def o_proj(stream, weights, attended=attended, residual=residual, config=config):
                return gemv_native.gemv_native_rows(weights[3], attended, residual, accumulate=True, config=config,
                                                    stream=stream)

            runs = (("o", o_proj),) if blocks_per_sm else (("q/k/v", qkv), ("o", o_proj))
            for name, run in runs:
                def line(run=run):
                    next_layer = b.rotating(layers)
                    ms = b.graph_ms(lambda stream: run(stream, next_layer()), timing, b.num_launches(num_layers))
                    return f"{ms * 1e3:7.1f} us"
                cap = f", at most {blocks_per_sm} blocks per SM" if blocks_per_sm else ""
                print(f"rows {num_rows} Q4_0 {name} {warps} warps x {rows_per_warp} rows{cap}: {_attempt(line)}",
                      flush=True)


def main(argv=None) -> int:
    from strata.bench.provenance import code_identity
    from strata.gpu.kernels import tensor_core

    parser = argparse.ArgumentParser(prog="python -m strata.bench.variants", description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("gemm", "moe", "attention", "decode", "gemv", "experts", "route", "rows"),
                        help="run one sweep")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (default 5)")
    parser.add_argument("--match", default="", help="only the GEMM and MoE variants whose name contains this text")
    parser.add_argument("--weight-format", default="Q4_0", choices=WEIGHT_FORMATS,
                        help="the GEMM and MoE sweeps' weights (default Q4_0; a variant whose kernels do not take "
                             "the format says so on its line)")
    parser.add_argument("--kv-format", choices=("F16", "Q8_0", "Q4_0"), action="append",
                        help="the decode sweep's cache formats (repeatable; default all three)")
    args = parser.parse_args(argv)
    named = {"gemm": GEMM_VARIANTS, "moe": MOE_VARIANTS}.get(args.only, {**GEMM_VARIANTS, **MOE_VARIANTS})
    if not any(args.match in name for name in named):
        parser.error(f"--match {args.match!r} names no GEMM or MoE variant of this sweep; the variants: "
                     f"{', '.join(named)}")
    if not tensor_core.is_available():
        raise SystemExit("the variant sweeps need a GPU with tensor cores (compute capability 8.0+) and cffi")
    timing = (2, args.repeats)
    print(f"# {code_identity()}", flush=True)
    sweeps = {"gemm": gemm_sweep, "moe": moe_sweep, "attention": attention_sweep, "decode": decode_sweep,
              "gemv": gemv_sweep, "experts": experts_sweep, "route": route_sweep, "rows": rows_sweep}
    for name, sweep in sweeps.items():
        if args.only in (None, name):
            if name in ("gemm", "moe"):
                sweep(timing, args.match, args.weight_format)
            elif name == "decode" and args.kv_format:
                sweep(timing, tuple(args.kv_format))
            else:
                sweep(timing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
