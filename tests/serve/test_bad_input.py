"""Bad input gets a 4xx in the OpenAI error shape and never takes the server down."""

import httpx
import openai
import pytest
from serve_harness import (
    RunningServer,
    engine_loader,
    error_of,
    make_config,
    openai_client,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def post(server):
    model = server.state.ready.model_name

    def send(route, body=None, *, raw=None, headers=None, **fields):
        if raw is not None:
            return httpx.post(server.url + route, content=raw, headers=headers or JSON, timeout=30)
        payload = {"model": model, **(body or {}), **fields}
        return httpx.post(server.url + route, json=payload, headers=headers, timeout=30)

    return send


@pytest.mark.parametrize("raw, code", [
    (b'{"model": "tiny", "prompt": "hi"', "invalid_json"),
    (b"", "invalid_json"),
    (b'["a list"]', "invalid_json"),
    (b'{"model": "tiny", "prompt": "caf\xe9"}', "invalid_encoding"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "invalid_json"),
    (b"[" * 100_000, "invalid_json"),
])
def test_unreadable_bodies(post, raw, code):
    assert error_of(post(COMPLETIONS, raw=raw), 400)["code"] == code


@pytest.mark.parametrize("route, fields, param", [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": ["one", "two"]}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "stop": 5}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "stop": [""]}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": [1]}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "stream": True, "stream_options": "usage"}, "stream_options"),
    (COMPLETIONS, {"prompt": "hi", "n": 2}, "n"),
    (COMPLETIONS, {"prompt": "hi", "temperature": 3}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -1}, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "seed": -3}, "seed"),
    (COMPLETIONS, {"prompt": [1, 2, 10 ** 9]}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {}, "prompt"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": ["hi"]}, "messages[0]"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "echo": "yes"}, "echo"),
    (COMPLETIONS, {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
])
def test_wrong_fields_name_the_parameter(post, route, fields, param):
    assert error_of(post(route, fields), 400)["param"] == param


def test_missing_model(server):
    error = error_of(httpx.post(server.url + COMPLETIONS, json={"prompt": "hi"}), 400)
    assert error["param"] == "model" and error["code"] == "missing_required_parameter"


def test_unknown_model(post):
    error = error_of(post(COMPLETIONS, {"prompt": "hi"}, model="gpt-4"), 404)
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"]


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_too_few_max_tokens(post, max_tokens):
    assert error_of(post(COMPLETIONS, {"prompt": "hi", "max_tokens": max_tokens}), 400)["param"] == "max_tokens"


def test_absurd_max_tokens_names_the_context(post, server):
    context = server.state.ready.engine.context_tokens
    error = error_of(post(COMPLETIONS, {"prompt": "hi", "max_tokens": 10 ** 9}), 400)
    assert error["code"] == "context_length_exceeded" and f"{context:,}" in error["message"]


@pytest.mark.parametrize("max_tokens", [2 ** 31, 10 ** 4000, 1e308], ids=["2^31", "4001-digits", "1e308"])
def test_max_tokens_past_any_context_is_out_of_range(post, max_tokens):
    error = error_of(post(COMPLETIONS, {"prompt": "hi", "max_tokens": max_tokens}), 400)
    assert error["param"] == "max_tokens" and "2147483647" in error["message"] and len(error["message"]) < 200


def test_chat_names_the_max_tokens_parameter_it_was_given(post):
    messages = [{"role": "user", "content": "hi"}]
    assert error_of(post(CHAT, messages=messages, max_tokens=10 ** 9), 400)["param"] == "max_tokens"
    too_many = post(CHAT, messages=messages, max_tokens=1, max_completion_tokens=10 ** 9)
    assert error_of(too_many, 400)["param"] == "max_completion_tokens"


def test_prompt_longer_than_the_context(post, server):
    context = server.state.ready.engine.context_tokens
    tokens = [5] * (context + 10)
    error = error_of(post(COMPLETIONS, {"prompt": tokens, "max_tokens": 1}), 400)
    assert error["code"] == "context_length_exceeded"
    assert f"{context + 10:,}" in error["message"] and f"{context:,}" in error["message"]


def test_huge_body_with_content_length(post, server):
    limit = server.state.config.serve.max_body_bytes
    error = error_of(post(COMPLETIONS, {"prompt": "x" * (limit + 1)}), 413)
    assert error["code"] == "request_too_large" and f"{limit:,}" in error["message"]


def test_huge_body_streamed_without_content_length(server):
    limit = server.state.config.serve.max_body_bytes
    sent = []

    def body():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(64):  # 64 times the limit if the server kept reading
            sent.append(limit)
            yield b"x" * limit

    try:
        response = httpx.post(server.url + COMPLETIONS, content=body(), headers=JSON, timeout=30)
    except httpx.HTTPError:  # the server may close the connection while the client still writes
        response = None
    if response is not None:
        assert error_of(response, 413)["code"] == "request_too_large"
    assert len(sent) < 64


def test_unknown_parameters_are_ignored_and_listed(post):
    response = post(COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "user": "u1", "frobnicate": {"x": 1},
                                  "presence_penalty": 0.5})
    assert response.status_code == 200, response.text
    assert response.headers["x-strata-ignored-params"] == "frobnicate,presence_penalty,user"


def test_unknown_route_and_method(server):
    assert error_of(httpx.get(server.url + "/v1/engines"), 404)["code"] == "not_found"
    assert error_of(httpx.get(server.url + COMPLETIONS), 405)["code"] == "method_not_allowed"
    # a trailing slash is another route, not a redirect built from the client's Host header
    slashed = httpx.post(server.url + COMPLETIONS + "/", json={}, headers={"host": "elsewhere.example"})
    assert error_of(slashed, 404)["code"] == "not_found" and "location" not in slashed.headers


def test_the_server_survives_all_of_it(server, post):
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(COMPLETIONS, {"prompt": "still here", "max_tokens": 2}).status_code == 200


def test_api_key(tiny_model):
    config = make_config(tiny_model, serve={"api_key": "sekret"})
    with RunningServer(engine_loader(config), config) as server:
        server.wait_ready()
        model = server.state.ready.model_name
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        assert error_of(httpx.post(server.url + COMPLETIONS, json=body), 401)["code"] == "invalid_api_key"
        wrong = httpx.post(server.url + COMPLETIONS, json=body, headers={"Authorization": "Bearer nope"})
        assert error_of(wrong, 401)["code"] == "invalid_api_key"
        assert error_of(httpx.get(server.url + "/v1/models"), 401)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai_client(server, api_key="nope").models.list()
        assert openai_client(server, api_key="sekret").completions.create(**body).usage.completion_tokens >= 1
        assert httpx.get(server.url + "/health").status_code == 200
