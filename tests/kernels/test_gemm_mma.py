"""The tensor-core GEMM path: its pure-Numba twin everywhere, the linked CUDA C++ on a real GPU.

Inputs are rounded to float16 on this path, so the bound is relative to sum |w x| per output:
2e-3 covers two roundings of 2^-11 each plus float32 sums.
"""

import numpy as np
import pytest
from kernel_data import (
    ALL_FORMATS,
    assert_close_to_scale,
    assert_dot_close,
    check_moe_prefill,
    dev,
    host,
    random_matrix,
)

from strata.gpu.kernels import tensor_core
from strata.gpu.kernels._common import IS_SIMULATOR
from strata.gpu.kernels.gemm import dequantize_f16, gemm, is_staged_as_f16, jit_options
from strata.gpu.kernels.gemm_config import (
    DEFAULT_BLOCK_MS,
    FFMA_DEFAULT_CONFIG,
    FUSED_FORMATS,
    MOE_FULL_TILE_MIN_ROWS,
    GemmConfig,
    MmaConfig,
    default_config,
    default_down_config,
    is_fused,
    moe_block_m,
)
from strata.gpu.kernels.moe import moe_experts_prefill
from strata.gpu.kernels.moe_route import moe_group
from strata.model import reference_ops

F16_RTOL = 2e-3
TWIN_ONE_WARP = MmaConfig(block_m=16, block_n=8, warps_m=1, warps_n=1, is_native=False)  # 32 threads
TWIN_FOUR_WARPS = MmaConfig(block_m=32, block_n=32, warps_m=2, warps_n=2, is_native=False)  # warp tiles 16 x 16
NUM_TOKENS, NUM_ROWS = 19, 13  # neither a multiple of the tiles
needs_tensor_cores = pytest.mark.skipif(not tensor_core.is_available(), reason="needs a GPU with tensor cores")


def _check_gemm(fmt, num_cols, seed, config, num_tokens=NUM_TOKENS, num_rows=NUM_ROWS, x_dtype=np.float32):
    w, values = random_matrix(fmt, num_rows, num_cols, seed=seed)
    x = np.random.default_rng(seed + 100).standard_normal((num_tokens, num_cols)).astype(x_dtype)
    y = host(gemm(dev(x), w, config=config))
    x64 = x.astype(np.float64)
    assert_dot_close(y, x64 @ values.T, np.abs(x64) @ np.abs(values).T, rtol=F16_RTOL)
    return y


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_twin_gemm_matches_dequantized_matmul(fmt):
    _check_gemm(fmt, 256 if fmt in ("Q4_K", "Q6_K") else 64, seed=140, config=TWIN_ONE_WARP)


def test_twin_gemm_four_warps_float16_activations():
    _check_gemm("Q4_0", 96, seed=141, config=TWIN_FOUR_WARPS, num_tokens=37, num_rows=45, x_dtype=np.float16)


def test_twin_moe_prefill_matches_reference():
    check_moe_prefill(TWIN_ONE_WARP, ("Q4_0", "Q8_0", "Q4_1"), seed=142, dim=32, ffn=64)


def test_mma_config_checks():
    with pytest.raises(ValueError, match="not one of the compiled mma tiles"):
        MmaConfig(block_m=16, block_n=16, warps_m=2, warps_n=1).validate()
    with pytest.raises(ValueError, match="must be a power of two"):
        MmaConfig(block_m=48).validate()
    if not tensor_core.is_available():
        with pytest.raises(ValueError, match="needs a GPU with tensor cores"):
            MmaConfig(is_native=True).validate()
        assert MmaConfig().validate().is_native is False


@needs_tensor_cores
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_native_gemm_agrees_with_twin_and_reference(fmt):
    num_cols = 512
    native = _check_gemm(fmt, num_cols, 150, MmaConfig(is_native=True), num_tokens=131, num_rows=200)
    twin = _check_gemm(fmt, num_cols, 150, MmaConfig(is_native=False), num_tokens=131, num_rows=200)
    # same f16 inputs, f32 sums in a different order
    assert np.max(np.abs(native - twin)) <= 1e-4 * np.max(np.abs(twin))


