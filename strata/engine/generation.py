"""One request, one way: reuse the KV prefix → the loan lends memory and yields the geometry →
prefill the unread tokens in it → the loan restores → decode token by token."""

from __future__ import annotations

import collections
import itertools
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import numpy as np

from strata.engine.collector import CollectorTally
from strata.engine.core import EngineCore
from strata.engine.decode.speculative import PLAIN_DECODE, DraftOracle, Speculation
from strata.engine.planning.rates import ChunkTiming
from strata.engine.prefill_timeline import PrefillTimeline
from strata.engine.request import RequestStats, TokenEvent
from strata.engine.sampling import (
    SamplingParams,
    StopMatcher,
    check_bias_ids,
    check_finite_logits,
    make_rng,
    sample,
    token_logprobs,
)
from strata.engine.stream_stats import StreamStats
from strata.errors import LoanRestoreError, PrefillCancelled, RequestError
from strata.gpu.ledger import ACTIVATIONS_OWNER
from strata.hooktypes import Geometry

log = logging.getLogger("strata.engine")
FLUSH_TOKEN_ID = -1  # a TokenEvent with this id carries text released at the end of the stream


class Generation:
    """Iterate for TokenEvents; ``stats`` is set once the iteration ends (also when it is closed early)."""

    def __init__(self, engine: EngineCore, prompt: list[int], params: SamplingParams, is_cancelled: Callable[[], bool],
                 draft_oracle: DraftOracle | None = None, is_timing_layers: bool = False):
        """draft_oracle: the bench's measurement aid (``strata bench --draft-oracle``); never from serving.
        is_timing_layers: mark every prefill layer on the device (``prefill_timeline.py``; the bench's
        ``--layer-timeline``)."""
        _check_prompt(prompt, engine.context_tokens, engine.spec.vocab_size)
        self.engine = engine
        self.prompt = prompt
        self.params = params
        self.is_cancelled = is_cancelled
        self.draft_oracle = draft_oracle
        self.is_timing_layers = is_timing_layers
        self.stats: RequestStats | None = None
        self._prefill_device = (0.0, 0.0)  # the chunks' forward and the MTP block's passes, device seconds
        self._prefill_streamed_bytes = 0
        self._prefilled_tokens = 0  # of the unread ones, in the chunks that ran
        self._restaged_bytes = 0
        self._compiled_before = None  # the engine's compile tally when the request starts (``_run``)
        self._collected_before = CollectorTally()  # and its collector's
        self._prefill_collected = CollectorTally()
        # each picked token's log-probabilities, in the order the tokens are picked (None: not asked for)
        self._picked = collections.deque() if params.num_logprobs is not None else None
        self._events = self._run()

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events

    def close(self) -> None:
        """End the request now (as when its iteration is abandoned): its cleanup runs here, not
        whenever the garbage collector finds it."""
        self._events.close()

    def _run(self) -> Iterator[TokenEvent]:
        engine, prompt, params = self.engine, self.prompt, self.params
        self._take_engine()
        reuse = self._reuse_prefix()
        unread = np.asarray(prompt[reuse:], dtype=np.int64)
        stream = StreamStats(timeline=PrefillTimeline(engine.ops) if self.is_timing_layers else None)
        self._compiled_before = engine.compiles.tally
        self._collected_before = engine.collector.tally
        started = time.perf_counter()
        try:
            with engine.loan.lend(len(prompt), len(unread)) as geometry:
                hidden = self._prefill(unread, reuse, geometry, stream)
            report = engine.loan.last_report
            logits = self._logits(hidden)  # after the loan: the output head is back
        except PrefillCancelled:  # the loan has restored; the cells past the reused prefix are not kept
            self._prefill_streamed_bytes = stream.streamed_bytes
            self._restaged_bytes = engine.state.restaged_bytes
            self._finish(engine.loan.last_report, self._prefilled_tokens, 0, "cancelled",
                         time.perf_counter() - started, 0.0, stream, is_prefill_cut=True)
            self._release(is_failing=False)
            return
        except BaseException as exc:
            engine.counters.record_failure(engine.loan.last_report, not isinstance(exc, LoanRestoreError))
            engine.current_generation = None
            raise
        self._restaged_bytes = engine.state.restaged_bytes  # the cache's residency, put back for decode
        engine.kv_tokens = list(prompt)
        prefill_seconds = time.perf_counter() - started
        self._prefill_collected = engine.collector.tally.since(self._collected_before)
        self._prefill_streamed_bytes = stream.streamed_bytes
        # log-probabilities need each token's logits on the host
        is_on_device = params.is_greedy and engine.config.runtime.greedy_on_device and \
            engine.runner.can_pick_greedy_on_device and self._picked is None
        if self.draft_oracle is not None and self.draft_oracle.continuation is None:
            try:
                self._record_continuation(logits, hidden, is_on_device)
            except BaseException:
                self._release(is_failing=True)
                raise
        generated, finish, is_stop_string, decode_started = 0, "length", False, time.perf_counter()
        decoder, stop, rng = engine.tokenizer.stream_decoder(), StopMatcher(params.stop), make_rng(params.seed)
        if engine.mtp is not None:
            tokens = self._speculative_tokens(logits, hidden, rng, stream, is_on_device, oracle=self.draft_oracle)
        else:
            tokens = (self._device_tokens if is_on_device else self._host_tokens)(logits, rng, stream)
        logits = hidden = None  # hidden: the last token's [1, D] host row
        try:
            for token in tokens:
                logprobs = self._picked.popleft() if self._picked is not None else None
                if engine.tokenizer.is_eog(token):
                    finish = "stop"
                    break
                generated += 1
                text, is_stop_string = stop.feed(decoder.feed(token))
                yield TokenEvent(token, text, logprobs)
                if is_stop_string:
                    finish = "stop"
                    break
                # the newest token is not in the KV cache yet (speculation may have verified more)
                if generated >= params.max_tokens or len(self.prompt) + generated - 1 >= engine.context_tokens:
                    break
                if self.is_cancelled():
                    finish = "cancelled"
                    break
            if not is_stop_string:
                tail, is_stop_string = stop.feed(decoder.flush())
                tail += "" if is_stop_string else stop.flush()
                if tail:
                    yield TokenEvent(FLUSH_TOKEN_ID, tail)
        except GeneratorExit:
            finish = "cancelled"
            raise
        finally:
            try:
                tokens.close()  # its hidden state and logits return to the allocator's cache, which is trimmed
                if sys.exc_info()[0] is None:  # a readback after a device error would hide that error
                    engine.runner.count_decode_reads(stream)  # before the timing line: one readback a request
            finally:
                decode_seconds = time.perf_counter() - decode_started
                self._finish(report, len(unread), generated, finish, prefill_seconds, decode_seconds, stream)
                self._release(is_failing=sys.exc_info()[0] is not None)

    def _take_engine(self) -> None:
        """One request at a time: an unfinished one ends here ("cancelled"), and what it left goes."""
        engine = self.engine
        previous = engine.current_generation
        if previous is not None and previous is not self:
            previous.close()
        engine.current_generation = self
        engine.runner.end_request()  # segments of a request whose iteration was abandoned
        engine.ops.trim_memory()  # what a failed request left for reuse must not shrink the plan

    def _reuse_prefix(self) -> int:
        """Keep the KV cells of the prompt's prefix that the previous request left; returns their count.

        A request with a seed keeps none. Its sampler starts from the seed whatever the cache holds,
        but the logits it draws from do not: a prefix computed by an earlier request (in chunks of
        other lengths, or a token at a time in decode) leaves KV values that differ in their last
        bits, and a draw near the boundary between two tokens follows them. Prefilled from the
        start, the same request meets the same numbers every time."""
        engine = self.engine
        reuse = 0 if self.params.seed is not None else _common_prefix(engine.kv_tokens, self.prompt)
        engine.kv_tokens = self.prompt[:reuse]
        return reuse

    def _host_tokens(self, logits: np.ndarray, rng: np.random.Generator, stream: StreamStats) -> Iterator[int]:
        """Each token sampled on the host from the logits of the one before; the next token is
        computed only when the caller asks for it."""
        engine = self.engine
        while True:
            token = sample(logits, self.params, rng)
            self._note_pick(logits, token)
            yield token
            hidden = engine.runner.forward(np.array([token]), len(engine.kv_tokens), None, stream)
            engine.kv_tokens.append(token)
            logits = self._logits(hidden)

    def _device_tokens(self, logits: np.ndarray, rng: np.random.Generator, stream: StreamStats) -> Iterator[int]:
        """Greedy: the first token from the prefill's logits, the rest picked on the device with the
        same bias (``ModelRunner.greedy_tokens``), never more steps than the request and the context
        allow (the device may run one step ahead of the caller)."""
        engine = self.engine
        token, position, num_steps = self._first_token(logits, rng)
        logits = None
        yield token
        steps = engine.runner.greedy_tokens(token, position, num_steps, engine.output_head(), self._host_bias(), stream)
        try:
            for next_token in steps:
                engine.kv_tokens.append(token)
                token = next_token
                yield token
        finally:
            steps.close()

    def _first_token(self, logits: np.ndarray, rng: np.random.Generator) -> tuple[int, int, int]:
        """(the first token, picked from the prefill's logits; its position; the decode steps after it
        that the request and the context allow)."""
        position = len(self.engine.kv_tokens)
        num_steps = min(self.params.max_tokens - 1, self.engine.context_tokens - position)
        token = sample(logits, self.params, rng)
        self._note_pick(logits, token)
        return token, position, num_steps

    def _note_pick(self, logits: np.ndarray, token: int) -> None:
        """Keep the log-probabilities of ``token``, picked from ``logits`` [V], where the request asked for them."""
        if self._picked is not None:
            self._picked.append(token_logprobs(logits, token, self.params.num_logprobs))

    def _record_continuation(self, logits: np.ndarray, hidden: np.ndarray, is_on_device: bool) -> None:
        """The bench's draft oracle: plain greedy decode of this request, from its own prefill (a
        prefill in other chunks may pick other tokens where two logits nearly tie), before the timed
        decode; the KV cells it wrote are written again by the timed decode before they are read."""
        engine = self.engine
        steps = self._speculative_tokens(logits, hidden, make_rng(None), StreamStats(), is_on_device,
                                         policy=PLAIN_DECODE)
        continuation = list(itertools.islice(steps, self.params.max_tokens))
        steps.close()
        self.draft_oracle.continuation = continuation
        self.draft_oracle.first_position = len(self.prompt)
        engine.kv_tokens = list(self.prompt)
        if self._picked is not None:  # the timed decode picks these tokens again
            self._picked.clear()

    def _speculative_tokens(self, logits: np.ndarray, hidden: np.ndarray, rng: np.random.Generator,
                            stream: StreamStats, is_on_device: bool, policy=None,
                            oracle: DraftOracle | None = None) -> Iterator[int]:
        """The first token from the prefill's logits, the rest drafted by the MTP block and verified
        in batches (``Speculation``), on the device for a greedy request where decode is captured;
        never more steps than the request and the context allow."""
        engine, params = self.engine, self.params
        token, position, num_steps = self._first_token(logits, rng)
        logits = None
        yield token
        row = engine.ops.upload(ACTIVATIONS_OWNER, np.ascontiguousarray(hidden, dtype=np.float32))  # [1, D]
        hidden = None
        device = None
        try:
            if is_on_device and engine.runner.speculation is not None:
                device = (engine.runner.speculation, engine.output_head(), self._host_bias())
                device[0].begin_request(device[1])
            speculation = Speculation(engine.runner, engine.mtp, policy or engine.depth_policy, self._row_logits,
                                      params, rng, stream, oracle, device, self._note_pick)
            steps = speculation.tokens(token, row, position, num_steps, engine.kv_tokens)
            try:
                yield from steps
            finally:
                steps.close()
        finally:
            if device is not None:
                device[0].end_request()
            engine.ops.free(row)

    def _host_bias(self) -> tuple[np.ndarray, np.ndarray]:
        """The engine's and the request's logit bias, in order: (ids [n] int32, values [n] float32)."""
        bias = [*self.engine.state.settings.logit_bias, *self.params.logit_bias.items()]
        ids = np.array([token_id for token_id, _ in bias], dtype=np.int32)
        check_bias_ids(ids, self.engine.spec.vocab_size)  # the device adds at these ids unchecked
        return ids, np.array([value for _, value in bias], dtype=np.float32)

    def _row_logits(self, hidden) -> np.ndarray:
        """[R, V] host logits of every row of ``hidden`` [R, D] (the head read once), the engine's bias added."""
        engine = self.engine
        logits = engine.ops.logits_rows(hidden, *engine.output_head())  # [R, V]
        position = max(len(engine.kv_tokens), len(self.prompt))
        for row in logits:
            check_finite_logits(row, len(self.prompt), position)
        for token, bias in engine.state.settings.logit_bias:
            logits[:, token] += np.float32(bias)  # in float32, as the device adds it
        return logits

    def _release(self, is_failing: bool) -> None:
        """Drop the request's decode segments and trim the allocator's cache, unless a later request
        already owns the engine (this generation was abandoned and collected late). A cleanup error
        while another exception propagates is logged, so it does not hide that one."""
        engine = self.engine
        if engine.current_generation is not self:
            return
        engine.current_generation = None
        try:
            engine.runner.end_request()
            engine.ops.trim_memory()
        except Exception:
            if not is_failing:
                raise
            log.exception("cleanup after a failed request failed too")

    def _prefill(self, unread: np.ndarray, start: int, geometry: Geometry, stream: StreamStats) -> np.ndarray:
        """The unread tokens in chunks of the loan's geometry; returns the last token's hidden state
        [1, D] on the host: the chunk's activations go before the loan maps the cache back."""
        runner, ops, hidden, marks, mtp_marks = self.engine.runner, self.engine.ops, None, [], []
        # the ring overlaps its copies with the kernels when it has two halves, and prefill samples
        # nothing; the loan transaction puts decode's settings back
        is_overlapped = geometry.ring_slots >= 2
        self.engine.state.update(copy_overlap=is_overlapped, logit_bias=())
        try:
            for first in range(0, len(unread), geometry.chunk_tokens):
                chunk = unread[first:first + geometry.chunk_tokens]
                streamed, started = stream.streamed_bytes, ops.timing_mark()
                hidden = runner.forward(chunk, start + first, self.engine.workspace, stream, self.is_cancelled)
                marks.append((len(chunk), start + first, stream.streamed_bytes - streamed, started,
                              ops.timing_mark()))
                stream.num_chunks += 1
                self._prefilled_tokens += len(chunk)
                mtp = self.engine.mtp
                if mtp is not None and mtp.can_cache_prompt:  # timed only where the block runs
                    mtp_started = ops.timing_mark()
                    self._draft_cache(mtp, hidden, unread[first + 1:first + len(chunk) + 1], start + first)
                    mtp_marks.append((mtp_started, ops.timing_mark()))
        except BaseException as exc:
            # the failed forward's frames hold its activations; the loan maps the cache back into
            # their memory as it closes
            hidden = None
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            # the ring's copies and kernels may still run: finish them before the loan frees the
            # workspace and unmaps what it grew
            ops.synchronize()
        self._prefill_device = (sum(ops.seconds_between(a, b) for *_, a, b in marks),
                                sum(ops.seconds_between(a, b) for a, b in mtp_marks))
        if self._is_compiled():
            self.engine.planner.calibrate([ChunkTiming(n, first, num_bytes, ops.seconds_between(a, b), is_overlapped)
                                           for n, first, num_bytes, a, b in marks])
        return ops.to_host(hidden[hidden.shape[0] - 1:])

    def _is_compiled(self) -> bool:
        """Whether this prefill's chunks ran compiled kernels only: on the GPU without the load's
        warm-up, the first request's chunks compile theirs and do not measure the compute rate."""
        engine = self.engine
        return (engine.backend != "cuda" or engine.config.runtime.warmup
                or engine.counters.num_completed_prefills > 0)

    def _draft_cache(self, mtp, hidden, next_tokens: np.ndarray, start: int) -> None:
        """The resident MTP block's cache over a prefilled chunk's rows [T, D] whose next token is known, so that
        drafts attend over the prompt (the caller skips it while a loan holds what it reads)."""
        if len(next_tokens):
            mtp.cache_prompt(hidden[:len(next_tokens)], next_tokens, start)

    def _logits(self, hidden) -> np.ndarray:
        engine = self.engine
        logits = engine.output_logits(hidden)
        # before the bias, which may ban with -inf; the position is the next token's (the prompt's end
        # after prefill, whose KV tokens are set later)
        check_finite_logits(logits, len(self.prompt), max(len(engine.kv_tokens), len(self.prompt)))
        for token, bias in engine.state.settings.logit_bias:
            logits[token] += np.float32(bias)  # in float32, as the device adds it
        return logits

    def _finish(self, report, num_unread, generated, finish, prefill_seconds, decode_seconds, stream,
                is_prefill_cut: bool = False) -> None:
        compiled = self.engine.compiles.tally.since(self._compiled_before)
        collected = self.engine.collector.tally.since(self._collected_before)
        self.stats = RequestStats(
            prompt_tokens=len(self.prompt), unread_tokens=num_unread, generated_tokens=generated,
            geometry=report.geometry, prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
            streamed_bytes=stream.streamed_bytes + self._restaged_bytes, num_chunks=stream.num_chunks,
            cache_hits=stream.hits, cache_misses=stream.misses, loan=report, finish_reason=finish,
            is_prefill_cut=is_prefill_cut,
            prefill_streamed_bytes=self._prefill_streamed_bytes, restaged_bytes=self._restaged_bytes,
            kv_host_bytes=stream.kv_host_bytes, prefetched_experts=stream.prefetched,
            prefetched_used_experts=stream.prefetched_used, decode_wait_seconds=stream.decode_wait_seconds,
            is_speculative=self.engine.mtp is not None, spec_rounds=stream.spec_rounds,
            spec_drafted=stream.spec_drafted, spec_accepted=stream.spec_accepted, spec_depth=stream.spec_depth,
            spec_launch_seconds=stream.spec_launch_seconds,
            spec_drafted_by_position=tuple(stream.spec_drafted_by_position),
            spec_accepted_by_position=tuple(stream.spec_accepted_by_position),
            is_draft_oracle=self.draft_oracle is not None,
            num_compiles=compiled.num_compiles, compile_seconds=compiled.seconds,
            prefill_forward_seconds=self._prefill_device[0], prefill_mtp_seconds=self._prefill_device[1],
            collector=collected, prefill_collector=self._prefill_collected,
            prefill_layers=stream.timeline.summary() if stream.timeline is not None else None)
        if compiled.num_compiles and self.engine.config.runtime.warmup:
            log.warning("this request compiled %d time(s), %.2f s inside its prefill and decode: a shape the "
                        "warm-up did not reach (%s)", compiled.num_compiles, compiled.seconds,
                        "; ".join(compiled.names))
        self.engine.counters.record(self.stats)
        log.debug("%s", self.stats.timing_line())  # callers (serve, generate, bench) print the line


def _common_prefix(cached: list[int], prompt: list[int]) -> int:
    """Tokens of ``prompt`` whose KV can be reused; at least one token is always prefilled."""
    limit = min(len(cached), len(prompt) - 1)
    num = 0
    while num < limit and cached[num] == prompt[num]:
        num += 1
    return num


def _check_prompt(prompt: list[int], context_tokens: int, vocab_size: int) -> None:
    if not prompt:
        raise RequestError("the prompt is empty; send at least one token")
    if len(prompt) >= context_tokens:
        raise RequestError(f"the prompt has {len(prompt)} tokens but the context holds {context_tokens}, "
                           "and generation needs at least one more; shorten the prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
