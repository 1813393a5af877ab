import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize as gguf_quantize
from kernel_data import dev, reference_dequant

from strata.gpu.kernels.kvcache import append_kv, dequantize_kv, empty_kv_layer
from strata.gpu.kernels.packing import unpack

WIDTH = 96  # three 32-blocks: with 2 threads per block the grid's last block is half empty


@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
def test_append_writes_ggml_blocks_at_positions(fmt):
    rng = np.random.default_rng(60)
    k_new = (rng.standard_normal((3, WIDTH)) * 2).astype(np.float32)
    v_new = (rng.standard_normal((3, WIDTH)) * 2).astype(np.float32)
    k_new[0, :32] = 0.0  # an all-zero block quantizes to d = 0
    k_new[1, 5] = -9.0  # a negative extreme sets Q4_0's sign of d
    v_new[2, 40] = 0.5 / 127 * 3  # a value whose scaled magnitude sits on .5: round half away
    positions = np.array([4, 0, 6], dtype=np.int32)
    k_cache, v_cache = empty_kv_layer(fmt, 8, WIDTH)
    append_kv(k_cache, v_cache, dev(k_new), dev(v_new), dev(positions), threads=2)
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        raw = unpack(cache)
        expected = gguf_quantize(new, QType[fmt]).view(np.uint8).reshape(3, -1)
        np.testing.assert_array_equal(raw[positions], expected)
        untouched = np.setdiff1d(np.arange(8), positions)
        assert not raw[untouched].any()


def test_append_rejects_positions_outside_the_cache_and_bad_formats():
    k_cache, v_cache = empty_kv_layer("Q8_0", 4, 32, on_device=False)
    x = np.zeros((1, 32), np.float32)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 4\)"):
        append_kv(k_cache, v_cache, x, x, np.array([4], np.int32))
    with pytest.raises(ValueError, match="KV cache format"):
        empty_kv_layer("Q4_K", 4, 256)
    with pytest.raises(ValueError, match=r"v_new must have shape \(1, 32\)"):
        append_kv(k_cache, v_cache, x, np.zeros((2, 32), np.float32), np.array([0], np.int32))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_dequantize_rounds_each_product_to_f16_and_leaves_later_rows(fmt):
    rng = np.random.default_rng(61)
    values = (rng.standard_normal((5, WIDTH)) * 3).astype(np.float32)
    k_cache, v_cache = empty_kv_layer(fmt, 7, WIDTH)
    append_kv(k_cache, v_cache, dev(values), dev(-values), dev(np.arange(5, dtype=np.int32)), threads=2)
    k_out, v_out = empty_kv_layer("F16", 6, WIDTH)
    dequantize_kv(k_cache, v_cache, 4, k_out, v_out, threads=4)  # 12 octets a row: 3 blocks of 4 threads
    for cache, out in ((k_cache, k_out), (v_cache, v_out)):
        expected = reference_dequant(unpack(cache)[:4], fmt).astype(np.float16)  # f32 d * q, then f16
        got = out.quants.copy_to_host()
        np.testing.assert_array_equal(got[:4], expected)
        assert not got[4:].any()


def test_dequantize_rejects_a_short_output_and_a_quantized_one():
    k_cache, v_cache = empty_kv_layer("Q4_0", 4, 32, on_device=False)
    k_out, v_out = empty_kv_layer("F16", 2, 32, on_device=False)
    with pytest.raises(ValueError, match="k_out has 2 rows, fewer than num_rows 3"):
        dequantize_kv(k_cache, v_cache, 3, k_out, v_out)
    with pytest.raises(ValueError, match="k_out format Q4_0 is not supported here"):
        dequantize_kv(k_cache, v_cache, 2, k_cache, v_out)
