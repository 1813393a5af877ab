"""``GET /metrics``: the engine's cumulative counters and the queue, in Prometheus text format.

Counters come from ``engine.counters`` (summed by the engine over every request it ran); the
queue figures come from the worker. Before the model is loaded only ``strata_ready`` is reported.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric, type, help, attribute of engine.counters)
ENGINE_METRICS = (
    ("strata_requests_total", "counter", "requests the engine ran", "num_requests"),
    ("strata_requests_failed_total", "counter", "requests that failed inside the engine", "num_failed_requests"),
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
)


def render_metrics(state: Any) -> str:
    out = _Exposition()
    ready = state.ready
    out.add("strata_ready", "gauge", "1 once the model is loaded and requests are served", [({}, int(ready is not None))])
    if ready is None:
        return out.text()
    counters = ready.engine.counters
    for name, kind, help_text, attribute in ENGINE_METRICS:
        out.add(name, kind, help_text, [({}, getattr(counters, attribute))])
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
    out.add("strata_vram_bytes", "gauge", "device memory charged to each owner in the VRAM ledger",
            [({"owner": owner}, num_bytes) for owner, num_bytes in sorted(by_owner.items())])
    return out.text()


class _Exposition:
    def __init__(self):
        self._lines: list[str] = []

    def add(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
        self._lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            self._lines.append(f"{name}{{{label_text}}} {_number(value)}" if label_text else f"{name} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return str(int(value)) if float(value).is_integer() else repr(float(value))
