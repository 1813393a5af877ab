"""A shutdown during a stream: the generation stops within 0.5 s, the client gets an error event
and [DONE], nothing is logged as a crash, and the server is gone within a second."""

import json
import logging
import threading
import time

import httpx
from serve_harness import ControlledEngine, RunningServer, engine_loader, make_config

COMPLETIONS = "/v1/completions"


def test_shutdown_mid_stream_ends_the_generation_and_the_stream(tiny_model, caplog):
    caplog.set_level(logging.INFO)
    config = make_config(tiny_model, serve={"max_queue": 4})
    engines = []
    loader = engine_loader(config, wrap=lambda engine: engines.append(ControlledEngine(engine)) or engines[0])
    with RunningServer(loader, config) as running:
        running.wait_ready()
        _shut_down_mid_stream(running, engines[0], caplog)


def _shut_down_mid_stream(running, engine, caplog):
    engine.pace_s = 0.02  # a slow model: 50 tokens a second
    body = {"model": "tiny", "prompt": "Tell me everything", "max_tokens": 900, "stream": True, "temperature": 0}
    events, ended = [], threading.Event()

    def stream():
        with httpx.stream("POST", running.url + COMPLETIONS, json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        ended.set()

    client = threading.Thread(target=stream)
    client.start()
    deadline = time.monotonic() + 20
    while len(events) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    waiting_result = {}  # a request waiting in the queue is refused, not left hanging
    waiting = threading.Thread(target=lambda: waiting_result.update(
        response=httpx.post(running.url + COMPLETIONS, json={**body, "stream": False}, timeout=30)))
    waiting.start()
    while running.state.ready.worker.num_waiting < 1:
        time.sleep(0.005)

    asked_at, asked_at_wall = time.monotonic(), time.time()
    stopper = threading.Thread(target=lambda: running.stop(5))
    stopper.start()
    assert ended.wait(5)
    stream_ended_s = time.monotonic() - asked_at
    stopper.join(5)
    exited_s = time.monotonic() - asked_at
    client.join(5)
    waiting.join(5)

    timing = next(r for r in caplog.records if r.name == "strata.serve" and " prompt " in r.getMessage())
    assert "(cancelled)" in timing.getMessage()
    assert timing.created - asked_at_wall < 0.5, timing.created - asked_at_wall  # the engine stopped in time
    assert stream_ended_s < 0.5 and exited_s < 1.0, (stream_ended_s, exited_s)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert all("choices" in json.loads(e) for e in events[:-2])
    assert waiting_result["response"].status_code == 503
    assert waiting_result["response"].json()["error"]["code"] == "shutting_down"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    assert not stopper.is_alive()
