import numpy as np
import pytest
from kernel_data import ALL_FORMATS, dev, host, random_matrix

from strata.gpu.kernels.elementwise import add, embedding, to_float16
from strata.gpu.kernels.packing import FORMATS
from strata.model import reference_ops


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_embedding_dequantizes_rows_like_gguf(fmt):
    # two blocks (K-quants: two super-blocks) per row, so octets cross a block boundary
    cols = 2 * FORMATS[fmt].block_elems if not FORMATS[fmt].is_float else 72
    table, values = random_matrix(fmt, 6, cols, seed=10)
    ids = np.array([5, 0, 3, 5], dtype=np.int32)
    out = host(embedding(table, dev(ids), threads=32))
    # same products in the same order as gguf-py; only an FMA contraction can move the last bit
    np.testing.assert_allclose(out, reference_ops.embed(values, ids), rtol=1e-6, atol=1e-7)


def test_embedding_rejects_ids_outside_the_table():
    table, _ = random_matrix("Q8_0", 4, 32, seed=11)
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 4\)"):
        embedding(table, np.array([4], dtype=np.int32))
    with pytest.raises(TypeError, match="token_ids must have dtype int32"):
        embedding(table, np.array([1], dtype=np.int64))


def test_add_accumulates_in_place():
    rng = np.random.default_rng(12)
    y, x = rng.standard_normal((3, 50)).astype(np.float32), rng.standard_normal((3, 50)).astype(np.float32)
    y_dev = dev(y)
    add(y_dev, dev(x), alpha=0.5, threads=32)
    np.testing.assert_allclose(host(y_dev), y + np.float32(0.5) * x, rtol=1e-6)
    with pytest.raises(ValueError, match="x must have shape"):
        add(y_dev, dev(x[:, :49]))


def test_swiglu_matches_reference_including_large_negative_gates():
    from strata.gpu.kernels.activation import swiglu

    rng = np.random.default_rng(13)
    gate = (rng.standard_normal((3, 40)) * 4).astype(np.float32)
    gate[0, :3] = [-100.0, 100.0, 0.0]  # exp(100) would overflow float32 in a naive sigmoid
    up = rng.standard_normal((3, 40)).astype(np.float16)
    out = host(swiglu(dev(gate), dev(up), threads=32))
    ref = reference_ops.silu(gate.astype(np.float64)) * up.astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-7)


def test_to_float16_rounds_like_numpy():
    x = np.random.default_rng(11).standard_normal((37, 70)).astype(np.float32) * 1e3
    x[0, :4] = [65520.0, -1e-8, 6.1e-5, np.inf]  # overflow, underflow, subnormal, inf
    np.testing.assert_array_equal(host(to_float16(dev(x))), x.astype(np.float16))
