"""Decode experts read through a table of plane addresses (moe_addressed): some experts' planes in device
memory, the others' in pinned host memory read over PCIe, against the stacked C++ rows (bit for bit) and
the NumPy reference. The C++ needs a real GPU; in the simulator the addressed path is refused by name."""

import numpy as np
import pytest
from kernel_data import assert_close_to_scale, dev, host, random_experts
from numba import cuda

from strata.backend.select import has_cuda_device
from strata.gpu.kernels import gemv_native
from strata.gpu.kernels.moe import moe_experts_decode
from strata.gpu.kernels.moe_addressed import HOST_FLAG, TABLE_COLUMNS, can_address, moe_experts_addressed
from strata.gpu.kernels.packing import PackedMatrix
from strata.model import reference_ops

needs_gpu = pytest.mark.skipif(not has_cuda_device(), reason="needs a real CUDA device (not the simulator)")


@pytest.fixture(autouse=True)
def every_built_format_served(monkeypatch):
    monkeypatch.setattr(gemv_native, "FORMATS", gemv_native.BUILT_FORMATS)
    monkeypatch.setattr(gemv_native, "EXPERT_FORMATS", gemv_native.BUILT_EXPERT_FORMATS)


def _mapped(plane):
    """A pinned host copy of a device plane, as a device array over the same pages (zero-copy)."""
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    pinned = cuda.mapped_array(plane.shape, dtype=plane.dtype)
    pinned[...] = plane.copy_to_host()
    return DeviceNDArray(pinned.shape, pinned.strides, pinned.dtype, gpu_data=pinned.gpu_data)


def _table(stacks, in_host, num_experts):
    """[N, C]: expert e's planes in the device stacks, or in pinned host copies where in_host[e]; the host
    copies are returned too (they must outlive the launches)."""
    copies = [PackedMatrix(m.fmt, m.num_rows, m.num_cols, *(_mapped(p) for p in (m.quants, m.scales, m.extra)))
              for m in stacks]
    table = np.zeros((num_experts, TABLE_COLUMNS), np.uint64)
    for e in range(num_experts):
        for index, (on_device, on_host) in enumerate(zip(stacks, copies)):
            source = on_host if in_host[e] else on_device
            for p, plane in enumerate((source.quants, source.scales, source.extra)):
                # expert e's rows of the plane; a stand-in plane (one row) is never read
                rows_each = source.num_rows // num_experts if plane.shape[0] == source.num_rows else 0
                table[e, 3 * index + p] = plane.device_ctypes_pointer.value + e * rows_each * plane.strides[0]
        table[e, HOST_FLAG] = int(in_host[e])
    return table, copies


@needs_gpu
@pytest.mark.parametrize("fmts, ffn, top_k", [
    (("Q4_0", "Q4_0", "Q4_0"), 768, 8), (("Q8_0", "Q8_0", "Q4_K"), 256, 3), (("Q4_K", "Q4_K", "Q6_K"), 256, 3),
    (("Q5_K", "Q5_K", "Q6_K"), 256, 3), (("IQ3_XXS", "IQ3_XXS", "IQ4_XS"), 768, 8),
])
def test_addressed_experts_give_the_stacked_rows_bits_wherever_their_planes_lie(fmts, ffn, top_k):
    num_experts, dim, num_tokens = 10, 512, 3
    stacks, values = random_experts(fmts, num_experts, dim, ffn, seed=470)
    rng = np.random.default_rng(471)
    in_host = rng.random(num_experts) < 0.5
    table, copies = _table(stacks, in_host, num_experts)
    x = (rng.standard_normal((num_tokens, dim)) * 2).astype(np.float32)
    norm_weight = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    # -1 and 10 name no expert: they contribute nothing
    ids = np.array([[5, 0, -1, 9, 1, 2, 3, 4], [2, 10, 3, 7, 8, 6, 0, 1], [9, 8, 7, 6, 5, 4, 3, 2]],
                   np.int32)[:, :top_k]
    weights = rng.uniform(0.1, 1.0, (num_tokens, top_k)).astype(np.float32)
    residual = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    assert can_address(*stacks, top_k)
    stacked, addressed, host_reads = dev(residual), dev(residual), dev(np.zeros(1, np.int32))
    moe_experts_decode(dev(x), dev(ids), dev(weights), *stacks, stacked, num_experts=num_experts,
                       norm_weight=dev(norm_weight), native=True)
    moe_experts_addressed(dev(x), dev(ids), dev(weights), dev(table), stacks[0], stacks[2], addressed,
                          norm_weight=dev(norm_weight), host_reads=host_reads)
    assert np.array_equal(host(addressed), host(stacked))
    uncounted = dev(residual)  # without a count of its own the launch keeps one aside (never in ids)
    moe_experts_addressed(dev(x), dev(ids), dev(weights), dev(table), stacks[0], stacks[2], uncounted,
                          norm_weight=dev(norm_weight))
    assert np.array_equal(host(uncounted), host(stacked))
    capped = dev(residual)  # fewer registers a thread (spilled or not): the same sums, the same bits
    moe_experts_addressed(dev(x), dev(ids), dev(weights), dev(table), stacks[0], stacks[2], capped,
                          norm_weight=dev(norm_weight), config=gemv_native.ExpertsConfig(max_registers=40))
    assert np.array_equal(host(capped), host(stacked))
    valid = (ids >= 0) & (ids < num_experts)
    assert host(host_reads)[0] == int(in_host[ids[valid]].sum())
    x_normed = reference_ops.rms_norm(x, norm_weight, 1e-6)
    ref = residual.copy()
    for t in range(num_tokens):
        ref[t] += reference_ops.moe(x_normed[t:t + 1], ids[t:t + 1, valid[t]], weights[t:t + 1, valid[t]], *values)[0]
    assert_close_to_scale(host(addressed), ref, 2e-6)
    del copies


def test_the_addressed_path_is_refused_by_name_where_it_cannot_run():
    stacks, _ = random_experts(("Q4_1",) * 3, 2, 64, 32, seed=480)  # no C++ rows for Q4_1 (nor any in the simulator)
    assert not can_address(*stacks, 1)
    table = dev(np.zeros((2, TABLE_COLUMNS), np.uint64))
    out = dev(np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="addressed experts need the linked C\\+\\+ rows"):
        moe_experts_addressed(dev(np.ones((1, 64), np.float32)), dev(np.zeros((1, 1), np.int32)),
                              dev(np.ones((1, 1), np.float32)), table, stacks[0], stacks[2], out)
