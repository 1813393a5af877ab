"""Serving with the prefill VRAM loan on: many requests and an engine failure leave the ledger idle."""

import random

import httpx
import pytest
from serve_harness import (
    RunningServer,
    engine_loader,
    error_of,
    install_fault_plugin,
    make_config,
    metric_values,
    openai_client,
    sse_events,
)

LOAN_RUNTIME = {"vram_elastic": True, "vmm_segment": "64MiB"}
LOAN = {"enabled": True, "plugins": ["repeat_loan", "retain_startup_chunk"], "repeat_loan": {"min_tokens": 256}}


def loan_server(tiny_model, plugins=()):
    config = make_config(tiny_model, runtime=LOAN_RUNTIME,
                         loan={**LOAN, "plugins": [*LOAN["plugins"], *plugins]})
    return RunningServer(engine_loader(config), config)


def test_100_sequential_requests_of_mixed_lengths_end_at_the_idle_ledger(tiny_model, timing_lines):
    rng = random.Random(3)
    with loan_server(tiny_model) as server:
        server.wait_ready()
        engine = server.state.ready.engine
        vocab = engine.tokenizer.vocab_size
        client = openai_client(server)
        model = server.state.ready.model_name
        for index in range(100):
            num_prompt = rng.choice([5, 40, 120, 300, 420])
            prompt = [rng.randrange(vocab // 2, vocab - 1) for _ in range(num_prompt)]  # no shared prefix
            max_tokens = rng.choice([1, 2, 4])
            if index % 10 == 3:
                messages = [{"role": "user", "content": "word " * rng.randrange(5, 120)}]
                reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
            elif index % 10 == 7:
                chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                        stream=True, stream_options={"include_usage": True}))
                reply = chunks[-1]
            else:
                reply = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, seed=index)
            assert reply.usage.completion_tokens <= max_tokens
            assert engine.ledger.snapshot() == engine.idle_ledger, f"request {index}"
        metrics = metric_values(httpx.get(server.url + "/metrics").text)
    assert metrics["strata_requests_total"] == 100 and metrics["strata_requests_failed_total"] == 0
    assert metrics["strata_loans_taken_total"] >= 20 and metrics["strata_loans_skipped_total"] >= 20
    assert metrics["strata_loans_failed_total"] == 0
    assert metrics["strata_loan_released_bytes_total"] == metrics["strata_loan_restored_bytes_total"]
    lines = timing_lines()
    assert len(lines) == 100
    assert sum("loan on" in line for line in lines) == metrics["strata_loans_taken_total"]


@pytest.fixture
def faulty_server(tiny_model, tmp_path, monkeypatch):
    name = install_fault_plugin(tmp_path, monkeypatch)
    with loan_server(tiny_model, plugins=[name]) as server:
        server.wait_ready()
        yield server, __import__("strata_serve_faults").ARMED


@pytest.mark.parametrize("is_stream", [False, True])
def test_engine_failure_answers_500_restores_the_loan_and_the_next_request_succeeds(faulty_server, is_stream):
    server, armed = faulty_server
    engine = server.state.ready.engine
    assert "output_head" in engine.resources  # the fault plugin lends it, so restore has work to do
    long_prompt = list(range(100, 400))  # 300 unread tokens: the repeat loan runs
    body = {"model": server.state.ready.model_name, "prompt": long_prompt, "max_tokens": 3, "stream": is_stream}
    armed.append(True)
    failed = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    error = error_of(failed, 500)
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "injected failure" in error["message"]
    assert not armed
    assert engine.ledger.snapshot() == engine.idle_ledger
    assert engine.resources["output_head"].is_resident

    again = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert again.status_code == 200, again.text
    if is_stream:
        assert sse_events(again.text)[-1] == "[DONE]"
    else:
        assert again.json()["usage"]["completion_tokens"] >= 1
    assert engine.ledger.snapshot() == engine.idle_ledger
    metrics = metric_values(httpx.get(server.url + "/metrics").text)
    assert metrics["strata_requests_failed_total"] == 1 and metrics["strata_loans_failed_total"] == 1
    assert metrics["strata_loans_taken_total"] >= 2


def test_a_response_reports_its_plan_and_loan_and_metrics_say_when_the_ledger_is_idle(tiny_model):
    with loan_server(tiny_model) as server:
        server.wait_ready()
        engine, model = server.state.ready.engine, server.state.ready.model_name

        def is_idle():
            return metric_values(httpx.get(server.url + "/metrics").text)["strata_vram_ledger_idle"]

        body = {"model": model, "max_tokens": 3}
        long_prompts = [list(range(100, 400)), list(range(400, 100, -1))]  # 300 unread tokens, no shared prefix
        for prompt in long_prompts:  # the startup loan, then a repeat loan
            answer = httpx.post(server.url + "/v1/completions", json=body | {"prompt": prompt}, timeout=30).json()
            report, geometry = answer["strata"], engine.loan.last_report.geometry
            assert report["loan"]["is_taken"] and report["loan"]["retries"] == 0
            assert report["plan"] == {"chunk_tokens": geometry.chunk_tokens, "ring_slots": geometry.ring_slots}
            assert report["num_chunks"] == -(-300 // geometry.chunk_tokens)
            assert is_idle() == 1
        short = httpx.post(server.url + "/v1/completions", json=body | {"prompt": [7, 8, 9]}, timeout=30).json()
        assert not short["strata"]["loan"]["is_taken"] and "repeat threshold" in short["strata"]["loan"]["reason"]
        charge = engine.ledger.charge("left_behind", 4096)  # what a leaking request would leave
        assert is_idle() == 0
        engine.ledger.discharge(charge)
        assert is_idle() == 1