@needs_tensor_cores
@pytest.mark.parametrize("config", [MmaConfig(block_m=16, block_n=8, warps_m=1, warps_n=1, is_native=True),
                                    MmaConfig(block_m=128, block_n=64, warps_m=4, warps_n=2, is_native=True),
                                    MmaConfig(block_m=64, block_n=128, warps_m=2, warps_n=2, is_native=True)])
def test_native_gemm_tile_shapes(config):
    _check_gemm("Q4_K", 512, 151, config, num_tokens=150, num_rows=300)


# Main-loop options: each alone and all together; the twin runs them in the simulator.
SPLIT_FORMATS = ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "F16")
MAINLOOP_OPTIONS = {
    "prefetch_w": dict(prefetch_w=True),
    "step_k_64": dict(step_k=64),
    "two_stages": dict(stages=2),
    "ldmatrix": dict(ldmatrix=True),
    "vector_stores": dict(vector_stores=True),
    "all": dict(prefetch_w=True, step_k=64, stages=2, ldmatrix=True, vector_stores=True),
}


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_twin_prefetch_w_matches_dequantized_matmul(fmt):  # Q4_1 and F32 keep the direct path
    _check_gemm(fmt, 256 if fmt in ("Q4_K", "Q6_K") else 64, seed=160, config=TWIN_ONE_WARP._replace(prefetch_w=True))


@pytest.mark.parametrize("option", MAINLOOP_OPTIONS)
def test_twin_mainloop_options(option):
    config = TWIN_ONE_WARP._replace(**MAINLOOP_OPTIONS[option])
    _check_gemm("Q4_K", 256, seed=161, config=config)
    _check_gemm("Q8_0", 96, seed=162, config=config)  # 3 x 32: a zero-filled half step when step_k = 64


def test_twin_options_four_warps_float16_activations():
    config = TWIN_FOUR_WARPS._replace(**MAINLOOP_OPTIONS["all"])
    _check_gemm("Q6_K", 256, seed=163, config=config, num_tokens=37, num_rows=45, x_dtype=np.float16)


@pytest.mark.parametrize("option", ["prefetch_w", "all"])
def test_twin_moe_prefill_options(option):
    check_moe_prefill(TWIN_ONE_WARP._replace(**MAINLOOP_OPTIONS[option]), ("Q4_0", "Q8_0", "F16"), seed=164)


