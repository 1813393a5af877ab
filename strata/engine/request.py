"""What one request gives the engine and what it gets back."""

from __future__ import annotations

import dataclasses
from typing import Callable

from strata.engine.collector import CollectorTally
from strata.engine.loan.transaction import LoanReport
from strata.engine.prefill_timeline import format_summary
from strata.engine.sampling import TokenLogprobs
from strata.hooktypes import Geometry


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it completes (empty while a UTF-8 sequence or a possible
    stop string is still open)."""

    token_id: int
    text: str
    logprobs: TokenLogprobs | None = None  # where the request asked for them (``SamplingParams.num_logprobs``)


@dataclasses.dataclass(frozen=True)
class RequestStats:
    """The request's timing line, and the figures the metrics endpoint sums."""

    prompt_tokens: int
    unread_tokens: int
    generated_tokens: int
    geometry: Geometry | None
    prefill_seconds: float
    decode_seconds: float
    streamed_bytes: int
    num_chunks: int
    cache_hits: int
    cache_misses: int
    loan: LoanReport | None
    finish_reason: str  # "stop" (EOS or a stop string), "length", "cancelled"
    # cancelled between two prefill layers: no token; unread_tokens counts the chunks that ran, and the time
    # includes the cut one, so its rates are not the engine's
    is_prefill_cut: bool = False
    prefill_streamed_bytes: int = 0  # the part of streamed_bytes that prefill streamed
    restaged_bytes: int = 0  # the part staged after prefill to put back the experts its ring evicted
    kv_host_bytes: int = 0  # KV cells read from and written to the host tier (past runtime.kv_resident_cells)
    prefetched_experts: int = 0  # decode's experts staged ahead of their layer (hits when the prediction held)
    prefetched_used_experts: int = 0  # of those, the ones their layer then routed the token to
    # captured decode: the host blocked on the device's readbacks. The rest of decode_seconds is the host's
    # own time: its per-layer bookkeeping and launches, and whatever the caller does between tokens
    decode_wait_seconds: float = 0.0
    is_speculative: bool = False  # decoded by MTP speculation (runtime.mtp)
    spec_rounds: int = 0  # verify steps
    spec_drafted: int = 0  # draft tokens verified
    spec_accepted: int = 0  # of those, taken
    spec_depth: int = 0  # the depth the policy chose last (0: plain decode)
    spec_launch_seconds: float = 0.0  # the host's time launching device speculation's steps
    spec_drafted_by_position: tuple[int, ...] = ()  # per place in a step's draft run
    spec_accepted_by_position: tuple[int, ...] = ()
    is_draft_oracle: bool = False  # the bench's --draft-oracle replaced the drafts: not the model's own speed
    num_compiles: int = 0  # compilations inside this request (GPU; the warm-up should have done them all)
    compile_seconds: float = 0.0  # their time, inside prefill_seconds and decode_seconds
    # device time inside prefill_seconds: the chunks' forward passes, and the MTP block's passes over them; the rest
    # is the loan's work, the first token's logits, the restaging, and the host's gaps
    prefill_forward_seconds: float = 0.0
    prefill_mtp_seconds: float = 0.0
    prefill_layers: dict | None = None  # PrefillTimeline.summary() of a request timed layer by layer
    # Python's collector while the request ran, any thread's passes (their time is inside prefill_seconds and
    # decode_seconds), and while it prefilled
    collector: CollectorTally = CollectorTally()
    prefill_collector: CollectorTally = CollectorTally()

    @property
    def spec_acceptance(self) -> float:
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.unread_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes from prefill's logits; decode steps produce the rest
        steps = max(0, self.generated_tokens - 1)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def cache_hit_rate(self) -> float:
        total = self.cache_hits + self.cache_misses
        return self.cache_hits / total if total else 1.0

    def timing_line(self) -> str:
        plan = str(self.geometry) if self.geometry else "-"
        loan = self.loan.summary() if self.loan else "loan off"
        return (f"prompt {self.prompt_tokens} tok, unread {self.unread_tokens}, generated {self.generated_tokens} "
                f"({self.finish_reason}) | plan {plan} in {self.num_chunks} chunk(s) | "
                f"PP {self.prefill_tokens_per_s:.1f} tok/s, TG {self.decode_tokens_per_s:.1f} tok/s | "
                f"streamed {self.streamed_bytes / 2**20:.1f} MiB (prefill {self.prefill_streamed_bytes / 2**20:.1f}"
                + (f", restaged {self.restaged_bytes / 2**20:.1f}" if self.restaged_bytes else "")
                + f"), expert-cache hit rate {self.cache_hit_rate:.1%}"
                + (f" ({self.prefetched_experts} prefetched, {self.prefetched_used_experts} used)"
                   if self.prefetched_experts else "") + self._kv_host_tier() + self._host_share() + self._speculation()
                + self._compiles() + self._collector() + self._prefill_device() + f" | {loan}")

    def _prefill_device(self) -> str:
        if self.prefill_forward_seconds <= 0:
            return ""
        mtp = f", MTP pass {1e3 * self.prefill_mtp_seconds:.1f}" if self.prefill_mtp_seconds > 0 else ""
        return (f" | prefill device: forward {1e3 * self.prefill_forward_seconds:.1f} ms{mtp}"
                + (format_summary(self.prefill_layers) if self.prefill_layers else ""))

    def _collector(self) -> str:
        """Shown once the collector cost a millisecond: a full pass over a loaded model costs hundreds."""
        if self.collector.seconds < 1e-3:
            return ""
        return (f" | collector {self.collector.num_passes} pass(es) ({self.collector.num_full_passes} full) "
                f"{1e3 * self.collector.seconds:.1f} ms, in prefill {1e3 * self.prefill_collector.seconds:.1f} ms")

    def _compiles(self) -> str:
        return f" | compiled {self.num_compiles} time(s) in {self.compile_seconds:.2f} s" if self.num_compiles else ""

    def _kv_host_tier(self) -> str:
        return f" | KV host tier {self.kv_host_bytes / 2**20:.1f} MiB moved" if self.kv_host_bytes else ""

    def _speculation(self) -> str:
        if not self.is_speculative:
            return ""
        oracle = ", draft oracle" if self.is_draft_oracle else ""
        launches = (f", launches {1e3 * self.spec_launch_seconds / self.spec_rounds:.2f} ms a verify step"
                    if self.spec_launch_seconds > 0 and self.spec_rounds else "")
        return (f" | spec drafted {self.spec_drafted}, accepted {self.spec_accepted} ({self.spec_acceptance:.0%}), "
                f"depth {self.spec_depth}{oracle}{launches}")

    def _host_share(self) -> str:
        """Per decode step: the host's waits on the device and its own work (captured decode only)."""
        share = host_ms_per_step(self.decode_seconds, self.decode_wait_seconds, self.generated_tokens - 1)
        if share is None:
            return ""
        wait_ms, busy_ms = share
        return f" | decode host: waiting {wait_ms:.1f} ms/token, busy {busy_ms:.1f}"


def host_ms_per_step(decode_seconds: float, wait_seconds: float, num_steps: int) -> tuple[float, float] | None:
    """(waiting, busy) ms a decode step: the host's waits on the device, and the rest of the decode time (its
    own work); None where decode was not captured (no waits recorded) or had no step."""
    if num_steps <= 0 or wait_seconds <= 0:
        return None
    return 1e3 * wait_seconds / num_steps, 1e3 * max(0.0, decode_seconds - wait_seconds) / num_steps


IsCancelled = Callable[[], bool]
