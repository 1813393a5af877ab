"""Browsers call the API from the origins in serve.cors_origins, and from no other."""

import httpx
import pytest
from serve_harness import RunningServer, engine_loader, error_of, make_config

ALLOWED = "http://localhost:3000"
PREFLIGHT = {"access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type, x-stainless-lang"}


@pytest.fixture(scope="module")
def cors_server(tiny_model):
    config = make_config(tiny_model, serve={"cors_origins": [ALLOWED], "api_key": "sekret"})
    with RunningServer(engine_loader(config), config) as server:
        server.wait_ready()
        yield server


def test_a_preflight_from_an_allowed_origin_needs_no_key(cors_server):
    response = httpx.options(cors_server.url + "/v1/chat/completions", headers={"origin": ALLOWED, **PREFLIGHT})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "x-stainless-lang" in response.headers["access-control-allow-headers"]


def test_a_request_from_an_allowed_origin_reads_the_answer_and_its_headers(cors_server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    headers = {"origin": ALLOWED, "authorization": "Bearer sekret"}
    response = httpx.post(cors_server.url + "/v1/completions", json=body, headers=headers)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ALLOWED
    assert "x-request-id" in response.headers["access-control-expose-headers"]
    refused = httpx.post(cors_server.url + "/v1/completions", json=body, headers={"origin": ALLOWED})
    assert error_of(refused, 401)["code"] == "invalid_api_key"  # the browser can read why
    assert refused.headers["access-control-allow-origin"] == ALLOWED


def test_another_origin_is_refused(cors_server):
    preflight = httpx.options(cors_server.url + "/v1/completions", headers={"origin": "http://evil.test", **PREFLIGHT})
    assert error_of(preflight, 400)["code"] == "cors_refused"
    assert "access-control-allow-origin" not in preflight.headers
    response = httpx.get(cors_server.url + "/health", headers={"origin": "http://evil.test"})
    assert "access-control-allow-origin" not in response.headers


def test_without_cors_origins_there_are_no_cors_headers(server):
    response = httpx.options(server.url + "/v1/completions", headers={"origin": ALLOWED, **PREFLIGHT})
    assert error_of(response, 405)["code"] == "method_not_allowed"
    assert "access-control-allow-origin" not in response.headers
    assert "access-control-allow-origin" not in httpx.get(server.url + "/health", headers={"origin": ALLOWED}).headers
