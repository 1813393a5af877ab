"""A request whose logits are not finite gets an error that says so, and the server serves on."""

import httpx
import numpy as np
import pytest
from serve_harness import RunningServer, engine_loader, error_of, make_config, sse_events

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, on the infinite activations


@pytest.fixture(scope="module")
def nan_server(tiny_model):
    config = make_config(tiny_model)
    with RunningServer(engine_loader(config), config) as running:
        running.wait_ready()
        yield running


def completion(server, **body):
    return httpx.post(server.url + "/v1/completions", timeout=30,
                      json={"model": server.state.ready.model_name, "prompt": [5, 6, 7, 8], "max_tokens": 4,
                            "temperature": 0, **body})


def test_non_finite_logits_get_an_explained_error_and_the_next_request_is_served(nan_server):
    engine = nan_server.state.ready.engine
    expected = completion(nan_server).json()["choices"][0]["text"]
    norm = engine.weights.vectors["output_norm"]
    saved = norm.copy()
    norm[0] = np.inf
    try:
        response = completion(nan_server)
        error = error_of(response, 500)
        assert error["code"] == "non_finite_logits" and error["type"] == "server_error"
        assert error["message"].startswith(f"request {response.headers['x-request-id']} failed: ")
        assert "NaN or infinite" in error["message"] and "the server goes on serving" in error["message"]
        stream = completion(nan_server, stream=True)  # the first logits fail: before the status line
        assert error_of(stream, 500)["code"] == "non_finite_logits"
        assert httpx.get(nan_server.url + "/health").status_code == 200
    finally:
        norm[:] = saved
    again = completion(nan_server)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected


def test_non_finite_logits_in_decode_end_a_stream_with_an_error_event_and_done(nan_server, monkeypatch):
    engine = nan_server.state.ready.engine
    real_logits = engine.output_logits
    calls = []

    def nan_from_the_second(hidden):
        calls.append(1)
        logits = real_logits(hidden)
        return logits if len(calls) < 2 else np.full_like(logits, np.nan)

    monkeypatch.setattr(engine, "output_logits", nan_from_the_second)
    response = completion(nan_server, stream=True)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "non_finite_logits"
    assert [e for e in events[:-2] if "error" in e] == []
    monkeypatch.undo()
    assert completion(nan_server).status_code == 200