def test_mma_config_option_checks(monkeypatch):
    with pytest.raises(ValueError, match="step_k must be one of"):
        MmaConfig(step_k=128).validate()
    with pytest.raises(ValueError, match="stages must be 1 or 2"):
        MmaConfig(stages=3).validate()
    config = MmaConfig(step_k=64, stages=2)
    assert config.xs_size == 2 * 72 * 128 and config.ws_size == 2 * 72 * 128
    assert config.shared_bytes(2) == 2 * 3 * 2 * 72 * 128 + 4 * 128  # over 48 KiB: dynamic shared memory
    # the limit is the device's (Hopper's in the simulator); an MoE's gate/up kernel stages two weight tiles
    MmaConfig(block_m=256, block_n=128, warps_m=4, warps_n=2, step_k=64, stages=2).validate()
    with monkeypatch.context() as patch:
        patch.setattr(tensor_core, "max_shared_bytes", lambda: 48 * 1024)
        with pytest.raises(ValueError, match="61952 bytes of shared memory .X and two weight tiles. exceed the 49152"):
            MmaConfig(stages=2).validate()
    with pytest.raises(ValueError, match="lto=True links the C.. main loop, but is_native=False"):
        MmaConfig(lto=True, is_native=False).validate()
    with pytest.raises(ValueError, match="fused=True runs double-buffered K steps, but stages=1: set stages=2"):
        MmaConfig(fused=True).validate()
    with pytest.raises(ValueError, match="fused=True runs the K loop in linked C.., but is_native=False"):
        MmaConfig(fused=True, stages=2, is_native=False).validate()
    if not tensor_core.is_available():  # resolved to the twin, the C++-only options drop, and it validates again
        resolved = MmaConfig(fused=True, stages=2, lto=True).validate()
        assert not resolved.fused and not resolved.lto and resolved.validate() == resolved
    # the fused loop takes the block formats, one format at a time, only where the C++ runs
    fused = MmaConfig(fused=True, stages=2, is_native=True)
    assert is_fused(fused, "Q4_0") and is_fused(fused, "Q6_K", "Q6_K")
    assert is_fused(fused, "F16") and not is_fused(fused, "F32") and not is_fused(fused, "Q4_0", "Q8_0")
    assert not is_fused(fused._replace(is_native=False), "Q4_0") and not is_fused(GemmConfig(), "Q4_0")
    # kernels link with LTO only when the C++ main loop runs (not the twin, not the FFMA tiles)
    assert jit_options(MmaConfig(lto=True, is_native=True)) == {"lto": True}
    assert jit_options(MmaConfig(lto=True)) == jit_options(GemmConfig()) == jit_options(MmaConfig(is_native=True)) == {}
    # 512 threads: 128 registers a thread on a GPU, native or twin (the simulator takes no launch bounds)
    bounds = {} if IS_SIMULATOR else {"launch_bounds": 512}
    assert jit_options(MmaConfig(warps_n=4, is_native=True)) == jit_options(MmaConfig(warps_n=4)) == bounds


# the C++ fused K loop (the block formats; F16 / F32 run the Numba loop under the same config)
FUSED_CONFIGS = [MmaConfig(block_m=128, block_n=64, warps_m=4, warps_n=2, stages=2, fused=True, is_native=True),
                 MmaConfig(block_m=128, block_n=64, warps_m=4, warps_n=1, stages=2, fused=True, is_native=True),
                 MmaConfig(block_m=64, block_n=64, warps_m=2, warps_n=2, stages=2, fused=True, lto=True,
                           is_native=True),
                 # 128 x 128: gate and up tiles in dynamic shared memory (61,952 bytes); 16 warps, launch bounds
                 MmaConfig(stages=2, fused=True, is_native=True),
                 MmaConfig(warps_n=4, stages=2, fused=True, is_native=True),
                 # 64-wide K steps (a zero-filled half step where K is an odd multiple of 32); 128 x 64
                 # gate and up tiles in dynamic shared memory (74,240 bytes)
                 MmaConfig(block_m=128, block_n=64, warps_m=4, warps_n=2, step_k=64, stages=2, fused=True,
                           is_native=True),
                 MmaConfig(block_m=64, block_n=64, warps_m=2, warps_n=2, step_k=64, stages=2, fused=True,
                           is_native=True)]

# all options together: 64 x 64 tiles (larger ones stage through dynamic shared memory, as the fused 128 x 128 do)
NATIVE_OPTION_CONFIGS = [MmaConfig(is_native=True, **options) for name, options in MAINLOOP_OPTIONS.items()
                         if name != "all"] + [
    MmaConfig(block_m=64, block_n=64, warps_m=2, warps_n=2, is_native=True, **MAINLOOP_OPTIONS["all"]),
    MmaConfig(block_m=16, block_n=8, warps_m=1, warps_n=1, is_native=True, **MAINLOOP_OPTIONS["all"]),
    MmaConfig(is_native=True, prefetch_w=True, ldmatrix=True, vector_stores=True, lto=True),
] + FUSED_CONFIGS


@needs_tensor_cores
@pytest.mark.parametrize("fmt", SPLIT_FORMATS + ("Q4_1",))
@pytest.mark.parametrize("config", NATIVE_OPTION_CONFIGS, ids=lambda c: "-".join(
    f"{k}={v}" for k, v in c._asdict().items()
    if k not in ("is_native",) and v != MmaConfig._field_defaults[k]) or "base")
