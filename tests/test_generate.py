"""The CPU generate loop over a tiny synthetic model: prefill, KV-cached decode, stopping rules."""

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from strata.cli.generate import GenerationStats, generate_tokens
from strata.engine.sampling import SamplingParams
from strata.errors import ConfigError
from strata.model.gguf_file import open_gguf
from strata.model.reference import KVCache, ReferenceModel
from strata.model.synth import PRESETS, write_synthetic_model

PROMPT = np.array([7, 300, 42, 11, 5])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic_model(tmp_path_factory.mktemp("m") / "tiny.gguf", PRESETS["tiny"],
                                 GGMLQuantizationType.Q8_0, seed=1)
    return ReferenceModel.from_gguf(open_gguf(path))


def _never(token):
    return False


def test_greedy_generation_equals_recomputing_the_whole_sequence_each_step(tiny):
    generated = list(generate_tokens(tiny, PROMPT, SamplingParams(temperature=0, max_tokens=6), _never))
    sequence = list(PROMPT)
    for _ in range(6):
        logits = tiny.forward(np.array(sequence), 0, KVCache.for_spec(tiny.spec, 16))
        sequence.append(int(np.argmax(logits[-1])))
    assert generated == sequence[len(PROMPT):]


def test_stops_at_max_tokens_and_fills_the_stats(tiny):
    stats = GenerationStats()
    tokens = list(generate_tokens(tiny, PROMPT, SamplingParams(temperature=0, max_tokens=4), _never, stats))
    assert len(tokens) == 4
    assert (stats.num_prompt_tokens, stats.num_generated_tokens, stats.num_decode_steps) == (5, 4, 3)
    assert stats.prompt_seconds > 0 and stats.decode_seconds > 0
    assert "prompt 5 tokens, generated 4 tokens" in stats.timing_line()


def test_an_end_of_generation_token_ends_the_stream_unyielded(tiny):
    first = next(generate_tokens(tiny, PROMPT, SamplingParams(temperature=0, max_tokens=1), _never))
    stats = GenerationStats()
    tokens = list(generate_tokens(tiny, PROMPT, SamplingParams(temperature=0, max_tokens=8),
                                  lambda t: t == first, stats))
    assert tokens == [] and stats.num_generated_tokens == 0


def test_generation_ends_when_the_context_is_full(tiny):
    small = ReferenceModel(dataclasses.replace(tiny.spec, context_length=8), tiny.weight)
    tokens = list(generate_tokens(small, PROMPT, SamplingParams(temperature=0, max_tokens=50), _never))
    assert len(tokens) == 8 - len(PROMPT) + 1  # the last one is predicted at the last position
    with pytest.raises(ConfigError, match="the prompt has 8 tokens; it must have 1..7"):
        list(generate_tokens(small, np.arange(8), SamplingParams(max_tokens=1), _never))


def test_seeded_sampling_is_reproducible(tiny):
    params = SamplingParams(temperature=1.2, top_k=50, top_p=0.95, seed=11, max_tokens=8)
    first = list(generate_tokens(tiny, PROMPT, params, _never))
    again = list(generate_tokens(tiny, PROMPT, params, _never))
    other = list(generate_tokens(tiny, PROMPT, dataclasses.replace(params, seed=12), _never))
    assert first == again and first != other
