"""A seeded fuzzer against one real server on the numpy engine: no body, key, value, byte or
content type a client sends gets a status >= 500 or no answer, and the server stays healthy."""

import collections

import httpx
import pytest
from fuzz_bodies import BodyFuzzer
from serve_harness import (
    RunningServer,
    engine_loader,
    make_config,
    metric_values,
    sse_events,
)

NUM_CASES = 2400
SEED = 20261201


@pytest.fixture(scope="module")
def fuzz_server(tiny_model):
    # a short context keeps a chat without max_tokens (the rest of the context) cheap
    config = make_config(tiny_model, runtime={"context_tokens": 256})
    with RunningServer(engine_loader(config), config) as server:
        server.wait_ready()
        yield server


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a NaN or an overflow on the way is a bug too
def test_no_generated_body_gets_a_server_error(fuzz_server):
    ready = fuzz_server.state.ready
    cases = BodyFuzzer(SEED, ready.model_name, ready.engine.tokenizer.vocab_size).cases(NUM_CASES)
    statuses: collections.Counter[int] = collections.Counter()
    failures = []
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as client:
        for index, case in enumerate(cases):
            try:
                response = client.request(case.method, case.path, content=case.body, headers=case.headers)
            except httpx.HTTPError as exc:
                failures.append(f"case {index} ({case.origin}): no response ({exc!r}): {case.body[:200]!r}")
                continue
            statuses[response.status_code] += 1
            problem = _problem(response)
            if problem:
                failures.append(f"case {index} ({case.origin}): {problem}: {case.body[:200]!r}")
    assert not failures, f"{len(failures)} of {NUM_CASES} failed:\n" + "\n".join(failures[:20])
    assert statuses[200] >= NUM_CASES // 5 and sum(n for s, n in statuses.items() if 400 <= s < 500) >= NUM_CASES // 3
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    answer = httpx.post(fuzz_server.url + "/v1/completions", json={"model": ready.model_name, "prompt": "still",
                                                                   "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
    metrics = metric_values(httpx.get(fuzz_server.url + "/metrics").text)
    assert metrics["strata_requests_failed_total"] == 0 and ready.worker.fatal_error is None


def _problem(response: httpx.Response) -> str:
    status = response.status_code
    if status >= 500:
        return f"status {status}: {response.text[:300]}"
    if status >= 400:
        body = response.json()
        if set(body) != {"error"} or set(body["error"]) != {"message", "type", "param", "code"}:
            return f"status {status} without the OpenAI error shape: {response.text[:300]}"
        return ""
    if response.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(response.text)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        if errors or events[-1] != "[DONE]":
            return f"stream ended with {events[-2:]}"
    return ""
