"""Speculative decode with the model's MTP block: draft ``d`` tokens, verify them in one forward.

One step, with ``token`` the newest token (not yet in the KV cache) at position p:

    drafts = mtp.draft(...)                          # d tokens, one MTP step each
    rows = forward([token, *drafts], p)              # [d + 1, D], one batched forward; KV at p..p+d
    targets = pick(logits(rows))                     # what the model itself says after each row
    n = the longest prefix of drafts equal to targets (greedy), or taken by
        min(1, p/q) (sampled; the first refusal resamples from max(0, p - q))
    emit drafts[:n] and then targets[n]              # n + 1 tokens for one verify step

The KV cells p..p+n hold the verified tokens; the cells after them hold rejected drafts, and the
next step writes them again before anything reads them (attention stops at a row's own
position), so rolling back is moving p. A forward of up to ``DECODE_MAX_ROWS`` rows computes each
row as a one-token forward would, so greedy output equals plain greedy decode token for token.

The next step's drafting starts from the verified rows: they go through the MTP block together
(writing its cache at p..p+n with the main model's states), and the last one drafts.
Depth 0 (the policy found drafting slower than it saves) is a plain one-token step.

On the device (greedy, captured decode) the comparison is made there too, and the step after a
step of the same depth is launched before the host reads that one (``launch_chained``): the host
reads, streams and launches while the device runs the step before, one step behind it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np

from strata.engine.decode.depth_policy import DepthPolicy
from strata.engine.decode.mtp import MtpDraft
from strata.engine.sampling import SamplingParams, distribution, draw, sample
from strata.engine.stream_stats import StreamStats

PLAIN_RUN_TOKENS = 16  # the fewest plain steps on the device between two looks at the depth policy
# the fewest of a run that times plain decode first (the policy's first look): its first step is not timed
FIRST_RUN_TOKENS = 4


class _Launched(NamedTuple):
    """A device step launched and not read yet."""

    depth: int
    started: float  # perf_counter at its launch


class DraftOracle(Protocol):
    """A measurement aid of the bench: the token to verify instead of the one the MTP block proposed.
    Its ``continuation`` (the plain greedy tokens from ``first_position`` on) is recorded by the
    request itself when None."""

    continuation: list[int] | None
    first_position: int

    def replace(self, position: int, proposed: int) -> int: ...

    def window(self, first: int, size: int) -> list[int]: ...


class _PlainDecode:
    """A depth policy that never drafts: plain decode through the speculation's steps."""

    is_fixed = False

    def depth(self, limit: int) -> int:
        return 0

    def is_timed(self, depth: int) -> bool:
        return True  # nothing to time

    def plain_steps(self) -> int:
        return sys.maxsize

    def record(self, depth: int, seconds: float, num_accepted: int) -> None:
        pass


PLAIN_DECODE = _PlainDecode()


