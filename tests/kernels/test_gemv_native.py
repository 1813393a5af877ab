"""The decode GEMVs' linked C++ rows (gemv_native) against the NumPy reference and the Numba kernels.

The C++ path needs a real GPU (warp shuffles, linked CUDA C++); in the simulator these tests check
that asking for it is refused and that the automatic choice falls back to the Numba kernels. Every built
format runs through the C++ here, served or not yet (gemv_native.FORMATS and EXPERT_FORMATS).
"""

import functools

import numpy as np
import pytest
from kernel_data import (
    assert_close_to_scale,
    assert_dot_close,
    block_elems,
    dev,
    host,
    random_experts,
    random_matrix,
)
from numba import cuda

from strata.backend.select import has_cuda_device
from strata.gpu.kernels import gemv_native
from strata.gpu.kernels.gemv import gemv
from strata.gpu.kernels.gemv_multi import gemv_multi
from strata.gpu.kernels.gemv_native import NativeGemvConfig
from strata.gpu.kernels.moe import moe_experts_decode
from strata.model import reference_ops

needs_gpu = pytest.mark.skipif(not has_cuda_device(), reason="needs a real CUDA device (not the simulator)")
QUANTIZED = gemv_native.BUILT_EXPERT_FORMATS  # every quantized format the rows build


@pytest.fixture(autouse=True)
def every_built_format_served(monkeypatch):
    """The tests run every built format through the C++ rows, served or not yet."""
    monkeypatch.setattr(gemv_native, "FORMATS", gemv_native.BUILT_FORMATS)
    monkeypatch.setattr(gemv_native, "EXPERT_FORMATS", gemv_native.BUILT_EXPERT_FORMATS)


def _x(num_cols, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(num_cols) * scale).astype(np.float32)


@needs_gpu
@pytest.mark.parametrize("fmt", gemv_native.BUILT_FORMATS)
@pytest.mark.parametrize("rows_per_warp", [1, 2, 4])
def test_native_rows_match_the_reference_around_block_and_warp_boundaries(fmt, rows_per_warp):
    config = NativeGemvConfig(warps=2, rows_per_warp=rows_per_warp)
    elems = block_elems(fmt)
    # columns: fewer items than lanes, a lane's second item, more than one unrolled step
    for i, num_cols in enumerate((elems, elems * 3, elems * 33 if elems == 32 else elems * 9)):
        norm_weight = np.random.default_rng(510 + i).uniform(0.5, 1.5, num_cols).astype(np.float32)
        for num_rows in (1, 7, 17, 33):
            w, values = random_matrix(fmt, num_rows, num_cols, seed=400 + i * 10 + num_rows)
            x = _x(num_cols, 500 + i)
            y = dev(np.zeros(num_rows, np.float32))
            is_norm = num_rows % 2 == 1  # the fused norm's shared sums sit before the staged activations
            gemv_native.gemv_native(w, dev(x), y, norm_weight=dev(norm_weight) if is_norm else None, config=config)
            xn = reference_ops.rms_norm(x, norm_weight, 1e-6) if is_norm else x
            assert_dot_close(host(y), values.astype(np.float64) @ xn, np.abs(values) @ np.abs(xn))


@needs_gpu
@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("is_head_shape", [False, True])
def test_blocks_that_go_on_to_further_rows_give_the_same_products(fmt, is_head_shape):
    # a grid capped below the row groups: each block loops over several, the last one partial; the
    # head's shape of this format with its norm and accumulation, or one warp of two rows
    is_norm_and_accumulate = is_head_shape
    looping = gemv_native.head_config(fmt) if is_head_shape else NativeGemvConfig(1, 2, blocks_per_sm=4)
    one_pass = looping._replace(blocks_per_sm=0)
    num_cols = block_elems(fmt) * 2
    rows_per_block = looping.warps * looping.rows_per_warp
    num_rows = 3 * looping.grid(10**9) * rows_per_block + 3  # three row groups a block, one more partial
    assert 3 * looping.grid(num_rows) < one_pass.grid(num_rows)
    w, values = random_matrix(fmt, num_rows, num_cols, seed=420)
    rng = np.random.default_rng(421)
    x = _x(num_cols, 422)
    norm_weight = rng.uniform(0.5, 1.5, num_cols).astype(np.float32) if is_norm_and_accumulate else None
    residual = rng.standard_normal(num_rows).astype(np.float32) if is_norm_and_accumulate else np.zeros(num_rows,
                                                                                                         np.float32)
    outs = []
    for config in (looping, one_pass):
        y = dev(residual)
        gemv_native.gemv_native(w, dev(x), y, norm_weight=None if norm_weight is None else dev(norm_weight),
                                accumulate=is_norm_and_accumulate, config=config)
        outs.append(host(y))
    np.testing.assert_array_equal(outs[0], outs[1])  # the same rows, the same lanes: the same bits
    xn = reference_ops.rms_norm(x, norm_weight, 1e-6) if is_norm_and_accumulate else x
    assert_dot_close(outs[0] - residual, values.astype(np.float64) @ xn, np.abs(values) @ np.abs(xn))


