"""Loading in the background, the bounded queue, arrival order, client disconnects and engine failures."""

import concurrent.futures
import logging
import threading
import time

import httpx
import openai
import pytest
from serve_harness import (
    ControlledEngine,
    RunningServer,
    engine_loader,
    error_of,
    make_config,
    metric_values,
    openai_client,
    sse_events,
)

from strata.errors import LoanRestoreError

COMPLETIONS = "/v1/completions"


def wait_for(condition, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def test_health_is_503_while_loading_then_200(tiny_model):
    config = make_config(tiny_model)
    may_load = threading.Event()
    load = engine_loader(config)
    with RunningServer(lambda: (may_load.wait(30), load())[1], config) as server:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert health.headers["Retry-After"]
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        refused = httpx.post(server.url + COMPLETIONS, json=body)
        assert error_of(refused, 503)["code"] == "model_loading" and refused.headers["Retry-After"]
        loading = metric_values(httpx.get(server.url + "/metrics").text)
        assert loading["strata_ready"] == 0 and "strata_requests_total" not in loading
        assert loading['strata_http_requests_total{route="/v1/completions",status="503"}'] == 1
        may_load.set()
        server.wait_ready()
        assert httpx.get(server.url + "/health").json()["status"] == "ready"
        assert httpx.post(server.url + COMPLETIONS, json=body).status_code == 200


def test_failed_load_is_reported(tiny_model):
    config = make_config(tiny_model)

    def broken():
        raise FileNotFoundError("model.gguf is gone")

    with RunningServer(broken, config) as server:
        wait_for(lambda: server.state.load_error is not None)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "failed",
                                                                "error": "FileNotFoundError: model.gguf is gone"}
        refused = httpx.post(server.url + COMPLETIONS, json={"model": "tiny", "prompt": "hi"})
        assert "model.gguf is gone" in error_of(refused, 503)["message"]


@pytest.fixture(scope="module")
def controlled(tiny_model):
    config = make_config(tiny_model, serve={"max_queue": 2})
    engines = []
    loader = engine_loader(config, wrap=lambda engine: engines.append(ControlledEngine(engine)) or engines[0])
    with RunningServer(loader, config) as server:
        server.wait_ready()
        yield server, engines[0]


def test_full_queue_answers_503_and_requests_run_in_arrival_order(controlled, timing_lines):
    server, engine = controlled
    worker = server.state.ready.worker
    engine.gate.clear()
    engine.entered.clear()
    body = {"model": "tiny", "prompt": "Order matters", "max_tokens": 3}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = pool.submit(httpx.post, server.url + COMPLETIONS, json=body, timeout=30)
        assert engine.entered.wait(20)
        queued = []
        for depth in (1, 2):
            queued.append(pool.submit(httpx.post, server.url + COMPLETIONS, json=body, timeout=30))
            wait_for(lambda: worker.num_waiting == depth)
        refused = httpx.post(server.url + COMPLETIONS, json=body, timeout=30)
        error = error_of(refused, 503)
        assert error["code"] == "queue_full" and int(refused.headers["Retry-After"]) >= 1
        assert httpx.get(server.url + "/health").json()["queue_depth"] == 2
        metrics = metric_values(httpx.get(server.url + "/metrics").text)
        assert metrics["strata_queue_depth"] == 2 and metrics["strata_requests_running"] == 1
        assert metrics["strata_queue_rejected_total"] >= 1
        engine.gate.set()
        responses = [f.result() for f in (running, *queued)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    ids = [r.headers["x-request-id"] for r in responses]
    order = [next(i for i in ids if line.startswith(i)) for line in timing_lines() if line.split()[0] in ids]
    assert order == ids


def test_disconnect_mid_stream_releases_the_engine(controlled, timing_lines):
    server, engine = controlled
    engine.pace_s = 0.005
    max_tokens = server.state.ready.engine.context_tokens // 2
    body = {"model": "tiny", "prompt": "Tell me everything", "max_tokens": max_tokens, "stream": True,
            "temperature": 0}  # greedy: deterministic, no early end of generation
    try:
        with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=30) as response:
            request_id = response.headers["x-request-id"]
            num_chunks = 0
            for line in response.iter_lines():
                num_chunks += line.startswith("data: ")
                if num_chunks == 3:
                    break
        started = time.monotonic()
        wait_for(lambda: any(line.startswith(request_id) for line in timing_lines()))
        assert time.monotonic() - started < 2
        line = next(line for line in timing_lines() if line.startswith(request_id))
        assert "(cancelled)" in line
        generated = int(line.split("generated ")[1].split()[0])
        assert generated < max_tokens // 4, line
    finally:
        engine.pace_s = 0.0
    after = httpx.post(server.url + COMPLETIONS, json={"model": "tiny", "prompt": "next", "max_tokens": 2})
    assert after.status_code == 200


def test_a_client_that_leaves_a_whole_response_during_decode_is_counted_as_499(controlled, timing_lines):
    server, engine = controlled
    closed_key = 'strata_http_requests_total{route="/v1/completions",status="499"}'
    before = metric_values(httpx.get(server.url + "/metrics").text).get(closed_key, 0)
    engine.pace_s = 0.01
    body = {"model": "tiny", "prompt": "Tell me everything, slowly", "temperature": 0,
            "max_tokens": server.state.ready.engine.context_tokens // 2}
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + COMPLETIONS, json=body, timeout=httpx.Timeout(30, read=0.5))
        wait_for(lambda: metric_values(httpx.get(server.url + "/metrics").text).get(closed_key, 0) == before + 1)
    finally:
        engine.pace_s = 0.0
    assert any("(cancelled)" in line for line in timing_lines())