def test_native_mainloop_options_agree_with_twin(fmt, config):
    num_cols = 544  # 17 x 32: a zero-filled half step when step_k = 64
    native = _check_gemm(fmt, 768 if fmt in ("Q4_K", "Q6_K") else num_cols, 170, config, num_tokens=131, num_rows=200)
    twin = _check_gemm(fmt, 768 if fmt in ("Q4_K", "Q6_K") else num_cols, 170,
                       config._replace(is_native=False, lto=False, fused=False), num_tokens=131, num_rows=200)
    assert np.max(np.abs(native - twin)) <= 1e-4 * np.max(np.abs(twin))


@needs_tensor_cores
@pytest.mark.parametrize("fmt", FUSED_FORMATS)
@pytest.mark.parametrize("config", FUSED_CONFIGS[:2])
def test_native_fused_gemm_float16_activations(fmt, config):  # X read by cp.async as it is, no conversion
    num_cols = 768 if fmt in ("Q4_K", "Q6_K") else 544
    native = _check_gemm(fmt, num_cols, 175, config, num_tokens=131, num_rows=200, x_dtype=np.float16)
    twin = _check_gemm(fmt, num_cols, 175, MmaConfig(is_native=False), num_tokens=131, num_rows=200,
                       x_dtype=np.float16)
    assert np.max(np.abs(native - twin)) <= 1e-4 * np.max(np.abs(twin))


@needs_tensor_cores
@pytest.mark.parametrize("config", [MmaConfig(block_m=32, block_n=64, warps_m=2, warps_n=2, is_native=True,
                                              **MAINLOOP_OPTIONS["all"]),
                                    MmaConfig(is_native=True, prefetch_w=True, ldmatrix=True, vector_stores=True),
                                    MmaConfig(is_native=True, prefetch_w=True, ldmatrix=True, vector_stores=True,
                                              lto=True)] + FUSED_CONFIGS)
@pytest.mark.parametrize("fmts", [("Q4_K", "Q4_0", "Q6_K"), ("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q4_0", "Q8_0"),
                                  ("Q8_0", "Q8_0", "Q4_0")])
def test_native_moe_prefill_options(config, fmts):  # the fused loop runs where gate and up share a fused format
    _check_native_moe_prefill(config, fmts)


@needs_tensor_cores
@pytest.mark.parametrize("down_tiles", [dict(block_n=128), dict(block_n=128, warps_m=2, warps_n=4),
                                        dict(block_n=32, warps_n=1), dict(step_k=64)],
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("fmts", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q4_0", "Q8_0")])
def test_native_moe_prefill_down_tiles_of_its_own(down_tiles, fmts):
    _check_native_moe_prefill(FUSED_CONFIGS[0], fmts, FUSED_CONFIGS[0]._replace(**down_tiles))


@needs_tensor_cores
@pytest.mark.parametrize("block_m", DEFAULT_BLOCK_MS)
@pytest.mark.parametrize("fmts", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q4_0", "Q8_0"), ("Q4_0", "Q4_0", "F16")])
def test_native_moe_prefill_default_tiles(fmts, block_m):  # what the engine launches: each launch on its default tiles
    _check_native_moe_prefill(default_config(*fmts, block_m=block_m), fmts, default_down_config(*fmts, block_m=block_m))
    _check_native_moe_prefill(None, fmts, block_m=block_m)  # the defaults the wrapper takes from the groups


def _check_native_moe_prefill(config, fmts, down_config=None, block_m=None):
    # K-quant rows hold whole 256-element blocks; otherwise both K are odd multiples of 32 (a zero-filled
    # half step of 64-wide steps, in gate/up's two-weight loop and in down's)
    num_tokens, num_experts, top_k = 300, 8, 2
    dim, ffn = (256, 256) if fmts[0] == "Q4_K" else (288, 288)
    rng = np.random.default_rng(171)
    gate, gate_v = random_matrix(fmts[0], num_experts * ffn, dim, 172)
    up, up_v = random_matrix(fmts[1], num_experts * ffn, dim, 173)
    down, down_v = random_matrix(fmts[2], num_experts * dim, ffn, 174)
    values = (gate_v.reshape(num_experts, ffn, dim), up_v.reshape(num_experts, ffn, dim),
              down_v.reshape(num_experts, dim, ffn))
    # scaled so that silu(g) * u stays inside float16's range (65,504) with Q8_0's weights of up to 16
    x = 0.1 * rng.standard_normal((num_tokens, dim)).astype(np.float32)
    ids, weights = reference_ops.route(rng.standard_normal((num_tokens, num_experts)), top_k)
    ids, weights = ids.astype(np.int32), weights.astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), num_experts, block_m or config.block_m)
    expected = reference_ops.moe(x, ids, weights, *values)
    for hidden_dtype in (None, np.float32):  # float32 hidden: down runs the Numba loop under a fused config
        out = dev(np.zeros((num_tokens, dim), np.float32))
        moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts, config=config,
                            down_config=down_config, hidden_dtype=hidden_dtype)
        assert_close_to_scale(host(out), expected, 5e-3)


