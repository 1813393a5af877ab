"""Cumulative figures across requests, for the metrics endpoint."""

from __future__ import annotations

import dataclasses

from strata.engine.request import RequestStats


@dataclasses.dataclass
class EngineCounters:
    num_requests: int = 0
    num_failed_requests: int = 0
    num_completed_prefills: int = 0  # requests whose prefill ran to its end (not failed, not cut by a cancel)
    num_prompt_tokens: int = 0
    num_unread_tokens: int = 0
    num_generated_tokens: int = 0
    num_loans_taken: int = 0
    num_loans_skipped: int = 0
    num_loans_failed: int = 0
    released_bytes: int = 0
    restored_bytes: int = 0
    streamed_bytes: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    last_prefill_tokens_per_s: float = 0.0
    last_decode_tokens_per_s: float = 0.0
    spec_rounds: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    # [place in a step's draft run] drafts verified and taken there
    spec_drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    spec_accepted_by_position: list[int] = dataclasses.field(default_factory=list)

    def record(self, stats: RequestStats) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += stats.prompt_tokens
        self.num_unread_tokens += stats.unread_tokens
        self.num_generated_tokens += stats.generated_tokens
        self._record_loan(stats.loan, is_failed=False)
        self.streamed_bytes += stats.streamed_bytes
        self.cache_hits += stats.cache_hits
        self.cache_misses += stats.cache_misses
        self.prefill_seconds += stats.prefill_seconds
        self.decode_seconds += stats.decode_seconds
        if not stats.is_prefill_cut:
            self.num_completed_prefills += 1
            self.last_prefill_tokens_per_s = stats.prefill_tokens_per_s
            self.last_decode_tokens_per_s = stats.decode_tokens_per_s
        self.spec_rounds += stats.spec_rounds
        self.spec_drafted += stats.spec_drafted
        self.spec_accepted += stats.spec_accepted
        for totals, counts in ((self.spec_drafted_by_position, stats.spec_drafted_by_position),
                               (self.spec_accepted_by_position, stats.spec_accepted_by_position)):
            totals += [0] * (len(counts) - len(totals))
            for place, count in enumerate(counts):
                totals[place] += count

    def record_failure(self, loan, is_restored: bool) -> None:
        """A request that raised; ``is_restored`` is false when the loan could not put things back."""
        self.num_requests += 1
        self.num_failed_requests += 1
        self._record_loan(loan, is_failed=True, is_restored=is_restored)

    def _record_loan(self, loan, is_failed: bool, is_restored: bool = True) -> None:
        if loan is None:
            return
        if not loan.is_taken:
            self.num_loans_skipped += 1
            return
        self.num_loans_taken += 1
        self.num_loans_failed += int(is_failed)
        self.released_bytes += loan.released_bytes
        if is_restored:  # the transaction restores all it released, or raises LoanRestoreError
            self.restored_bytes += loan.released_bytes