def test_disconnect_while_queued_drops_the_request(controlled, caplog):
    caplog.set_level(logging.INFO, logger="strata.serve")
    server, engine = controlled
    worker = server.state.ready.worker
    requests_before = server.state.ready.engine.counters.num_requests
    closed_key = 'strata_http_requests_total{route="/v1/completions",status="499"}'
    refused_key = 'strata_http_requests_total{route="/v1/completions",status="503"}'
    before = metric_values(httpx.get(server.url + "/metrics").text)
    engine.gate.clear()
    engine.entered.clear()
    body = {"model": "tiny", "prompt": "Waiting", "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, server.url + COMPLETIONS, json=body, timeout=30)
        assert engine.entered.wait(20)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + COMPLETIONS, json=body, timeout=httpx.Timeout(30, read=0.3))
        wait_for(lambda: all(job.is_cancelled() for job in list(worker._waiting)))
        engine.gate.set()
        assert running.result().status_code == 200
    wait_for(lambda: worker.num_waiting == 0 and not worker.is_busy)
    assert any("cancelled while waiting in the queue" in r.getMessage() for r in caplog.records)
    assert server.state.ready.engine.counters.num_requests == requests_before + 1
    # the client that went away is counted as 499, not as a refusal of the server's
    wait_for(lambda: metric_values(httpx.get(server.url + "/metrics").text).get(closed_key, 0)
             == before.get(closed_key, 0) + 1)
    after = metric_values(httpx.get(server.url + "/metrics").text)
    assert after.get(refused_key, 0) == before.get(refused_key, 0)


def test_disconnect_during_prefill_stops_it_and_is_counted_as_499(controlled, monkeypatch, timing_lines):
    server, engine = controlled
    in_prefill, resume = threading.Event(), threading.Event()
    forward = engine.runner.forward

    def held_prefill(tokens, start, workspace, *rest):
        if workspace is not None:  # a prefill chunk: held until its client has gone
            in_prefill.set()
            assert resume.wait(20)
        return forward(tokens, start, workspace, *rest)

    monkeypatch.setattr(engine.runner, "forward", held_prefill)
    closed_key = 'strata_http_requests_total{route="/v1/completions",status="499"}'
    before = metric_values(httpx.get(server.url + "/metrics").text).get(closed_key, 0)
    body = {"model": "tiny", "prompt": "A prompt whose client leaves", "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        leaving = pool.submit(httpx.post, server.url + COMPLETIONS, json=body, timeout=httpx.Timeout(30, read=0.5))
        assert in_prefill.wait(20)
        with pytest.raises(httpx.ReadTimeout):
            leaving.result()
        job = server.state.ready.worker._running
        wait_for(lambda: job is not None and job.is_cancelled())
        resume.set()
    wait_for(lambda: metric_values(httpx.get(server.url + "/metrics").text).get(closed_key, 0) == before + 1)
    assert any("generated 0 (cancelled)" in line for line in timing_lines())
    monkeypatch.setattr(engine.runner, "forward", forward)
    assert httpx.post(server.url + COMPLETIONS, json=body, timeout=30).status_code == 200


def test_failure_mid_stream_arrives_as_an_error_event(controlled):
    server, engine = controlled
    engine.fail_after_tokens = 2
    # greedy, so that the stream cannot end at an end-of-generation token before the failure
    body = {"model": "tiny", "prompt": "Break halfway", "max_tokens": 8, "stream": True, "temperature": 0}
    failed_before = metric_values(httpx.get(server.url + "/metrics").text)["strata_requests_failed_total"]
    try:
        response = httpx.post(server.url + COMPLETIONS, json=body, timeout=30)
        with pytest.raises(openai.APIError, match="injected decode failure"):
            list(openai_client(server).completions.create(**body))
    finally:
        engine.fail_after_tokens = 0
    assert response.status_code == 200  # the status line went out with the first token
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"  # after the error too: a client reading up to [DONE] stops
    error = events[-2]["error"]
    assert error["code"] == "engine_error" and "injected decode failure" in error["message"]
    assert all("choices" in event for event in events[:-2]) and len(events) >= 3
    failed_after = metric_values(httpx.get(server.url + "/metrics").text)["strata_requests_failed_total"]
    assert failed_after == failed_before + 2  # this stream and the openai client's
    after = httpx.post(server.url + COMPLETIONS, json={**body, "stream": False})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] >= 1


def test_a_loan_that_cannot_be_restored_stops_serving(tiny_model):
    config = make_config(tiny_model, serve={"max_queue": 4})
    engines = []
    loader = engine_loader(config, wrap=lambda engine: engines.append(ControlledEngine(engine)) or engines[0])
    with RunningServer(loader, config) as server:
        server.wait_ready()
        engine = engines[0]
        engine.gate.clear()
        engine.failure = LoanRestoreError("output_head could not be restored")
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            failing = pool.submit(httpx.post, server.url + COMPLETIONS, json=body, timeout=30)
            assert engine.entered.wait(20)
            waiting = pool.submit(httpx.post, server.url + COMPLETIONS, json=body, timeout=30)
            wait_for(lambda: server.state.ready.worker.num_waiting == 1)
            engine.gate.set()
            assert error_of(failing.result(), 500)["code"] == "engine_error"
            assert error_of(waiting.result(), 503)["code"] == "engine_stopped"
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert error_of(httpx.post(server.url + COMPLETIONS, json=body), 503)["code"] == "engine_unhealthy"


def test_a_ready_servers_objects_are_out_of_the_collectors_full_passes_until_it_closes(tiny_model):
    import gc

    config = make_config(tiny_model)
    with RunningServer(engine_loader(config), config) as running:
        running.wait_ready()
        assert gc.get_freeze_count() > 0  # the model's objects: a full pass over them would stall a decode step
    assert gc.get_freeze_count() == 0