def test_cuda_sources_inline_their_local_headers():  # NVRTC does not search the sources' folder
    for name in ("gemm_mma.cu", "attention_mma.cu"):
        text = tensor_core.source_text(name)
        assert '#include "common.cuh"' not in text and text.count("struct RawOctet {") == 1
    for name in ("gemv_rows.cu", "moe_rows.cu"):  # the I-quants' tables once each
        text = tensor_core.source_text(name)
        assert '#include "iquants.cuh"' not in text and text.count("kIq3XxsGrid[256] = {") == 1
    with open(tensor_core.source("reduce.cu")) as f:  # no local include: the text as it is
        assert tensor_core.source_text("reduce.cu") == f.read()


def test_one_linkable_source_per_text():  # kernels dedupe link items by identity
    assert tensor_core.cu_source("gemm_mma.cu") is tensor_core.cu_source("gemm_mma.cu")
    assert tensor_core.cu_source("gemm_mma.cu", "x") is not tensor_core.cu_source("gemm_mma.cu")


def test_default_config_per_weight_format():
    if not tensor_core.is_available():
        assert default_config("Q4_0") == default_config() == FFMA_DEFAULT_CONFIG
        assert default_down_config("Q4_0", "Q4_0", "Q4_0") == FFMA_DEFAULT_CONFIG
        return
    fused = default_config("Q4_0", "Q4_0", "Q8_0")
    assert is_fused(fused, "Q4_0")
    assert default_config() == fused == default_config("Q4_K", "Q4_K", "Q6_K") == default_config("Q4_1")
    # a format outside the default's, or gate and up apart (their shared loop could not fuse): the Numba loop
    for numba_loop in (default_config("Q4_0", "F16"), default_config("Q4_0", "Q8_0", "Q4_0")):
        assert not numba_loop.fused and numba_loop.block_m == fused.block_m  # one grouping serves both
    # the MoE down launch: one weight, so 4 x 1 warps of 32 x 64 and 64-wide steps; the same rows per tile
    down = default_down_config("Q4_K", "Q4_K", "Q6_K")
    assert is_fused(down, "Q6_K") and (down.warps_n, down.step_k, down.block_m) == (1, 64, fused.block_m)
    assert default_down_config("Q4_0", "Q8_0", "Q4_0") == default_config("Q4_0", "Q8_0", "Q4_0")
    # 64-row tiles for small chunks: 2 x 2 warps, and the down launch on gate/up's tiles
    small = default_config("Q4_0", "Q4_0", "Q4_0", block_m=64)
    assert is_fused(small, "Q4_0") and (small.block_m, small.block_n, small.warps_m, small.warps_n) == (64, 64, 2, 2)
    assert default_down_config("Q4_0", "Q4_0", "Q4_0", block_m=64) == small
    assert default_config("Q4_0", "F16", block_m=64).block_m == 64


@pytest.mark.parametrize("fmts", [("Q4_0", "Q4_0", "Q4_0"), ("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0", "Q4_0"),
                                  ("Q4_0", "Q4_0", "F16")])