class Speculation:
    """One request's speculative decode after its first token (``tokens``)."""

    def __init__(self, runner, draft: MtpDraft, policy: DepthPolicy, logits_of: Callable[[Any], np.ndarray],
                 params: SamplingParams, rng: np.random.Generator, stats: StreamStats,
                 oracle: DraftOracle | None = None, device: tuple | None = None,
                 on_pick: Callable[[np.ndarray, int], None] | None = None):
        """logits_of(hidden [R, D]) -> host [R, V] logits with the engine's bias added. device: for a
        greedy request on captured decode, (``DeviceSpeculation``, head, the logit bias on the host: ids
        [n] int32 and values [n] float32): drafts and picks stay on the device (``device_speculation.py``),
        and a run of plain steps is captured greedy decode's, each step queued ahead of the host. on_pick(logits
        [V], token): told of every emitted token of a host step and the target logits it was taken
        under, in order (a step may emit more than the request takes)."""
        self.runner = runner
        self.draft = draft
        self.policy = policy
        self.logits_of = logits_of
        self.params = params
        self.rng = rng
        self.stats = stats
        self.oracle = oracle
        self.device = device
        self.on_pick = on_pick
        self._decided: int | None = None  # the policy's depth for the next step, asked before it was launched

    def tokens(self, token: int, hidden_row, position: int, num_steps: int, kv_tokens: list[int]) -> Iterator[int]:
        """Up to ``num_steps`` tokens after ``token`` (at ``position``; ``hidden_row`` [1, D] on the
        backend: the main model's state at position - 1). Appends each verified token to ``kv_tokens``.

        On the device, where a verify step needs the host only at its start (``launch_ahead``), the next
        step is launched before a step is read: chained (``launch_chained``: it reads what this step's
        acceptance wrote on the device) where it keeps this step's depth, cannot run past the request and the
        policy agrees (a depth it is still timing waits for this step's record), else launched from the host
        once this step is read, before its tokens are yielded.
        So neither the host's reading nor the caller's work between tokens is the device's idle time, and
        the policy times a step without the caller's. A caller that stops early leaves the KV cells of the
        steps in flight written past the tokens it keeps, as a greedy step running ahead does
        (``DecodeStep.greedy_tokens``)."""
        rows, next_tokens, start = hidden_row, [token], position - 1  # what the MTP block reads next
        num_left, depth = num_steps, None
        in_flight: collections.deque[_Launched] = collections.deque()  # device steps launched, not read yet
        caller_seconds, last_read = 0.0, 0.0  # the caller's time since the last read; when that read ended
        error = None  # the error raised here
        try:
            while num_left > 0:
                depth = self.policy.depth(num_left - 1) if depth is None else depth
                if depth == 0 and self.device is not None:
                    # until the policy would look again; to the request's end, where it would not before it
                    floor = PLAIN_RUN_TOKENS if self.policy.is_timed(0) else FIRST_RUN_TOKENS
                    num_tokens = min(num_left, max(floor, self.policy.plain_steps()))
                    is_last = num_tokens == num_left
                    launch_next = functools.partial(self._launch_after_run, in_flight, position + num_tokens - 1,
                                                    num_left - num_tokens)
                    _, token, depth = yield from self._device_plain_run(token, position, num_tokens, is_last,
                                                                        kv_tokens, launch_next)
                    if is_last:  # nothing drafts after it
                        return
                    last_read = time.perf_counter()  # the run's verify step was read
                    rows = None  # the run's last verify step's: where the next draft reads them
                    position, num_left = position + num_tokens, num_left - num_tokens
                    next_tokens, start = [token], position - 1
                    if not in_flight and depth and self.device[0].launch_ahead(depth):  # while the caller takes it
                        _launch_into(in_flight, self._launch, token, position, depth, rows, next_tokens, start)
                    yielded = time.perf_counter()
                    yield token
                    caller_seconds = time.perf_counter() - yielded if in_flight else 0.0
                    continue
                if self.device is None:
                    started = time.perf_counter()
                    rows, emitted, num_accepted = self._host_step(token, position, depth, rows, next_tokens, start)
                else:
                    if not in_flight:
                        _launch_into(in_flight, self._launch, token, position, depth, rows, next_tokens, start)
                    step = in_flight[0]
                    if len(in_flight) == 1 and self._is_chained_next(step.depth, num_left):
                        _launch_into(in_flight, self._launch_chained, step.depth, position)
                    num_accepted, emitted = self._read(in_flight.popleft(), position)
                    started = max(step.started, last_read) + caller_seconds
                # [n + 1, D] the verified rows; on the device None: they are where the next draft reads them
                rows = None if self.device is not None else rows[:num_accepted + 1]
                last_read = time.perf_counter()
                self.policy.record(depth, last_read - started, num_accepted)
                if depth:
                    self.stats.record_round(depth, num_accepted)
                self.stats.spec_depth = depth
                verified = [token, *emitted[:-1]]  # positions position..position + len - 1
                kv_tokens.extend(verified)
                # the rows end at the newest verified position; each is followed by the next emitted token
                next_tokens, start = emitted[-(num_accepted + 1):], position + len(verified) - num_accepted - 1
                position += len(verified)
                token = emitted[-1]
                num_taken, num_left = min(len(emitted), num_left), num_left - len(emitted)
                depth, self._decided = self._decided, None  # a depth the policy gave for a step not chained
                if in_flight:
                    depth = in_flight[0].depth
                elif self.device is not None and num_left > 0:
                    depth = self.policy.depth(num_left - 1) if depth is None else depth
                    if depth and self.device[0].launch_ahead(depth):  # runs while the caller takes these tokens
                        _launch_into(in_flight, self._launch, token, position, depth, rows, next_tokens, start)
                yielded = time.perf_counter()
                yield from emitted[:num_taken]
                caller_seconds = time.perf_counter() - yielded if in_flight else 0.0
        except Exception as exc:
            error = exc
            raise
        finally:
            if in_flight:  # what was launched finishes before the request's buffers go
                if error is None:  # the caller stopped early: a device error is this request's
                    self.runner.ops.synchronize()
                else:  # the error raised here is the one to see
                    with contextlib.suppress(Exception):
                        self.runner.ops.synchronize()

    def _is_chained_next(self, depth: int, num_left: int) -> bool:
        """Whether the step after one of ``depth`` drafts now in flight is launched before it is read, chained
        on the device: it drafts as deep, runs without the host between its layers, and is needed and inside
        the request whatever the step before takes (it emits at most d + 1 of the ``num_left`` tokens). The
        policy answers for it one step early, from the records before the step in flight; where its answer
        is another depth, that step is launched from the host and takes the answer (``_decided``). A depth the
        policy is still timing is not chained: its next step waits for this one's record (drafts the model
        refuses cost two steps, not three)."""
        if not depth or num_left < 2 * (depth + 1) or not self.device[0].launch_ahead(depth):
            return False
        if not self.policy.is_fixed and not self.policy.is_timed(depth):
            return False
        decided = self.policy.depth(num_left - depth - 2)  # the fewest tokens left after the step in flight, less one
        if decided != depth:
            self._decided = decided
        return decided == depth

    def _device_plain_run(self, token: int, position: int, num_tokens: int, is_last: bool, kv_tokens: list[int],
                          launch_next: Callable[[], int | None]):
        """Yields the first ``num_tokens`` - 1 of ``num_tokens`` plain greedy tokens after ``token`` picked on
        the device (all of them where ``is_last``: the request ends with these tokens), each step queued one
        ahead of the host (``ModelRunner.greedy_tokens``) but the last, a one-row verify step whose hidden
        row [1, D] the next drafting starts from; returns (that row, None where it is on the device or
        ``is_last``; the last token, not yielded; the depth ``launch_next`` decided, or None).

        Where a step runs without the host between its layers, that verify step is queued behind the last
        greedy one, on the token it picked on the device, and ``launch_next`` (the policy's next depth, that
        step maybe chained behind it) is called before it is read: the device does not wait for the host to
        read and launch between a run and the step after it. Appends each token whose KV cell a step wrote to
        ``kv_tokens``, and records the steps taken in the policy, also where the caller closes the run: the
        host's time in them, not the caller's between tokens (the greedy steps at their average, before
        ``launch_next`` asks the policy: of three or more, the first not timed, as it waits for the run's first
        launches and a request's first may pay once-only work; the verify step at its own, which has the host's
        launch of the step after it, as a step a chained one follows has)."""
        device, head, bias = self.device
        self.stats.spec_depth = 0
        num_queued = num_tokens if is_last else num_tokens - 1
        is_verify_queued = not is_last and num_queued > 0 and device.launch_ahead(0)
        then = (lambda: device.launch_after_greedy(head, bias, self.stats)) if is_verify_queued else None
        steps = self.runner.greedy_tokens(token, position, num_queued, head, bias, self.stats, then=then) \
            if num_queued else None
        seconds, num_done, num_recorded, depth, is_verify_read = 0.0, 0, 0, None, False
        first_seconds = 0.0  # the first greedy step's (None once the greedy steps are recorded)
        try:
            started = time.perf_counter()
            for picked in steps or ():
                seconds += time.perf_counter() - started
                if not num_done:
                    first_seconds = seconds
                kv_tokens.append(token)
                token, num_done = picked, num_done + 1
                yield picked
                started = time.perf_counter()
            if is_last:
                seconds += time.perf_counter() - started
                return None, token, None
            if is_verify_queued:
                self._record_plain(num_done, seconds, first_seconds)
                seconds, first_seconds, num_recorded = 0.0, None, num_done
                depth = launch_next()
                rows, (_, targets) = None, device.read_verify(0, self.stats, position + num_queued)
                is_verify_read = True
            else:
                rows, _, targets = device.verify(token, position + num_queued, 0, head, bias, self.stats)
            seconds += time.perf_counter() - started
            kv_tokens.append(token)
            token, num_done = targets[0], num_done + 1
            return rows, token, depth
        finally:
            if steps is not None:
                steps.close()
            if is_verify_queued and not is_verify_read:  # the caller stopped early, or a launch failed
                if isinstance(sys.exc_info()[1], Exception):  # the error raised here is the one to see
                    with contextlib.suppress(Exception):
                        self.runner.ops.synchronize()
                else:  # what was queued finishes before the request's buffers go
                    self.runner.ops.synchronize()
            self._record_plain(num_done - num_recorded, seconds, first_seconds)

    def _record_plain(self, num_steps: int, seconds: float, first_seconds: float | None) -> None:
        """``num_steps`` plain steps that took ``seconds`` in all, each recorded at their average; of three or
        more, without the first's ``first_seconds`` (None: the first is timed too)."""
        if num_steps >= 3 and first_seconds is not None:
            seconds, num_timed = seconds - first_seconds, num_steps - 1
        else:
            num_timed = num_steps
        for _ in range(num_steps):
            self.policy.record(0, seconds / num_timed, 0)

    def _launch_after_run(self, in_flight: collections.deque, position: int, num_after: int) -> int:
        """The depth of the step after a plain run whose verify step (at ``position``) is queued and not read,
        ``num_after`` tokens left after the run; that step chained behind it on the device where it can be."""
        depth = self.policy.depth(num_after - 1)
        if depth and self.device[0].can_chain(depth):
            _launch_into(in_flight, self._launch_chained, depth, position)
        return depth

    def _host_step(self, token: int, position: int, depth: int, rows, next_tokens: list[int], start: int):
        """(rows [n + 1, D] verified or not, tokens to emit, drafts taken), logits read on the host."""
        if depth == 0:
            rows = self.runner.forward(np.array([token]), position, None, self.stats)  # [1, D]
            logits = self.logits_of(rows)  # [1, V]
            emitted, num_accepted = [self._pick(logits[0])], 0
        else:
            q_probs: list[np.ndarray] = []
            drafts = self.draft.draft(rows, np.array(next_tokens), start, depth,
                                      lambda j, logits: self._propose(j, logits, position, q_probs), self.stats)
            rows = self.runner.forward(np.array([token, *drafts]), position, None, self.stats)  # [d + 1, D]
            logits = self.logits_of(rows)  # [d + 1, V]
            emitted, num_accepted = self._verify(drafts, logits, q_probs)
        if self.on_pick is not None:  # emitted[i] was taken under the target's logits after row i
            for row_logits, picked in zip(logits, emitted):
                self.on_pick(row_logits, picked)
        return rows, emitted, num_accepted

    def _launch(self, token: int, position: int, depth: int, rows, next_tokens: list[int], start: int) -> _Launched:
        """A device step's draft and verify launched from the host's inputs, the host not waiting; ``_read``
        reads it. rows: as ``DeviceSpeculation.draft`` takes them (None: the last verify step's)."""
        device, head, bias = self.device
        started = time.perf_counter()
        if depth:
            device.draft(rows, next_tokens, start, depth, self.oracle)
            self.stats.spec_draft_steps += depth
        device.launch_verify(token, position, depth, head, bias, self.stats)
        self.stats.spec_launch_seconds += time.perf_counter() - started
        return _Launched(depth, started)

    def _launch_chained(self, depth: int, position: int) -> _Launched:
        """The step after the one in flight (at ``position``), launched chained on the device."""
        device, head, bias = self.device
        started = time.perf_counter()
        device.launch_chained(depth, position, head, bias, self.stats, self.oracle)
        self.stats.spec_draft_steps += depth
        self.stats.spec_launch_seconds += time.perf_counter() - started
        return _Launched(depth, started)

    def _read(self, step: _Launched, position: int) -> tuple[int, list[int]]:
        """(drafts taken n, the n + 1 tokens to emit) of the oldest device step not read yet (at ``position``):
        drafts and picks compared on the device, d + 2 ids read back."""
        num_accepted, targets = self.device[0].read_verify(step.depth, self.stats, position)
        return num_accepted, targets[:num_accepted + 1]

    def _pick(self, logits: np.ndarray) -> int:
        return sample(logits, self.params, self.rng)

    def _propose(self, place: int, logits: np.ndarray, position: int, q_probs: list[np.ndarray]) -> int:
        """The draft at ``place`` (verified at position + place + 1) from the MTP block's logits [V]."""
        if self.params.is_greedy:
            proposed = sample(logits, self.params, self.rng)
        else:
            q_probs.append(distribution(logits, self.params))
            proposed = draw(q_probs[-1], self.rng)
        if self.oracle is not None:
            proposed = self.oracle.replace(position + place + 1, proposed)
            if q_probs and q_probs[-1][proposed] <= 0:  # the oracle's token, proposed with certainty
                q_probs[-1] = np.zeros_like(q_probs[-1])
                q_probs[-1][proposed] = 1.0
        return proposed

    def _verify(self, drafts: list[int], logits: np.ndarray, q_probs: list[np.ndarray]) -> tuple[list[int], int]:
        """(tokens to emit, drafts taken) from the target's logits [d + 1, V] after each verified row."""
        if self.params.is_greedy:
            for place, proposed in enumerate(drafts):
                target = self._pick(logits[place])
                if target != proposed:
                    return [*drafts[:place], target], place
            return [*drafts, self._pick(logits[len(drafts)])], len(drafts)
        for place, proposed in enumerate(drafts):
            p, q = distribution(logits[place], self.params), q_probs[place]
            if self.rng.random() * q[proposed] < p[proposed]:  # taken with probability min(1, p/q)
                continue
            residual = np.maximum(p - q, 0.0)
            return [*drafts[:place], draw(residual if residual.sum() > 0 else p, self.rng)], place
        return [*drafts, draw(distribution(logits[len(drafts)], self.params), self.rng)], len(drafts)


def _launch_into(in_flight: collections.deque, launch: Callable[..., _Launched], *args) -> None:
    """Append ``launch(*args)``'s step to ``in_flight``, its place held while it launches: a launch that fails
    halfway has queued work that the request's end must wait for before its buffers go."""
    in_flight.append(None)
    in_flight[-1] = launch(*args)
