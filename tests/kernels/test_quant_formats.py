"""The formats the kernels read through the generic dequantizers (BF16, Q5_0/Q5_1, Q5_K, the I-quants):
octet dequantizer and dot product against the host's dequantization, then each role's kernel."""

import functools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from kernel_data import (
    GENERIC_FORMATS,
    assert_close_to_scale,
    assert_dot_close,
    dev,
    host,
    random_gguf_bytes,
)
from numba import cuda

from strata.gpu.kernels.elementwise import embedding
from strata.gpu.kernels.gemm import gemm
from strata.gpu.kernels.gemm_config import GemmConfig
from strata.gpu.kernels.gemv import GemvConfig, gemv
from strata.gpu.kernels.moe import moe_experts_decode, moe_experts_prefill
from strata.gpu.kernels.moe_route import moe_group
from strata.gpu.kernels.packing import FORMATS, pack, to_device
from strata.gpu.kernels.quant_device import dequant8_for
from strata.gpu.kernels.quant_dot import dot8_for
from strata.model import quants, reference_ops

GEMV_TINY = GemvConfig(threads=32, lanes_per_row=8, rows_per_group=2)
GEMM_TINY = GemmConfig(block_m=8, block_n=8, thread_m=2, thread_n=2)


def _cols(fmt: str, num_blocks: int = 2) -> int:
    return num_blocks * (32 if FORMATS[fmt].is_float else FORMATS[fmt].block_elems)


def _matrix(fmt: str, num_rows: int, num_cols: int, seed: int):
    """A packed matrix on the device and its values per strata's host dequantization."""
    raw = random_gguf_bytes(fmt, num_rows, num_cols, np.random.default_rng(seed))
    return to_device(pack(raw, fmt)), quants.dequantize(raw, QType[fmt], (num_rows, num_cols))


@functools.cache
def _octets_kernel(fmt: str):
    """out[row, 8 octet + i] = the octet's dequantized values, dots[row, octet] = its dot with x."""
    dequant8, dot8 = dequant8_for(fmt), dot8_for(fmt)

    @cuda.jit
    def octets_kernel(quants, scales, extra, x, out, dots):
        row = cuda.blockIdx.x
        xs = cuda.local.array(8, np.float32)
        for octet in range(cuda.threadIdx.x, dots.shape[1], cuda.blockDim.x):
            dequant8(quants, scales, extra, row, octet, out[row], octet * 8)
            for i in range(8):
                xs[i] = x[octet * 8 + i]
            dots[row, octet] = dot8(quants, scales, extra, row, octet, xs)

    return octets_kernel


@pytest.mark.parametrize("fmt", GENERIC_FORMATS)
def test_octet_dequantizer_and_dot_match_the_host(fmt):
    num_rows, num_cols = 3, _cols(fmt)
    w, values = _matrix(fmt, num_rows, num_cols, seed=1)
    x = np.random.default_rng(2).standard_normal(num_cols).astype(np.float32)
    out = cuda.device_array((num_rows, num_cols), np.float32)
    dots = cuda.device_array((num_rows, num_cols // 8), np.float32)
    _octets_kernel(fmt)[num_rows, 16](w.quants, w.scales, w.extra, dev(x), out, dots)
    # the host's products in the host's order; only an FMA contraction on a GPU can move the last bit
    np.testing.assert_allclose(host(out), values, rtol=1e-6, atol=1e-7)
    products = (values.astype(np.float64) * x).reshape(num_rows, -1, 8)
    assert_dot_close(host(dots), products.sum(axis=2), np.abs(products).sum(axis=2))


@pytest.mark.parametrize("fmt", GENERIC_FORMATS)
def test_gemv_and_gemm_read_the_format(fmt):
    num_rows, num_cols = 13, _cols(fmt, 3 if FORMATS[fmt].block_elems == 256 else 5)
    w, values = _matrix(fmt, num_rows, num_cols, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal(num_cols).astype(np.float32)
    assert_dot_close(host(gemv(w, dev(x), config=GEMV_TINY)), values.astype(np.float64) @ x,
                     np.abs(values) @ np.abs(x))
    xs = rng.standard_normal((5, num_cols)).astype(np.float32)
    assert_dot_close(host(gemm(dev(xs), w, config=GEMM_TINY)), xs.astype(np.float64) @ values.T,
                     np.abs(xs) @ np.abs(values).T)


@pytest.mark.parametrize("fmt", GENERIC_FORMATS)
def test_embedding_reads_the_format(fmt):
    table, values = _matrix(fmt, 5, _cols(fmt), seed=5)
    ids = np.array([4, 0, 4, 2], dtype=np.int32)
    out = host(embedding(table, dev(ids), threads=32))
    np.testing.assert_allclose(out, reference_ops.embed(values, ids), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmts", [("Q5_K", "IQ4_XS", "Q5_0"), ("IQ3_XXS", "IQ3_XXS", "IQ4_NL"),
                                  ("Q5_1", "BF16", "IQ2_S")], ids="-".join)
def test_experts_decode_and_prefill_read_the_formats(fmts):
    num_experts, top_k = 3, 2
    dim, ffn = _cols(fmts[0], 1), _cols(fmts[2], 1)  # one block a row: the simulator runs every thread
    gate, gate_v = _matrix(fmts[0], num_experts * ffn, dim, seed=6)
    up, up_v = _matrix(fmts[1], num_experts * ffn, dim, seed=7)
    down, down_v = _matrix(fmts[2], num_experts * dim, ffn, seed=8)
    values = (gate_v.reshape(num_experts, ffn, dim), up_v.reshape(num_experts, ffn, dim),
              down_v.reshape(num_experts, dim, ffn))
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, dim)).astype(np.float32)
    ids, weights = reference_ops.route(rng.standard_normal((3, num_experts)), top_k)
    ids, weights = ids.astype(np.int32), weights.astype(np.float32)
    ref = reference_ops.moe(x, ids, weights, *values)

    out = dev(np.zeros((1, dim), np.float32))
    moe_experts_decode(dev(x[:1]), dev(ids[:1]), dev(weights[:1]), gate, up, down, out, num_experts=num_experts,
                       config=GemvConfig(threads=32, lanes_per_row=4, rows_per_group=4))
    assert_close_to_scale(host(out), ref[:1], 2e-6)

    groups = moe_group(dev(ids), dev(weights), num_experts, GEMM_TINY.block_m, threads=8)
    out = dev(np.zeros((3, dim), np.float32))
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts, config=GEMM_TINY)
    assert_close_to_scale(host(out), ref, 2e-6)
