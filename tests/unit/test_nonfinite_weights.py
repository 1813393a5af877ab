"""Weights that are NaN or infinite are found at load from the blocks' float fields alone."""

import numpy as np
import pytest
from corrupt import SCALE_OFFSET, corrupt_block
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from strata.errors import NonFiniteWeightError
from strata.model import quants
from strata.model.gguf_file import TensorRef, check_finite, first_nonfinite_block

NUM_ROWS, NUM_COLS = 6, 512
FIELDS = {  # every float field of a block, set finite before a test corrupts one
    QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q5_0: (0,), QType.Q4_1: (0, 2), QType.Q5_1: (0, 2), QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2), QType.Q6_K: (208,), QType.IQ4_NL: (0,), QType.IQ4_XS: (0,), QType.IQ3_XXS: (0,),
    QType.IQ3_S: (0,), QType.IQ2_S: (0,),
}


def random_tensor(qtype: QType, seed: int) -> TensorRef:
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    if qtype in (QType.F32, QType.F16):
        dtype = np.float32 if qtype == QType.F32 else np.float16
        raw = rng.standard_normal((NUM_ROWS, NUM_COLS)).astype(dtype).view(np.uint8)
    elif qtype == QType.BF16:
        raw = (rng.standard_normal((NUM_ROWS, NUM_COLS)).astype(np.float32).view(np.uint32) >> 16) \
            .astype(np.uint16).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, size=(NUM_ROWS * NUM_COLS // block_elems, block_bytes), dtype=np.uint8)
        for offset in FIELDS[qtype]:
            blocks[:, offset:offset + 2] = rng.uniform(-1, 1, (len(blocks), 1)).astype(np.float16).view(np.uint8)
        raw = blocks
    return TensorRef("blk.0.attn_q.weight", qtype, (NUM_ROWS, NUM_COLS), raw.reshape(NUM_ROWS, -1).copy())


@pytest.mark.parametrize("qtype", list(SCALE_OFFSET), ids=lambda q: q.name)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_the_first_block_holding_a_non_finite_value_is_found_as_dequantizing_finds_it(qtype, value):
    ref = random_tensor(qtype, seed=int(qtype))
    assert first_nonfinite_block(ref) is None
    assert np.isfinite(quants.dequantize(ref.data, qtype, ref.shape)).all()
    num_blocks = ref.data.size // GGML_QUANT_SIZES[qtype][1]
    for block in np.random.default_rng(1).choice(num_blocks, size=3, replace=False):
        corrupted = TensorRef(ref.name, qtype, ref.shape, ref.data.copy())
        corrupt_block(corrupted.data, qtype, int(block), value)
        with np.errstate(invalid="ignore"):
            values = quants.dequantize(corrupted.data, qtype, ref.shape).reshape(num_blocks, -1)
        assert first_nonfinite_block(corrupted) == int(np.flatnonzero(~np.isfinite(values).all(axis=1))[0]) == block


def test_the_error_names_the_tensor_the_row_and_the_fix():
    ref = random_tensor(QType.Q4_0, seed=2)
    blocks_per_row = NUM_COLS // 32
    corrupt_block(ref.data, QType.Q4_0, 3 * blocks_per_row + 5)
    with pytest.raises(NonFiniteWeightError, match=r"model.gguf: tensor blk.0.attn_q.weight \(Q4_0\) holds NaN or "
                                                   r"infinity \(row 3, block 5 of the row\): the file is corrupt; "
                                                   "convert or download the model again") as caught:
        check_finite(ref, "model.gguf")
    assert caught.value.tensor_name == "blk.0.attn_q.weight"


def test_every_format_strata_reads_has_its_float_fields_listed():
    assert set(SCALE_OFFSET) == {QType(t) for t in quants._LAYOUTS}


def test_a_format_without_listed_fields_is_checked_by_decoding_it(monkeypatch):
    import strata.model.gguf_file as gguf_file

    monkeypatch.setattr(gguf_file, "_FLOAT_FIELDS", {})
    ref = random_tensor(QType.Q4_K, seed=5)
    assert first_nonfinite_block(ref) is None
    corrupt_block(ref.data, QType.Q4_K, 9)
    assert first_nonfinite_block(ref) == 9


def test_a_large_tensor_is_checked_past_the_first_batch_of_blocks(monkeypatch):
    import strata.model.gguf_file as gguf_file

    monkeypatch.setattr(gguf_file, "_CHECK_BLOCKS", 7)  # batches of 7 blocks: the bad one is in a later batch
    ref = random_tensor(QType.Q8_0, seed=4)
    corrupt_block(ref.data, QType.Q8_0, 61, np.inf)
    assert first_nonfinite_block(ref) == 61