def test_each_native_format_has_its_own_looping_head_shape():
    assert set(gemv_native._HEAD_CONFIGS) == set(gemv_native.BUILT_FORMATS)  # none falls back by a misspelt key
    for fmt in gemv_native.BUILT_FORMATS:
        assert gemv_native.head_config(fmt).validate().blocks_per_sm > 0
    assert gemv_native.head_config("Q8_0") != gemv_native.head_config("Q4_0")  # the sweep's fastest differ
    assert gemv_native.head_config("Q4_1") == gemv_native.head_config("Q4_0")  # the Numba kernel, unread


def test_a_negative_blocks_per_sm_is_refused():
    with pytest.raises(ValueError, match="blocks_per_sm"):
        NativeGemvConfig(blocks_per_sm=-1).validate()


@needs_gpu
@pytest.mark.parametrize("fmt", gemv_native.BUILT_FORMATS)
def test_native_gemv_fuses_the_norm_and_accumulates_as_the_numba_kernel_does(fmt):
    num_rows, num_cols = 45, 512
    w, values = random_matrix(fmt, num_rows, num_cols, seed=410)
    rng = np.random.default_rng(411)
    x = (rng.standard_normal(num_cols) * 3).astype(np.float32)
    norm_weight = rng.uniform(0.5, 1.5, num_cols).astype(np.float32)
    residual = rng.standard_normal(num_rows).astype(np.float32)
    outs = []
    for native in (True, False):
        y = dev(residual)
        gemv(w, dev(x), y, norm_weight=dev(norm_weight), accumulate=True, native=native)
        outs.append(host(y))
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6)
    ref = residual + values.astype(np.float64) @ x_normed
    magnitude = np.abs(values) @ np.abs(x_normed) + np.abs(residual)
    for out in outs:
        assert_dot_close(out, ref, magnitude)
    assert_dot_close(outs[0], outs[1], magnitude)


@needs_gpu
def test_native_multi_gemv_mixes_formats_and_falls_back_for_the_rest():
    rng = np.random.default_rng(420)
    x = (rng.standard_normal(512) * 2).astype(np.float32)
    norm_weight = rng.uniform(0.5, 1.5, 512).astype(np.float32)
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6).astype(np.float64)
    for fmts, native in ((("Q4_K", "Q4_0", "Q8_0"), True), (("Q4_0", "Q4_1", "Q4_0"), None), (("Q8_0", "F32"), True),
                         (("Q5_K", "Q5_K", "Q6_K"), True)):
        matrices = [random_matrix(fmt, rows, 512, seed=421 + i) for i, (fmt, rows) in
                    enumerate(zip(fmts, (37, 5, 19)))]
        ys = gemv_multi([w for w, _ in matrices], dev(x), norm_weight=dev(norm_weight), native=native)
        for y, (_, values) in zip(ys, matrices):
            assert_dot_close(host(y), values @ x_normed, np.abs(values) @ np.abs(x_normed))
    with pytest.raises(ValueError, match="native GEMV needs"):
        gemv_multi([w for w, _ in matrices[:1]] + [random_matrix("Q4_1", 3, 512, seed=429)[0]], dev(x),
                   native=True)


