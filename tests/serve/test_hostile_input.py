"""The inputs that once answered 500 or nothing, the content type, and the last-resort 500."""

import logging
import urllib.parse

import httpx
import pytest
from serve_harness import error_of, metric_values

COMPLETIONS = "/v1/completions"
JSON = {"content-type": "application/json"}
BASE = '{"model": "tiny", "prompt": "hi", "max_tokens": 1'


@pytest.fixture(scope="module")
def send(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield lambda raw, headers=JSON, route=COMPLETIONS: client.post(route, content=raw, headers=headers)


@pytest.mark.parametrize("extra, param, code", [
    (', "temperature": 1' + "0" * 400, "temperature", None),
    (', "top_p": -1' + "0" * 400, "top_p", None),
    (', "logit_bias": {"5": 1' + "0" * 400 + "}", "logit_bias", None),
    (', "logit_bias": {"²": 1}', "logit_bias", None),
    (', "logit_bias": {"١": 1}', "logit_bias", None),  # an Arabic-Indic one, not token 1
    (', "logit_bias": {"' + "1" * 5000 + '": 1}', "logit_bias", None),
    (', "seed": 1' + "0" * 30, "seed", None),
    (', "n": 1' + "0" * 400, "n", None),
    (', "stop": "a\\ud800b"', None, "invalid_encoding"),
    (', "max_tokens": 1' + "0" * 5000, None, "invalid_json"),  # past Python's 4,300-digit limit
    (', "stop": ' + "[" * 65 + "]" * 65, None, "invalid_json"),
])
def test_hostile_values_are_400s(send, extra, param, code):
    error = error_of(send((BASE + extra + "}").encode()), 400)
    assert error["param"] == param and (code is None or error["code"] == code), error
    assert len(error["message"]) < 400


@pytest.mark.parametrize("body, route, status", [
    ('{"model": "tiny", "messages": [{"role": "' + "r" * 100_000 + '", "content": "hi"}]}', "/v1/chat/completions", 400),
    ('{"model": "' + "m" * 100_000 + '", "prompt": "hi"}', COMPLETIONS, 404),
    ('{"model": "tiny", "prompt": [' + "9" * 4000 + "]}", COMPLETIONS, 400),
    ('{"model": "tiny", "prompt": "hi", "stop": [' + ",".join(['"' + "s" * 1000 + '"'] * 17) + "]}", COMPLETIONS,
     400),
])
def test_a_clients_value_is_quoted_short(send, body, route, status):
    assert len(error_of(send(body.encode(), route=route), status)["message"]) < 300


def test_a_long_unknown_path_is_quoted_short(server):
    assert len(error_of(httpx.post(server.url + "/" + "a" * 60_000, json={}), 404)["message"]) < 300


def test_a_control_character_and_a_huge_integer_are_named_plainly(send):
    control = error_of(send(b'{"model": "tiny", "prompt": "a\x01b"}'), 400)["message"]
    assert "at at" not in control
    huge = error_of(send((BASE + ', "seed": ' + "7" * 5000 + "}").encode()), 400)["message"]
    assert "4,300 digits" in huge and "sys." not in huge


def test_top_p_names_its_open_range(send):
    assert "(0, 1]" in error_of(send((BASE + ', "top_p": 0}').encode()), 400)["message"]


def test_an_unknown_name_too_long_for_the_header_leaves_the_others(send):
    body = (BASE + ', "' + "a" * 2000 + '": 1, "zz": 1, "": 1, "user": "u"}').encode()
    response = send(body)
    assert response.status_code == 200, response.text
    assert response.headers["x-strata-ignored-params"] == "user,zz"


def test_a_lone_surrogate_in_the_prompt(send):
    error = error_of(send(b'{"model": "tiny", "prompt": "a\\ud800b"}'), 400)
    assert error["code"] == "invalid_encoding" and "surrogate" in error["message"]


@pytest.mark.parametrize("name", ["中文", "a\r\nb", "x,y", "%41"])
def test_any_unknown_parameter_name_comes_back_encoded(send, name):
    body = (BASE + ', "user": "u", ' + httpx.Response(200, json={name: 1}).text[1:]).encode()
    response = send(body)
    assert response.status_code == 200, response.text
    names = [urllib.parse.unquote(n) for n in response.headers["x-strata-ignored-params"].split(",")]
    assert names == sorted([name, "user"])


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=latin-1"])
def test_a_body_not_sent_as_json_is_415(send, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    error = error_of(send((BASE + "}").encode(), headers), 415)
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"] or "UTF-8" in error["message"]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON", "application/json;"])
def test_json_content_types_are_accepted(send, content_type):
    assert send((BASE + "}").encode(), {"content-type": content_type}).status_code == 200


def test_an_unexpected_error_is_one_logged_500_on_a_kept_connection(server, monkeypatch, caplog):
    def broken(parsed):
        raise ZeroDivisionError("a bug in the server")

    monkeypatch.setattr(server.state.ready.prompts, "prepare", broken)
    before = metric_values(httpx.get(server.url + "/metrics").text)
    caplog.set_level(logging.INFO)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        failed = client.post(COMPLETIONS, content=(BASE + "}").encode(), headers=JSON)
        monkeypatch.undo()
        after_failure = client.post(COMPLETIONS, content=(BASE + "}").encode(), headers=JSON)
    error = error_of(failed, 500)
    assert error["code"] == "internal_error" and "ZeroDivisionError" in error["message"]
    assert failed.headers.get("connection") != "close" and after_failure.status_code == 200
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "a bug in the server" in str(tracebacks[0].exc_info[1])
    after = metric_values(httpx.get(server.url + "/metrics").text)
    assert after["strata_requests_failed_total"] == before["strata_requests_failed_total"] + 1
    key = 'strata_http_requests_total{route="/v1/completions",status="500"}'
    assert after[key] == before.get(key, 0) + 1


@pytest.mark.parametrize("temperature", [1e-320, 1e-300, 1e-45])
def test_a_temperature_too_small_to_divide_by_samples_as_greedy(send, temperature):
    sampled = send(f'{{"model": "tiny", "prompt": "Prices rose", "max_tokens": 4, "temperature": {temperature}}}'
                   .encode())
    greedy = send(b'{"model": "tiny", "prompt": "Prices rose", "max_tokens": 4, "temperature": 0}')
    assert sampled.status_code == 200 and sampled.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
