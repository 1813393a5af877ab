"""The verifier arena's parts: typed views of one buffer, aligned, disjoint, and no bigger than placed."""

import numpy as np
import pytest

from strata.engine.memory.verifier_arena import VerifierLayout
from strata.errors import EngineError


def test_parts_are_aligned_disjoint_views_of_the_buffer():
    layout = VerifierLayout(hidden_size=40, vocab_size=101, max_rows=5)
    buffer = np.zeros(layout.num_bytes, np.uint8)
    views = layout.carve(buffer)
    assert views["h_in"].shape == (5, 40) and views["h_in"].dtype == np.float32
    assert views["logits"].shape == (5, 101) and views["logits"].dtype == np.float32
    assert views["tok_c"].shape == (1,) and views["targets"].dtype == np.int32
    parts = [views[name] for name in layout.parts()]
    for value, view in enumerate(parts, start=1):  # each part writes only its own bytes
        assert np.shares_memory(view, buffer)
        assert (view.ctypes.data - buffer.ctypes.data) % 256 == 0
        view[...] = value
    for value, view in enumerate(parts, start=1):
        assert np.all(view == value)
    assert layout.num_bytes % 256 == 0
    assert layout.num_bytes < sum(256 + view.nbytes for view in parts)


def test_a_drafts_inputs_are_one_block_in_the_hosts_order():
    layout = VerifierLayout(hidden_size=40, vocab_size=101, max_rows=5)
    views = layout.carve(np.zeros(layout.num_bytes, np.uint8))
    views["inputs"][:] = np.arange(23)  # one copy writes them all: 4 R + 3 ids
    assert views["tok_in"].tolist() == [0, 1, 2, 3, 4] and views["pos_in"].tolist() == [5, 6, 7, 8, 9]
    assert views["chain"].tolist() == [10, 11, 12]  # what a verify step's acceptance writes, at once
    assert views["pos_c"].tolist() == [10] and views["place_c"].tolist() == [11] and views["row_c"].tolist() == [12]
    assert views["window"].tolist() == list(range(13, 23))  # 2 R: the oracle's tokens from the first row's on
    assert views["record"].shape == (6,)  # n, then the R picks


def test_the_logits_rows_dominate_a_real_models_arena():
    layout = VerifierLayout(hidden_size=2048, vocab_size=151936, max_rows=5)  # Qwen3-30B-A3B, spec_depth 4
    assert 5 * 151936 * 4 < layout.num_bytes < 5 * 151936 * 4 + 64 * 1024


def test_a_buffer_smaller_than_the_parts_is_refused():
    layout = VerifierLayout(hidden_size=8, vocab_size=16, max_rows=2)
    with pytest.raises(EngineError, match="verifier arena holds"):
        layout.carve(np.zeros(layout.num_bytes - 1, np.uint8))
