"""OpenAI response bodies: whole completions and streamed chunks, for both routes."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from strata.serve.schemas import Kind

LOWEST_LOGPROB = -9999.0  # a token of probability 0 (a banned one): JSON has no -Infinity

# the engine's "cancelled" only ever reaches a client that has gone; report it as a cut-off
_FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "length"}


def usage(stats: Any) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def timings(stats: Any) -> dict[str, float]:
    """The request's speed under llama-server's names: prompt_* for the prefilled (not reused)
    prompt tokens, predicted_* for the generated ones, cache_n for the prompt tokens reused."""
    prompt_ms, predicted_ms = 1e3 * stats.prefill_seconds, 1e3 * stats.decode_seconds
    return {"cache_n": stats.prompt_tokens - stats.unread_tokens, **_rates("prompt", stats.unread_tokens, prompt_ms),
            **_rates("predicted", stats.generated_tokens, predicted_ms)}


def engine_report(stats: Any) -> dict[str, Any]:
    """What the engine did beyond llama-server's timings: the prefill plan, the loan (its retries and
    the host milliseconds of each of its phases), the timing line's rates (decode's over its steps:
    the first token comes from prefill) and the kernels compiled inside the request."""
    geometry, loan = stats.geometry, stats.loan
    return {"plan": {"chunk_tokens": geometry.chunk_tokens, "ring_slots": geometry.ring_slots} if geometry else None,
            "num_chunks": stats.num_chunks,
            "loan": {"is_taken": loan.is_taken, "reason": loan.reason, "retries": loan.num_retries,
                     "released": list(loan.released),
                     "phase_ms": {phase: round(1e3 * seconds, 3) for phase, seconds in loan.phase_seconds}}
            if loan else None,
            "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 3),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3),
            "compiles": {"count": stats.num_compiles, "seconds": round(stats.compile_seconds, 3)}}


def _rates(prefix: str, num_tokens: int, milliseconds: float) -> dict[str, float]:
    return {f"{prefix}_n": num_tokens, f"{prefix}_ms": round(milliseconds, 3),
            f"{prefix}_per_token_ms": round(milliseconds / num_tokens, 3) if num_tokens else 0.0,
            f"{prefix}_per_second": round(1e3 * num_tokens / milliseconds, 3) if milliseconds > 0 else 0.0}


def finish_reason(stats: Any) -> str:
    return _FINISH_REASONS.get(stats.finish_reason, "stop")


class ResponseShapes:
    """The bodies of one request: same id, model and creation time in every chunk.

    token_text(id) -> (text, bytes) names a token in log-probability entries; None where the request did
    not ask for them (every ``logprobs`` is then null). A pick is (token id, ``TokenLogprobs``, text offset):
    where the token's text starts in the choice's text, which is the length of the text sent before its
    event (a token whose bytes end inside a character is counted where that character will appear)."""

    def __init__(self, kind: Kind, request_id: str, model: str, is_usage_streamed: bool = False,
                 token_text: Callable[[int], tuple[str, bytes]] | None = None):
        self.kind = kind
        self.is_usage_streamed = is_usage_streamed
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self._token_text = token_text

    def complete(self, text: str, stats: Any, picks: Sequence[tuple[int, Any, int]] = ()) -> dict[str, Any]:
        logprobs = self._logprobs(picks)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish_reason(stats)}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(stats)}
        return {**self._head("chat.completion" if self.kind == "chat" else "text_completion"),
                "choices": [choice], "usage": usage(stats), "timings": timings(stats), "strata": engine_report(stats)}

    def opening_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role; completion streams have no opening."""
        if self.kind != "chat":
            return None
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def text_chunk(self, text: str, picks: Sequence[tuple[int, Any, int]] = ()) -> dict[str, Any]:
        """A streamed piece of text, with the log-probabilities of the tokens picked since the last chunk."""
        logprobs = self._logprobs(picks)
        if self.kind == "chat":
            return self._chunk({"delta": {"content": text}, "logprobs": logprobs, "finish_reason": None})
        return self._chunk({"text": text, "logprobs": logprobs, "finish_reason": None})

    def final_chunk(self, stats: Any, picks: Sequence[tuple[int, Any, int]] = ()) -> dict[str, Any]:
        """The chunk with the finish reason, the log-probabilities of tokens no text chunk carried (their text
        held back, then cut by a stop string), the request's timings as llama-server sends them, and the
        engine's report."""
        logprobs = self._logprobs(picks) if picks else None
        if self.kind == "chat":
            chunk = self._chunk({"delta": {}, "logprobs": logprobs, "finish_reason": finish_reason(stats)})
        else:
            chunk = self._chunk({"text": "", "logprobs": logprobs, "finish_reason": finish_reason(stats)})
        return {**chunk, "timings": timings(stats), "strata": engine_report(stats)}

    def usage_chunk(self, stats: Any) -> dict[str, Any]:
        return {**self._head(self._chunk_object), "choices": [], "usage": usage(stats)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _logprobs(self, picks: Sequence[tuple[int, Any, int]]) -> dict[str, Any] | None:
        """The OpenAI shape of the picks' log-probabilities: chat's ``content`` entries, or the legacy
        completion lists (``top_logprobs`` maps each alternative's text to its log-probability, the picked
        token's included, as the legacy API does; of two tokens with one text, the likelier is kept)."""
        if self._token_text is None:
            return None
        if self.kind == "chat":
            return {"content": [{**self._entry(token, logprobs.logprob),
                                 "top_logprobs": [self._entry(i, value) for i, value in logprobs.top]}
                                for token, logprobs, _ in picks], "refusal": None}
        tops = []
        for token, logprobs, _ in picks:
            top: dict[str, float] = {}
            for i, value in logprobs.top:  # most likely first
                top.setdefault(self._token_text(i)[0], _finite(value))
            if logprobs.top:
                top.setdefault(self._token_text(token)[0], _finite(logprobs.logprob))
            tops.append(top)
        return {"tokens": [self._token_text(token)[0] for token, _, _ in picks],
                "token_logprobs": [_finite(logprobs.logprob) for _, logprobs, _ in picks],
                "top_logprobs": tops, "text_offset": [offset for _, _, offset in picks]}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text, piece = self._token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(piece)}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._head(self._chunk_object), "choices": [{"index": 0, "logprobs": None, **choice}]}
        if self.is_usage_streamed:  # the OpenAI API's rule: null in every chunk but the last
            chunk["usage"] = None
        return chunk

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}


class PickLog:
    """The picks of a stream of token events, each with where its text starts in the choice's text (which
    begins ``text_offset`` characters in: an echoed prompt); ``take`` hands over those gathered so far."""

    def __init__(self, text_offset: int = 0):
        self._picks: list[tuple[int, Any, int]] = []
        self._text_offset = text_offset

    def add(self, event: Any) -> None:
        if event.logprobs is not None:
            self._picks.append((event.token_id, event.logprobs, self._text_offset))
        self._text_offset += len(event.text)

    def take(self) -> list[tuple[int, Any, int]]:
        picks, self._picks = self._picks, []
        return picks


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry: LOWEST_LOGPROB for probability 0 (and for NaN, which only logits
    made infinite by an engine-wide bias could give)."""
    return max(logprob, LOWEST_LOGPROB) if math.isfinite(logprob) else LOWEST_LOGPROB
