"""What the HTTP side counts for ``/metrics``: responses by route and status, latency and
time-to-first-token histograms, per-request token rates, and failed requests.

Everything is recorded on the event loop's thread (the middleware and the request coroutines), so
nothing here needs a lock. Route labels come from a fixed set, so a client sending random paths
cannot grow the number of series.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Iterator
from typing import Any

from strata.engine.request import RequestStats

KNOWN_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
MODEL_ROUTE = "/v1/models/{model_id}"
OTHER_ROUTE = "other"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKENS_PER_S_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0)


def route_label(path: str) -> str:
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return MODEL_ROUTE
    return OTHER_ROUTE


@dataclasses.dataclass
class Histogram:
    """Cumulative buckets in the Prometheus sense: ``bucket_counts[i]`` counts values <= upper_bounds[i]."""

    upper_bounds: tuple[float, ...]
    bucket_counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.bucket_counts = [0] * len(self.upper_bounds)

    def observe(self, value: float) -> None:
        for index in range(bisect.bisect_left(self.upper_bounds, value), len(self.upper_bounds)):
            self.bucket_counts[index] += 1
        self.total += value
        self.count += 1

    def samples(self, labels: dict[str, str]) -> Iterator[tuple[str, dict[str, str], float]]:
        """(name suffix, labels, value) of the exposition: each bucket, +Inf, sum and count."""
        for upper, num in zip(self.upper_bounds, self.bucket_counts):
            yield "_bucket", {**labels, "le": f"{upper:g}"}, num
        yield "_bucket", {**labels, "le": "+Inf"}, self.count
        yield "_sum", labels, self.total
        yield "_count", labels, self.count


class ServeTelemetry:
    def __init__(self) -> None:
        self.num_responses: collections.Counter[tuple[str, int]] = collections.Counter()
        self.latency_by_route: dict[str, Histogram] = {}
        self.time_to_first_token = Histogram(TTFT_BUCKETS_S)
        self.prefill_rate = Histogram(TOKENS_PER_S_BUCKETS)
        self.decode_rate = Histogram(TOKENS_PER_S_BUCKETS)
        self.num_failed = 0  # answered 500, or a stream ended by an error event

    def record_response(self, path: str, status: int, seconds: float) -> None:
        """One finished HTTP exchange; ``seconds`` runs until its last byte (a stream's end)."""
        route = route_label(path)
        self.num_responses[(route, status)] += 1
        self.latency_by_route.setdefault(route, Histogram(LATENCY_BUCKETS_S)).observe(seconds)
        if status == 500:
            self.num_failed += 1

    def record_stream_failure(self) -> None:
        """A stream whose 200 had gone out when it failed: its error travels as an event."""
        self.num_failed += 1

    def record_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def record_generation(self, stats: RequestStats) -> None:
        if stats.is_prefill_cut:  # no token, and a rate over part of a prefill
            return
        if stats.unread_tokens and stats.prefill_seconds > 0:
            self.prefill_rate.observe(stats.prefill_tokens_per_s)
        if stats.generated_tokens > 1 and stats.decode_seconds > 0:
            self.decode_rate.observe(stats.decode_tokens_per_s)

    def response_samples(self) -> list[tuple[dict[str, str], Any]]:
        return [({"route": route, "status": str(status)}, num)
                for (route, status), num in sorted(self.num_responses.items())]
