"""/metrics by route and status with latency, TTFT and rate histograms; timings in responses."""

import httpx
import pytest
from serve_harness import error_of, metric_values, openai_client, sse_events

TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
           "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture
def metrics(server):
    return lambda: metric_values(httpx.get(server.url + "/metrics").text)


def test_responses_are_counted_by_route_and_status_with_latency(server, metrics):
    before = metrics()
    # the shared server's prefix cache may leave any first token: no end of generation, so one comes
    no_end = {str(token): -100 for token in server.state.ready.engine.tokenizer.eog_ids}
    body = {"model": server.state.ready.model_name, "prompt": "Count me", "max_tokens": 2, "logit_bias": no_end}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    error_of(httpx.post(server.url + "/v1/completions", json={**body, "top_k": -1}), 400)
    error_of(httpx.get(server.url + "/no/such/path"), 404)
    after = metrics()

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta('strata_http_requests_total{route="/v1/completions",status="200"}') == 1
    assert delta('strata_http_requests_total{route="/v1/completions",status="400"}') == 1
    assert delta('strata_http_requests_total{route="other",status="404"}') == 1
    assert delta('strata_http_request_duration_seconds_count{route="/v1/completions"}') == 2
    assert delta('strata_http_request_duration_seconds_bucket{route="/v1/completions",le="+Inf"}') == 2
    assert delta('strata_http_request_duration_seconds_sum{route="/v1/completions"}') > 0
    assert delta("strata_time_to_first_token_seconds_count") == 1
    assert delta("strata_request_prefill_tokens_per_second_count") == 1
    assert delta("strata_requests_failed_total") == 0  # a 400 is the client's failure, not the server's
    # the cost model's rates on the numpy backend: PCIe assumed, compute calibrated by the requests' chunks
    assert after['strata_prefill_rate{rate="pcie_bytes_per_s",source="assumed"}'] == 55e9
    assert any(k.startswith('strata_prefill_rate{rate="compute_flops_per_s",source="') for k in after)
    buckets = [v for k, v in after.items() if k.startswith("strata_time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets)  # cumulative


def test_a_completion_carries_its_timings(server):
    client, model = openai_client(server), server.state.ready.model_name
    prompt = "Timings for a prompt that is reused"
    first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    timings, repeated = first.model_extra["timings"], again.model_extra["timings"]
    assert set(timings) == TIMINGS
    assert timings["predicted_n"] == first.usage.completion_tokens and timings["predicted_ms"] > 0
    assert timings["prompt_n"] + timings["cache_n"] == first.usage.prompt_tokens
    assert repeated["cache_n"] == first.usage.prompt_tokens - 1 and repeated["prompt_n"] == 1
    expected_rate = 1e3 * timings["predicted_n"] / timings["predicted_ms"]
    assert timings["predicted_per_second"] == pytest.approx(expected_rate, rel=1e-2)
    # the engine's own figures: its plan, no loan (none configured), and decode's rate over its steps
    report = first.model_extra["strata"]
    loan = report["loan"]
    assert {k: loan[k] for k in ("is_taken", "reason", "retries", "released")} == {
        "is_taken": False, "reason": "loan.enabled is false", "retries": 0, "released": []}
    assert {"plan", "allocate", "free", "put back"} <= set(loan["phase_ms"]) and min(loan["phase_ms"].values()) >= 0
    assert report["compiles"] == {"count": 0, "seconds": 0.0}  # the numpy backend compiles no kernel
    assert report["plan"]["chunk_tokens"] >= timings["prompt_n"] and report["num_chunks"] == 1
    assert report["prefill_tokens_per_s"] == pytest.approx(timings["prompt_per_second"], rel=1e-2)
    steps = timings["predicted_n"] - 1
    assert report["decode_tokens_per_s"] == pytest.approx(1e3 * steps / timings["predicted_ms"], rel=1e-2)


def test_a_stream_carries_its_timings_in_the_final_chunk(server):
    no_end = {str(token): -100 for token in server.state.ready.engine.tokenizer.eog_ids}  # decode steps to time
    body = {"model": server.state.ready.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "logit_bias": no_end}
    events = sse_events(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).text)
    final = events[-2]
    assert final["choices"][0]["finish_reason"] is not None and set(final["timings"]) == TIMINGS
    assert final["strata"]["plan"] is not None and final["strata"]["decode_tokens_per_s"] > 0
    assert all("timings" not in event for event in events[:-2])