def test_the_chosen_tile_rows_are_both_launches_rows(fmts):  # one grouping serves both launches, on any backend
    for num_pairs in (5, 4095, 4096, MOE_FULL_TILE_MIN_ROWS * 128 - 1, MOE_FULL_TILE_MIN_ROWS * 128, 65536):
        block_m = moe_block_m(num_pairs, 128)
        assert default_config(*fmts, block_m=block_m).block_m == block_m
        assert default_down_config(*fmts, block_m=block_m).block_m == block_m
    ids, weights = dev(np.zeros((8, 2), np.int32)), dev(np.ones((8, 2), np.float32))
    w, _ = random_matrix("Q4_0", 4 * 32, 32, 1)
    down, _ = random_matrix("Q4_0", 4 * 32, 32, 2)
    groups = moe_group(ids, weights, 4, 16)  # rows no default tile has
    with pytest.raises(ValueError, match=r"the groups' tiles are 16 pairs, but the default tiles have \(64, 128\) "
                                         "rows: group with gemm_config.moe_block_m"):
        moe_experts_prefill(dev(np.zeros((8, 32), np.float32)), groups, w, w, down, dev(np.zeros((8, 32), np.float32)),
                            num_experts=4)


def test_moe_tile_rows_follow_the_rows_an_expert():
    with pytest.raises(ValueError, match=r"block_m must be one of \(64, 128\), got 32"):
        default_config("Q4_0", block_m=32)
    if not tensor_core.is_available():  # the FFMA tiles have rows of their own
        assert {moe_block_m(n, 128) for n in (1, 4096, 65536)} == {FFMA_DEFAULT_CONFIG.block_m}
        return
    assert moe_block_m(512 * 8, 128) == 64  # 32 rows an expert: the 128-row tiles would be three quarters padding
    assert moe_block_m(MOE_FULL_TILE_MIN_ROWS * 128 - 1, 128) == 64
    assert moe_block_m(MOE_FULL_TILE_MIN_ROWS * 128, 128) == 128
    assert moe_block_m(2048 * 8, 128) == 128 and moe_block_m(8192 * 8, 128) == 128


@needs_tensor_cores
def test_fused_configs_dispatch_to_the_cpp_loop():
    from strata.gpu.kernels import gemm_mma
    config = FUSED_CONFIGS[0]
    assert gemm_mma.mainloop_device("Q4_0", config) is gemm_mma._fused_mainloop_device("Q4_0", config, 1)
    assert gemm_mma.dual_mainloop_device("Q6_K", "Q6_K", config) is gemm_mma._fused_mainloop_device("Q6_K", config, 2)


@pytest.mark.parametrize("fmt", ["Q5_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_S", "BF16", "Q5_0"])
def test_a_format_the_fused_loop_does_not_read_is_staged_as_float16_values(fmt):
    # dequantize_f16 writes each value as the tiles stage it (bit for bit against the Numba dequantizer's
    # float16 rounding, everywhere); on a GPU with tensor cores gemm stages such a matrix and runs the fused loop
    num_cols = 512
    w, values = random_matrix(fmt, 70, num_cols, seed=150)
    assert is_staged_as_f16(fmt) and not is_staged_as_f16("Q4_0") and not is_staged_as_f16("F32")
    staged = dequantize_f16(w)
    assert staged.fmt == "F16" and (staged.num_rows, staged.num_cols) == (70, num_cols)
    np.testing.assert_array_equal(host(staged.quants).view(np.uint16), values.astype(np.float16).view(np.uint16))
    if tensor_core.is_available():
        fused = _check_gemm(fmt, num_cols, 151, None, num_tokens=131, num_rows=70)
        numba_loop = _check_gemm(fmt, num_cols, 151, MmaConfig(is_native=False), num_tokens=131, num_rows=70)
        assert np.max(np.abs(fused - numba_loop)) <= 1e-4 * np.max(np.abs(numba_loop))
