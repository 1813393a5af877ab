import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize as gguf_quantize

from kernel_data import dev
from strata.gpu.kernels.kvcache import append_kv, empty_kv_layer
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