@needs_gpu
@pytest.mark.parametrize("fmts, ffn, top_k", [
    (("Q4_0", "Q4_0", "Q4_0"), 288, 3), (("Q8_0", "Q8_0", "Q4_K"), 256, 3), (("Q4_K", "Q4_K", "Q8_0"), 288, 3),
    (("Q4_0", "Q4_0", "Q4_0"), 768, 8),  # 8 x 24 chunks per down row: several passes of a warp's lanes
    (("Q4_K", "Q4_K", "Q6_K"), 256, 3), (("Q5_K", "Q5_K", "Q6_K"), 256, 3),  # Q4_K_M's and Q5_K_M's experts
    (("Q6_K", "Q6_K", "Q5_K"), 768, 8),
    (("IQ4_XS", "IQ4_XS", "IQ4_XS"), 256, 3), (("IQ3_XXS", "IQ3_XXS", "IQ4_XS"), 768, 8),
])
def test_native_experts_match_the_reference_and_skip_missing_slots(fmts, ffn, top_k):
    num_slots, dim, num_tokens = 10, 512, 2
    (gate, up, down), values = random_experts(fmts, num_slots, dim, ffn, seed=430)
    rng = np.random.default_rng(431)
    x = (rng.standard_normal((num_tokens, dim)) * 2).astype(np.float32)
    norm_weight = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    # -1 and 10 name no slot: they contribute nothing
    ids = np.array([[5, 0, -1, 9, 1, 2, 3, 4], [2, 10, 3, 7, 8, 6, 0, 1]], np.int32)[:, :top_k]
    weights = rng.uniform(0.1, 1.0, (num_tokens, top_k)).astype(np.float32)
    residual = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    outs = []
    for native in (True, False):
        out = dev(residual)
        moe_experts_decode(dev(x), dev(ids), dev(weights), gate, up, down, out, num_experts=num_slots,
                           norm_weight=dev(norm_weight), native=native)
        outs.append(host(out))
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6)
    ref = residual.copy()
    for t in range(num_tokens):  # the reference over each token's valid experts only
        valid = (ids[t] >= 0) & (ids[t] < num_slots)
        ref[t] += reference_ops.moe(x_normed[t:t + 1], ids[t:t + 1, valid], weights[t:t + 1, valid], *values)[0]
    for out in outs:
        assert_close_to_scale(out, ref, 2e-6)
    assert_close_to_scale(outs[0], outs[1], 2e-6)


