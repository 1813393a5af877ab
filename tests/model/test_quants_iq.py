"""The I-quant lookup tables against gguf-py's own encoding of them, and one hand-built block per format."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from strata.model import iquant_tables, quants


@pytest.mark.parametrize("table, reference", [
    (iquant_tables.IQ3XXS_GRID, gguf.quants.IQ3_XXS),
    (iquant_tables.IQ3S_GRID, gguf.quants.IQ3_S),
    (iquant_tables.IQ2S_GRID, gguf.quants.IQ2_S),
], ids=["IQ3_XXS", "IQ3_S", "IQ2_S"])
def test_grid_entries_match_gguf_py(table, reference):
    reference.init_grid()
    expected = reference.grid.reshape(reference.grid_shape)  # [entries, magnitudes]
    got = table.view(np.uint8).reshape(expected.shape).astype(np.float32)
    np.testing.assert_array_equal(got, expected)


def test_sign_and_level_tables_match_gguf_py():
    np.testing.assert_array_equal(iquant_tables.KSIGNS_IQ2XS, np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8))
    np.testing.assert_array_equal(iquant_tables.KVALUES_IQ4NL, np.array(gguf.quants.IQ4_NL.kvalues, np.int8))
    # every sign byte has an even number of minus signs
    assert all(bin(int(s)).count("1") % 2 == 0 for s in iquant_tables.KSIGNS_IQ2XS)


def test_iq3_xxs_block_built_by_hand():
    d = np.float16(0.25)
    qs = np.arange(64, dtype=np.uint8)  # grid entries 0..63
    scale = 3  # db = d * (0.5 + 3) * 0.5
    aux = np.array([(scale << 28) | 1] + [scale << 28] * 7, np.uint32)  # sign index 1 on elements 0..7
    block = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), qs, aux.view(np.uint8)])
    got = quants.dequantize(block, Q.IQ3_XXS, (256,))
    magnitudes = iquant_tables.IQ3XXS_GRID[:64].view(np.uint8).astype(np.float32)
    signs = np.ones(256, np.float32)
    signs[0] = -1  # KSIGNS[1] = 0x81: elements 0 and 7 negative
    signs[7] = -1
    np.testing.assert_array_equal(got, np.float32(0.25 * 3.5 * 0.5) * magnitudes * signs)
