import math

import numpy as np
import pytest

from strata.engine.sampling import (
    SamplingParams,
    StopMatcher,
    apply_logit_bias,
    check_bias_ids,
    greedy,
    make_rng,
    sample,
    top_k_mask,
    top_p_mask,
)
from strata.errors import ConfigError


def _logits(seed=0, vocab=50):
    return np.random.default_rng(seed).normal(size=vocab).astype(np.float32)


def test_greedy_picks_the_highest_logit_and_the_lowest_id_among_equals():
    assert greedy(np.array([0.1, 3.0, -1.0, 2.0], dtype=np.float32)) == 1
    assert greedy(np.array([1.0, 5.0, 5.0], dtype=np.float32)) == 1


def test_temperature_zero_is_greedy_whatever_the_other_knobs():
    logits = _logits()
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=1)
    rng = make_rng(1)
    assert all(sample(logits, params, rng) == int(np.argmax(logits)) for _ in range(10))


def test_same_seed_gives_the_same_sequence_and_another_seed_differs():
    logits = _logits(vocab=1000)
    params = SamplingParams(temperature=1.5)

    def draws(seed):
        rng = make_rng(seed)
        return [sample(logits, params, rng) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_k_keeps_exactly_the_k_highest():
    logits = _logits()
    masked = top_k_mask(logits, 5)
    kept = np.flatnonzero(np.isfinite(masked))
    assert sorted(kept) == sorted(np.argsort(-logits)[:5])
    assert np.array_equal(masked[kept], logits[kept])
    assert top_k_mask(logits, 0) is logits


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    assert np.flatnonzero(np.isfinite(top_p_mask(logits, 0.5))).tolist() == [0]
    assert np.flatnonzero(np.isfinite(top_p_mask(logits, 0.75))).tolist() == [0, 1]
    assert np.flatnonzero(np.isfinite(top_p_mask(logits, 0.81))).tolist() == [0, 1, 2]
    assert np.flatnonzero(np.isfinite(top_p_mask(logits, 1e-9))).tolist() == [0]


def test_samples_stay_inside_the_top_k_and_top_p_sets():
    logits = _logits(vocab=200)
    rng = make_rng(3)
    top5 = set(np.argsort(-logits)[:5].tolist())
    assert {sample(logits, SamplingParams(temperature=2.0, top_k=5), rng) for _ in range(300)} <= top5
    nucleus = set(np.flatnonzero(np.isfinite(top_p_mask(logits, 0.3))).tolist())
    assert {sample(logits, SamplingParams(temperature=2.0, top_p=0.3), rng) for _ in range(300)} <= nucleus


def test_sampled_frequencies_follow_the_tempered_distribution():
    logits = np.array([1.0, 0.0, -1.0], dtype=np.float32)
    params = SamplingParams(temperature=0.5, seed=0)
    rng = make_rng(0)
    counts = np.bincount([sample(logits, params, rng) for _ in range(6000)], minlength=3) / 6000
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    assert np.allclose(counts, expected, atol=0.02)


def test_logit_bias_adds_and_bans():
    logits = np.zeros(4, dtype=np.float32)
    biased = apply_logit_bias(logits, {2: 5.0, 0: -math.inf})
    assert biased.tolist() == [-math.inf, 0.0, 5.0, 0.0]
    assert logits.tolist() == [0.0] * 4  # input untouched
    assert sample(logits, SamplingParams(temperature=0, logit_bias={3: 1.0}), make_rng(0)) == 3
    rng = make_rng(0)
    banned = SamplingParams(temperature=1.0, logit_bias={1: -math.inf})
    assert 1 not in {sample(logits, banned, rng) for _ in range(200)}


def test_logit_bias_out_of_vocabulary_names_the_range():
    with pytest.raises(ConfigError, match="logit_bias.*vocabulary has 4 tokens"):
        apply_logit_bias(np.zeros(4, dtype=np.float32), {4: 1.0})
    # the ids the device's bias kernel adds at, unchecked there (the state's bias included)
    for ids in ([2, -1], [0, 4]):
        with pytest.raises(ConfigError, match=f"names token {ids[1]}, but the vocabulary has 4 tokens"):
            check_bias_ids(np.array(ids, dtype=np.int32), 4)
    check_bias_ids(np.array([0, 3], dtype=np.int32), 4)
    check_bias_ids(np.array([], dtype=np.int32), 4)


def test_logit_bias_accepts_json_style_string_keys():
    assert SamplingParams(logit_bias={"12": 1.5}).logit_bias == {12: 1.5}


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
    ],
)
def test_invalid_parameters_name_the_parameter(kwargs, name):
    with pytest.raises(ConfigError, match=rf"sampling parameter {name} must be"):
        SamplingParams(**kwargs)


def test_a_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


def _stream(pieces, stop):
    matcher = StopMatcher(stop)
    emitted, is_stopped = [], False
    for piece in pieces:
        text, is_stopped = matcher.feed(piece)
        emitted.append(text)
        if is_stopped:
            break
    if not is_stopped:
        emitted.append(matcher.flush())
    return "".join(emitted), is_stopped, emitted


def test_stop_string_split_across_pieces_is_cut_and_not_emitted():
    text, is_stopped, emitted = _stream(["Hello", " wor", "ld\n", "\nmore"], ("\n\n",))
    assert (text, is_stopped) == ("Hello world", True)
    assert emitted[2] == "ld"  # the first newline was held back until it was known


def test_text_without_a_stop_string_comes_through_whole():
    text, is_stopped, _ = _stream(["ab", "c<", "|e", "nd"], ("<|end|>",))
    assert (text, is_stopped) == ("abc<|end", False)


def test_earliest_of_several_stop_strings_wins():
    text, is_stopped, _ = _stream(["x END y STOP"], ("STOP", "END"))
    assert (text, is_stopped) == ("x ", True)
