"""``GET /metrics``: the HTTP exchanges, the engine's cumulative counters and the queue, in
Prometheus text format.

HTTP figures come from the server's telemetry (every response by route and status, latency and
time-to-first-token histograms, per-request token rates, failed requests) and are reported from
the start; engine counters come from ``engine.counters`` (summed by the engine over every request
it ran) and the queue figures from the worker, once the model is loaded.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from strata.serve.telemetry import Histogram, ServeTelemetry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric, type, help, attribute of engine.counters)
ENGINE_METRICS = (
    ("strata_requests_total", "counter", "requests the engine ran", "num_requests"),
    ("strata_engine_requests_failed_total", "counter", "requests whose prefill failed inside the engine",
     "num_failed_requests"),
    ("strata_prompt_tokens_total", "counter", "prompt tokens of every request", "num_prompt_tokens"),
    ("strata_unread_tokens_total", "counter", "prompt tokens prefilled, i.e. not reused from the KV prefix",
     "num_unread_tokens"),
    ("strata_generated_tokens_total", "counter", "tokens generated", "num_generated_tokens"),
    ("strata_prefill_tokens_per_second", "gauge", "prefill rate of the last request", "last_prefill_tokens_per_s"),
    ("strata_decode_tokens_per_second", "gauge", "decode rate of the last request", "last_decode_tokens_per_s"),
    ("strata_loans_taken_total", "counter", "requests whose prefill ran with the VRAM loan", "num_loans_taken"),
    ("strata_loans_skipped_total", "counter", "requests whose prefill ran without the loan", "num_loans_skipped"),
    ("strata_loans_failed_total", "counter", "loans whose prefill failed (resources restored)", "num_loans_failed"),
    ("strata_loan_released_bytes_total", "counter", "bytes released by loans", "released_bytes"),
    ("strata_loan_restored_bytes_total", "counter", "bytes restored after loans", "restored_bytes"),
    ("strata_expert_cache_hits_total", "counter", "expert lookups served from the VRAM cache", "cache_hits"),
    ("strata_expert_cache_misses_total", "counter", "expert lookups streamed from host memory", "cache_misses"),
    ("strata_expert_streamed_bytes_total", "counter", "expert bytes streamed from host memory", "streamed_bytes"),
    ("strata_prefill_seconds_total", "counter", "time spent in prefill", "prefill_seconds"),
    ("strata_decode_seconds_total", "counter", "time spent in decode", "decode_seconds"),
    ("strata_spec_steps_total", "counter", "speculative verify steps", "spec_rounds"),
    ("strata_spec_drafted_total", "counter", "MTP draft tokens verified", "spec_drafted"),
    ("strata_spec_accepted_total", "counter", "MTP draft tokens the model agreed with", "spec_accepted"),
)


def render_metrics(state: Any) -> str:
    out = _Exposition()
    ready = state.ready
    out.add("strata_ready", "gauge", "1 once the model is loaded and requests are served",
            [({}, int(ready is not None))])
    _add_http(out, state.telemetry)
    if ready is None:
        return out.text()
    counters = ready.engine.counters
    for name, kind, help_text, attribute in ENGINE_METRICS:
        out.add(name, kind, help_text, [({}, getattr(counters, attribute))])
    out.add("strata_spec_drafted_by_position_total", "counter",
            "MTP drafts verified at each place of a step's draft run (1: the first draft)",
            [({"position": str(place + 1)}, n) for place, n in enumerate(counters.spec_drafted_by_position)])
    out.add("strata_spec_accepted_by_position_total", "counter",
            "MTP drafts taken at each place of a step's draft run (taken only if every earlier one was)",
            [({"position": str(place + 1)}, n) for place, n in enumerate(counters.spec_accepted_by_position)])
    rates = ready.engine.planner.rates
    if rates is not None:
        out.add("strata_prefill_rate", "gauge", "the prefill cost model's rates (pcie in bytes/s, compute in FLOP/s) "
                "and how each was obtained (measured, calibrated, configured or assumed)",
                [({"rate": name, "source": rate.kind}, rate.value)
                 for name, rate in (("pcie_bytes_per_s", rates.pcie), ("compute_flops_per_s", rates.compute))])
    hits, misses = counters.cache_hits, counters.cache_misses
    out.add("strata_expert_cache_hit_rate", "gauge", "share of expert lookups served from the VRAM cache",
            [({}, hits / (hits + misses) if hits + misses else 0.0)])
    worker = ready.worker
    out.add("strata_queue_depth", "gauge", "requests waiting for the engine", [({}, worker.num_waiting)])
    out.add("strata_requests_running", "gauge", "requests the engine is running now (0 or 1)",
            [({}, int(worker.is_busy))])
    out.add("strata_queue_rejected_total", "counter", "requests refused with 503 because the queue was full",
            [({}, worker.num_rejected)])
    by_owner = ready.engine.ledger.snapshot().by_owner
    out.add("strata_vram_ledger_idle", "gauge", "1 when the VRAM ledger holds exactly what the idle engine holds "
            "(nothing a request took is left charged), else 0: 0 while a request runs, and before the first "
            "request while a startup loan defers resources",
            [({}, int(dict(by_owner) == dict(ready.engine.idle_ledger.by_owner)))])
    out.add("strata_vram_bytes", "gauge", "device memory charged to each owner in the VRAM ledger",
            [({"owner": owner}, num_bytes) for owner, num_bytes in sorted(by_owner.items())])
    return out.text()


def _add_http(out: _Exposition, telemetry: ServeTelemetry) -> None:
    out.add("strata_http_requests_total", "counter", "HTTP responses by route and status",
            telemetry.response_samples())
    out.add("strata_requests_failed_total", "counter", "requests that failed on the server's side: answered 500, "
            "or a stream ended by an error event", [({}, telemetry.num_failed)])
    out.add_histogram("strata_http_request_duration_seconds", "time from a request's arrival to its response's "
                      "last byte, by route", [({"route": route}, histogram) for route, histogram
                                              in sorted(telemetry.latency_by_route.items())])
    out.add_histogram("strata_time_to_first_token_seconds", "time from a generation request's arrival to its first "
                      "token", [({}, telemetry.time_to_first_token)])
    out.add_histogram("strata_request_prefill_tokens_per_second", "prefill rate of each request (unread prompt "
                      "tokens)", [({}, telemetry.prefill_rate)])
    out.add_histogram("strata_request_decode_tokens_per_second", "decode rate of each request",
                      [({}, telemetry.decode_rate)])


class _Exposition:
    def __init__(self):
        self._lines: list[str] = []

    def add(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
        self._lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        self._lines += [self._sample(name, labels, value) for labels, value in samples]

    @staticmethod
    def _sample(name: str, labels: dict[str, str], value: float) -> str:
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        return f"{name}{{{label_text}}} {_number(value)}" if label_text else f"{name} {_number(value)}"

    def add_histogram(self, name: str, help_text: str, histograms: Iterable[tuple[dict[str, str], Histogram]]) -> None:
        self._lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for labels, histogram in histograms:
            for suffix, sample_labels, value in histogram.samples(labels):
                self._lines.append(self._sample(name + suffix, sample_labels, value))

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return str(int(value)) if float(value).is_integer() else repr(float(value))
