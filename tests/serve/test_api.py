"""The API as clients use it: the official openai client and raw HTTP against a real server."""

import httpx
import pytest
from serve_harness import error_of, metric_values, openai_client, sse_events

from strata.model.chat import render_chat

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(server):
    return server.state.ready.model_name


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.state.ready.engine.tokenizer


def test_completion_with_the_openai_client(client, model, tokenizer):
    prompt = "The morning train left the station"
    first = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    choice = first.choices[0]
    assert first.object == "text_completion" and first.model == model and first.id.startswith("cmpl-")
    assert first.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert 1 <= first.usage.completion_tokens <= 8
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert choice.finish_reason == ("length" if first.usage.completion_tokens == 8 else "stop")
    assert choice.text == again.choices[0].text  # greedy is deterministic, also with the KV prefix reused


def test_chat_with_the_openai_client(client, model, tokenizer):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0)
    message = reply.choices[0].message
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert message.role == "assistant" and isinstance(message.content, str)
    rendered = render_chat(tokenizer.chat_template, MESSAGES, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(rendered, parse_special=True))
    assert 1 <= reply.usage.completion_tokens <= 6


def test_streamed_completion_equals_the_whole_one(client, model):
    kwargs = dict(model=model, prompt="A small river runs through", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_with_the_openai_client(client, model):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def test_streamed_chat_over_raw_http(server, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] <= 5


def test_stop_string_cuts_the_text(client, model):
    kwargs = dict(model=model, prompt="She opened the window", max_tokens=24, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"the greedy text {text!r} has no usable stop string")
    cut = client.completions.create(**kwargs, stop=[stop, "never appears"])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logit_bias_forces_a_token(client, model, tokenizer):
    token = tokenizer.encode(" the")[-1]
    reply = client.completions.create(model=model, prompt="Prices rose", max_tokens=4, temperature=0,
                                      logit_bias={str(token): 100})
    assert reply.choices[0].text == tokenizer.decode([token] * 4)


def test_seed_repeats_a_sampled_completion(client, model):
    kwargs = dict(model=model, prompt="The committee will meet", max_tokens=10, temperature=1.0, top_p=0.95,
                  seed=1234, extra_body={"top_k": 40})
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_follow_up_turn_reads_only_new_tokens(client, model, timing_lines):
    first = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0)
    turn = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Another one."}]
    second = client.chat.completions.create(model=model, messages=turn, max_tokens=4, temperature=0)
    line = timing_lines()[-1]
    assert f"prompt {second.usage.prompt_tokens} tok" in line
    unread = int(line.split("unread ")[1].split(",")[0])
    assert unread < second.usage.prompt_tokens - first.usage.prompt_tokens + 8, line


def test_chat_log_probabilities_with_the_openai_client(client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    reply = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3)
    message, entries = reply.choices[0].message, reply.choices[0].logprobs.content
    assert message.content == plain.choices[0].message.content  # decoded on the host: the same greedy tokens
    assert len(entries) == reply.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in entries).decode(errors="replace").startswith(message.content)
    for entry in entries:
        top = entry.top_logprobs
        assert len(top) == 3 and top[0].token == entry.token and top[0].logprob == entry.logprob  # greedy
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True) and top[0].logprob <= 0
        assert _token_bytes(entry.token) == bytes(entry.bytes)
    # streamed, the same entries arrive with the text they belong to
    chunks = list(client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert plain.choices[0].logprobs is None


def test_completion_log_probabilities_in_the_legacy_shape(client, model):
    kwargs = dict(model=model, prompt="A small river runs through", max_tokens=8, temperature=0)
    reply = client.completions.create(**kwargs, logprobs=2)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    num_tokens = reply.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == num_tokens
    assert b"".join(map(_token_bytes, logprobs.tokens)).decode(errors="replace").startswith(choice.text)
    # each token's text starts at its offset; one that completes a character split over tokens starts earlier
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(choice.text)
    for i, token in enumerate(logprobs.tokens):
        if not token.startswith("bytes:") and (i == 0 or not logprobs.tokens[i - 1].startswith("bytes:")):
            assert choice.text[offsets[i]:].startswith(token) or offsets[i] + len(token) > len(choice.text)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 3 and top[token] == value == max(top.values())  # greedy: the picked token is the top
    # the same prompt again reuses its KV prefix, computed another way: equal to the last bits or nearly
    zero = client.completions.create(**kwargs, logprobs=0).choices[0].logprobs
    assert zero.token_logprobs == pytest.approx(logprobs.token_logprobs, rel=1e-5)
    assert zero.top_logprobs == [{}] * num_tokens


def _token_bytes(token: str) -> bytes:
    """A log-probability entry's token text back to its bytes (``bytes:\\xNN...`` names a partial UTF-8 one)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token.removeprefix("bytes:").split("\\x")[1:])
    return token.encode()


def test_echo_sends_the_prompt_before_the_completion(client, model, tokenizer):
    kwargs = dict(model=model, prompt="The morning train left the station", max_tokens=6, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs, echo=True).choices[0].text == kwargs["prompt"] + plain
    chunks = list(client.completions.create(**kwargs, echo=True, stream=True))
    assert chunks[0].choices[0].text == kwargs["prompt"]
    assert "".join(c.choices[0].text for c in chunks) == kwargs["prompt"] + plain
    ids = tokenizer.encode(kwargs["prompt"])  # a prompt of token ids echoes the text they decode to
    assert client.completions.create(**{**kwargs, "prompt": ids}, echo=True).choices[0].text == \
        tokenizer.decode(ids) + plain


def test_models(client, server, model):
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model
    error_of(httpx.get(server.url + "/v1/models/other"), 404)


def test_health_and_metrics_count_requests(client, server, model):
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ready"
    before = metric_values(httpx.get(server.url + "/metrics").text)
    reply = client.completions.create(model=model, prompt="Count me", max_tokens=3, temperature=0)
    response = httpx.get(server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = metric_values(response.text)
    assert after["strata_ready"] == 1
    assert after["strata_requests_total"] == before["strata_requests_total"] + 1
    assert after["strata_prompt_tokens_total"] == before["strata_prompt_tokens_total"] + reply.usage.prompt_tokens
    assert (after["strata_generated_tokens_total"]
            == before["strata_generated_tokens_total"] + reply.usage.completion_tokens)
    assert after["strata_queue_depth"] == 0 and after["strata_requests_running"] == 0
    assert after["strata_decode_tokens_per_second"] >= 0 and 0 <= after["strata_expert_cache_hit_rate"] <= 1
    for name in ("strata_loans_taken_total", "strata_loans_skipped_total", "strata_loans_failed_total",
                 "strata_loan_released_bytes_total", "strata_loan_restored_bytes_total",
                 "strata_prefill_tokens_per_second"):
        assert name in after
