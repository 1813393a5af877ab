import numpy as np
import pytest
from kernel_data import ALL_FORMATS, GENERIC_FORMATS, random_gguf_bytes

from strata.gpu.kernels.packing import FORMATS, check_packed, pack, plane_shapes, unpack


@pytest.mark.parametrize("fmt", ALL_FORMATS + GENERIC_FORMATS)
def test_pack_unpack_round_trip_is_byte_exact(fmt):
    cols = FORMATS[fmt].block_elems * 3 if not FORMATS[fmt].is_float else 96
    raw = random_gguf_bytes(fmt, 5, cols, np.random.default_rng(1))
    packed = check_packed("w", pack(raw, fmt))
    assert (packed.num_rows, packed.num_cols) == (5, cols)
    assert packed.nbytes == raw.nbytes
    np.testing.assert_array_equal(unpack(packed), raw)


def test_expert_stack_flattens_to_rows():
    raw = random_gguf_bytes("Q8_0", 3 * 4, 64, np.random.default_rng(2)).reshape(3, 4, -1)  # [E, N, bytes]
    packed = pack(raw, "Q8_0")
    assert packed.num_rows == 12
    np.testing.assert_array_equal(unpack(packed)[5], raw[1, 1])


def test_q4_0_planes_hold_the_block_fields():
    raw = random_gguf_bytes("Q4_0", 1, 64, np.random.default_rng(3))  # two 18-byte blocks
    packed = pack(raw, "Q4_0")
    np.testing.assert_array_equal(packed.scales.view(np.uint8)[0], np.concatenate([raw[0, 0:2], raw[0, 18:20]]))
    np.testing.assert_array_equal(packed.quants.view(np.uint8)[0], np.concatenate([raw[0, 2:18], raw[0, 20:36]]))


def test_bad_inputs_are_rejected_with_a_message():
    with pytest.raises(ValueError, match="unsupported quant format"):
        pack(np.zeros((1, 50), np.uint8), "Q3_K")
    with pytest.raises(ValueError, match="whole 18-byte blocks"):
        pack(np.zeros((1, 20), np.uint8), "Q4_0")
    with pytest.raises(TypeError, match="uint8 GGUF bytes"):
        pack(np.zeros((1, 32), np.float32), "Q8_0")
    with pytest.raises(ValueError, match="multiple of 256"):
        plane_shapes("Q4_K", 1, 288)
    packed = pack(random_gguf_bytes("Q8_0", 2, 64, np.random.default_rng(4)), "Q8_0")
    with pytest.raises(ValueError, match=r"w.scales must have shape"):
        check_packed("w", packed._replace(scales=packed.scales[:, :1].copy()))


@pytest.mark.parametrize("fmt", ALL_FORMATS + GENERIC_FORMATS)
def test_format_table_agrees_with_ggml(fmt):
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    f = FORMATS[fmt]
    assert f.ggml_type == GGMLQuantizationType[fmt]
    assert (f.block_elems, f.block_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    assert sum(end - start for _, start, end in f.fields) == (0 if f.is_float else f.block_bytes)