@needs_gpu
@pytest.mark.parametrize("fmts", [("Q4_0", "Q4_0", "Q4_0"), ("Q4_K", "Q4_K", "Q6_K"), ("IQ3_XXS", "IQ3_XXS", "IQ4_XS")])
def test_every_experts_launch_shape_gives_the_same_bits(fmts):
    """A warp a row, one wave of looping blocks, and single-warp blocks that each loop over tens to hundreds of
    rows: a row's sums are the same chain in every shape, for one token and for a verify step's five."""
    num_slots, dim, ffn, top_k = 12, 512, 768, 8
    (gate, up, down), _ = random_experts(fmts, num_slots, dim, ffn, seed=470)
    rng = np.random.default_rng(471)
    for num_tokens in (1, 5):
        x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
        ids = np.stack([rng.choice(num_slots, top_k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
        ids[0, 3] = -1  # no such slot: nothing added
        weights = rng.uniform(0.1, 1.0, (num_tokens, top_k)).astype(np.float32)
        norm_weight = rng.uniform(0.5, 1.5, dim).astype(np.float32)
        outs = []
        for config in (gemv_native.ExpertsConfig(blocks_per_sm=0), gemv_native.EXPERTS_CONFIG,
                       gemv_native.ExpertsConfig(warps=8, down_warps=4, blocks_per_sm=1),
                       gemv_native.ExpertsConfig(warps=1, down_warps=1, blocks_per_sm=1),
                       gemv_native.ExpertsConfig(warps=4, down_warps=8, blocks_per_sm=3),
                       gemv_native.ExpertsConfig(blocks_per_sm=6, max_registers=40)):
            out = dev(np.zeros((num_tokens, dim), np.float32))
            hidden = dev(np.zeros((num_tokens * top_k, ffn), np.float32))
            gemv_native.moe_experts_native(dev(x), dev(ids), dev(weights), gate, up, down, out, hidden,
                                           norm_weight=dev(norm_weight), config=config)
            outs.append(host(out))
        for out in outs[1:]:
            assert np.array_equal(out, outs[0])
        one = dev(np.zeros((1, dim), np.float32))  # the first token alone: its bits in a five-token launch
        gemv_native.moe_experts_native(dev(x[:1]), dev(ids[:1]), dev(weights[:1]), gate, up, down, one,
                                       dev(np.zeros((top_k, ffn), np.float32)), norm_weight=dev(norm_weight))
        assert np.array_equal(host(one)[0], outs[0][0])


def test_up_to_three_tokens_take_one_wave_of_expert_blocks_and_more_take_two():
    assert [gemv_native.experts_config(n).blocks_per_sm for n in (1, 2, 3, 4, 5)] == [3, 3, 3, 6, 6]


def test_experts_launch_shapes_are_checked():
    with pytest.raises(ValueError, match="warps must be one of"):
        gemv_native.ExpertsConfig(warps=3).validate()
    with pytest.raises(ValueError, match="down_warps must be one of"):
        gemv_native.ExpertsConfig(down_warps=16).validate()
    with pytest.raises(ValueError, match="blocks_per_sm must be 0"):
        gemv_native.ExpertsConfig(blocks_per_sm=-1).validate()
    with pytest.raises(ValueError, match="max_registers must be 0"):
        gemv_native.ExpertsConfig(max_registers=16).validate()


def test_asking_for_the_native_path_where_it_cannot_run_names_the_fallback():
    w, values = random_matrix("Q4_1", 4, 256, seed=440)
    x = _x(256, 441)
    with pytest.raises(ValueError, match="native=None"):
        gemv(w, dev(x), native=True)
    # the automatic choice runs wherever it can: here the Numba kernel (Q4_1, or no GPU at all)
    assert_dot_close(host(gemv(w, dev(x))), values.astype(np.float64) @ x, np.abs(values) @ np.abs(x))
    if not has_cuda_device():
        q4, _ = random_matrix("Q4_0", 4, 256, seed=442)
        assert not gemv_native.is_supported(q4)
        with pytest.raises(ValueError, match="native GEMV needs a GPU"):
            gemv(q4, dev(x), native=True)


@functools.cache
def _q4_k_staging_kernel(num_cols: int):
    stage = gemv_native._stage_rows_device(num_cols, 32, False, 1, gemv_native.x_floats(num_cols, True), True)

    @cuda.jit
    def stage_q4_k(x, xs):
        tid = cuda.threadIdx.x
        stage(x, x[0], np.float32(0.0), xs, xs, tid)
        cuda.syncthreads()
        gemv_native.device_stage_half_sums(xs, num_cols // 32, tid, cuda.blockDim.x)

    return stage_q4_k


@pytest.mark.parametrize("num_super_blocks", [1, 3])
def test_q4_k_staging_spaces_super_blocks_and_sums_each_half_in_the_rows_order(num_super_blocks):
    num_cols = 256 * num_super_blocks
    x = np.random.default_rng(450 + num_super_blocks).standard_normal((1, num_cols)).astype(np.float32)
    xs = dev(np.full(gemv_native.x_floats(num_cols, True), np.nan, np.float32))
    _q4_k_staging_kernel(num_cols)[1, 32](dev(x), xs)
    got = host(xs).reshape(num_super_blocks, gemv_native.Q4_K_SB_STRIDE)
    assert np.isnan(got[:, -4:]).all()  # the 4 floats that move the next super-block onto other banks
    groups = got[:, :-4].reshape(num_super_blocks * 8, gemv_native.X_STRIDE)
    np.testing.assert_array_equal(groups[:, :32], x.reshape(-1, 32))
    for g, group in enumerate(groups):
        for half in range(2):
            total = np.float32(0.0)  # four quads, each as two pairs, to the bit
            for quad in group[16 * half:16 * half + 16].reshape(4, 4):
                total = np.float32(total + np.float32(np.float32(quad[0] + quad[1]) + np.float32(quad[2] + quad[3])))
            assert group[32 + half] == total, (g, half)
    assert np.isnan(groups[:, 34:]).all()


class _Plane:
    def __init__(self, address):
        self.device_ctypes_pointer = type("Pointer", (), {"value": address})()


def test_q4_k_rows_need_word_aligned_scale_planes():
    # the Q4_K rows read d and dmin, and the 12 scale bytes, as 32-bit words
    assert gemv_native._is_word_aligned(_Plane(4096), _Plane(4100))
    assert not gemv_native._is_word_aligned(_Plane(4096), _Plane(4098))
    assert not gemv_native._is_word_aligned(_Plane(4097), _Plane(4096))
