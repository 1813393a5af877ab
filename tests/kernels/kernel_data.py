"""Seeded inputs for the kernel tests: random GGUF blocks of every format, device round trips."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize as gguf_dequantize
from numba import cuda

from strata.gpu.kernels.moe import moe_experts_prefill
from strata.gpu.kernels.moe_route import moe_group
from strata.gpu.kernels.packing import FORMATS, PackedMatrix, pack, to_device
from strata.model import reference_ops

ALL_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "F16", "F32")
# the formats the kernels read through the generic dequantizers only (tests/kernels/test_quant_formats.py)
GENERIC_FORMATS = ("BF16", "Q5_0", "Q5_1", "IQ4_NL", "Q5_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_S")
# fp16 scale magnitudes that keep a format's values O(1): 1 / (largest sub-scale x largest level)
_SCALE_MAGNITUDES = {"Q4_K": 1.0 / 64, "Q5_K": 1.0 / 128, "Q6_K": 1.0 / 1024, "IQ4_NL": 1.0 / 128,
                     "IQ4_XS": 1.0 / 4096, "IQ3_XXS": 1.0 / 512, "IQ3_S": 1.0 / 512, "IQ2_S": 1.0 / 256}
# absolute tolerance of a dot product over K products of O(1) values with float32 accumulation,
# relative to sqrt(K): the kernels and NumPy sum in different orders
DOT_RTOL = 2e-5


def random_gguf_bytes(fmt: str, num_rows: int, num_cols: int, rng: np.random.Generator,
                      magnitude: float | None = None) -> np.ndarray:
    """[num_rows, row_bytes] uint8: random quants, fp16 scales drawn small so values stay O(1) (uniform in
    +-magnitude; by default the format's entry of _SCALE_MAGNITUDES, else 1 / 8)."""
    f = FORMATS[fmt]
    if f.is_float:
        values = rng.standard_normal((num_rows, num_cols)).astype(np.float32 if fmt != "F16" else np.float16)
        if fmt == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.view(np.uint8)
    num_blocks = num_rows * num_cols // f.block_elems
    blocks = rng.integers(0, 256, size=(num_blocks, f.block_bytes), dtype=np.uint8)
    scale_fields = [(start, end) for plane, start, end in f.fields if plane == "scales"]
    for start, end in scale_fields:
        num_halves = (end - start) // 2
        scale = _SCALE_MAGNITUDES.get(fmt, 1.0 / 8) if magnitude is None else magnitude
        halves = (rng.uniform(-1.0, 1.0, size=(num_blocks, num_halves)) * scale).astype(np.float16)
        blocks[:, start:end] = halves.view(np.uint8)
    return blocks.reshape(num_rows, -1)


def reference_dequant(raw: np.ndarray, fmt: str) -> np.ndarray:
    """gguf-py's dequantization of GGUF bytes: [rows, row_bytes] -> [rows, cols] float32."""
    return np.asarray(gguf_dequantize(raw, QType[fmt]), dtype=np.float32)


def random_matrix(fmt: str, num_rows: int, num_cols: int, seed: int,
                  magnitude: float | None = None) -> tuple[PackedMatrix, np.ndarray]:
    """A packed matrix on the device and its float32 values per gguf-py (scales as random_gguf_bytes')."""
    raw = random_gguf_bytes(fmt, num_rows, num_cols, np.random.default_rng(seed), magnitude)
    return to_device(pack(raw, fmt)), reference_dequant(raw, fmt)


def random_experts(fmts: tuple[str, str, str], num_experts: int, dim: int, ffn: int, seed: int) -> tuple:
    """Stacked routed experts (gate, up, down) in ``fmts`` on the device, and their values per gguf-py as
    ([N, F, H], [N, F, H], [N, H, F]) float32."""
    gate, gate_v = random_matrix(fmts[0], num_experts * ffn, dim, seed)
    up, up_v = random_matrix(fmts[1], num_experts * ffn, dim, seed + 1)
    down, down_v = random_matrix(fmts[2], num_experts * dim, ffn, seed + 2)
    return (gate, up, down), (gate_v.reshape(num_experts, ffn, dim), up_v.reshape(num_experts, ffn, dim),
                              down_v.reshape(num_experts, dim, ffn))


def dev(a: np.ndarray):
    return cuda.to_device(np.ascontiguousarray(a))


def host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.copy_to_host()


def block_elems(fmt: str) -> int:
    """Values a block of the format holds; the float formats count in blocks of 32 like Q8_0."""
    return 32 if FORMATS[fmt].is_float else FORMATS[fmt].block_elems


def cols_around_blocks(fmt: str, num_blocks: int) -> tuple[int, ...]:
    """Column counts one block below, at and above num_blocks blocks of the format."""
    elems = block_elems(fmt)
    return tuple(elems * n for n in (num_blocks - 1, num_blocks, num_blocks + 1))


def assert_dot_close(out: np.ndarray, ref: np.ndarray, magnitude: np.ndarray, rtol: float = 1e-5, atol: float = 1e-6):
    """Float32 sums of many products, compared with an error bound relative to sum |w x| per output."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    bound = rtol * np.asarray(magnitude, np.float64) + atol
    worst = np.max(np.abs(out - ref) - bound) if out.size else 0.0
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert worst <= 0, f"max excess error {worst:.3g} (max |diff| {np.max(np.abs(out - ref)):.3g})"


def assert_close_to_scale(out: np.ndarray, ref: np.ndarray, rel: float):
    """|out - ref| <= rel * max|ref| everywhere: for long chains of float32 sums (MoE, whole layers)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    scale = np.max(np.abs(ref))
    worst = np.max(np.abs(out - ref))
    assert worst <= rel * scale, f"max |diff| {worst:.3g} exceeds {rel:g} x max |ref| {scale:.3g}"


def check_moe_prefill(config, fmts: tuple[str, str, str], seed: int, *, num_tokens: int = 9, num_experts: int = 4,
                      top_k: int = 2, dim: int = 64, ffn: int = 96) -> None:
    """moe_experts_prefill under `config`, gate / up / down of `fmts`, against reference_ops.moe: x and
    the routing from `seed`, the three matrices from seed + 1, + 2, + 3."""
    rng = np.random.default_rng(seed)
    gate, gate_v = random_matrix(fmts[0], num_experts * ffn, dim, seed + 1)
    up, up_v = random_matrix(fmts[1], num_experts * ffn, dim, seed + 2)
    down, down_v = random_matrix(fmts[2], num_experts * dim, ffn, seed + 3)
    values = (gate_v.reshape(num_experts, ffn, dim), up_v.reshape(num_experts, ffn, dim),
              down_v.reshape(num_experts, dim, ffn))
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    ids, weights = reference_ops.route(rng.standard_normal((num_tokens, num_experts)), top_k)
    ids, weights = ids.astype(np.int32), weights.astype(np.float32)
    groups = moe_group(dev(ids), dev(weights), num_experts, config.block_m, threads=8)
    out = dev(np.zeros((num_tokens, dim), np.float32))
    moe_experts_prefill(dev(x), groups, gate, up, down, out, num_experts=num_experts, config=config)
    assert_close_to_scale(host(out), reference_ops.moe(x, ids, weights, *values), 5e-3)
