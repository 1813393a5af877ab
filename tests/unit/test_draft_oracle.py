"""The bench's draft oracle: a position's token depends on the seed and the position alone."""

import numpy as np
import pytest

from strata.bench.draft_oracle import DraftOracle

CONTINUATION = [int(t) for t in np.random.default_rng(0).integers(0, 50, size=400)]


def _oracle(probability=0.5, vocab_size=50, seed=3):
    return DraftOracle(CONTINUATION, 10, probability, vocab_size, seed=seed)


def test_a_positions_token_does_not_depend_on_which_positions_were_drawn_before():
    positions = list(range(10, 410))
    forward = _oracle()
    expected = [forward.replace(p, -1) for p in positions]
    backward = _oracle()
    assert [backward.replace(p, -1) for p in reversed(positions)] == expected[::-1]
    windowed = _oracle()  # a chained step's window draws positions a host-launched step skips
    assert windowed.window(200, 8) == expected[190:198]
    assert [windowed.replace(p, -1) for p in positions] == expected
    assert _oracle(seed=4).window(10, 400) != expected


def test_a_refused_draft_is_never_the_truth_and_the_rate_follows_the_probability():
    for vocab_size in (2, 3, 50):
        truths = [t % vocab_size for t in CONTINUATION]
        drawn = DraftOracle(truths, 10, 0.7, vocab_size, seed=3).window(10, 400)
        taken = [d == t for d, t in zip(drawn, truths)]
        assert all(0 <= d < vocab_size for d in drawn)
        assert 0.6 < np.mean(taken) < 0.8
    assert [_oracle(1.0).replace(p, -1) for p in range(10, 20)] == CONTINUATION[:10]
    assert all(d != t for d, t in zip(_oracle(0.0).window(10, 400), CONTINUATION))


def test_outside_the_continuation_the_draft_stays_and_a_one_token_vocabulary_is_refused():
    oracle = _oracle()
    assert oracle.replace(9, 7) == 7 and oracle.replace(410, 8) == 8 and oracle.window(408, 4)[2:] == [-1, -1]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        DraftOracle(CONTINUATION, 10, 0.5, 1)
