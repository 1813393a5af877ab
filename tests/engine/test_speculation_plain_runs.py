"""Runs of plain steps on the device inside speculation (``Speculation._device_plain_run``), with
recording fakes for the runner and the device steps: how long a run goes between two looks at the
depth policy, what a run ends with, and that its tokens stream one at a time."""

import collections
import itertools
import time

import numpy as np
import pytest

from strata.engine.decode.depth_policy import DepthPolicy
from strata.engine.decode.speculative import FIRST_RUN_TOKENS, PLAIN_DECODE, PLAIN_RUN_TOKENS, Speculation
from strata.engine.sampling import SamplingParams
from strata.engine.stream_stats import StreamStats


def _next(token: int) -> int:
    return (7 * token + 3) % 101


class _Runner:
    """Greedy steps on the 'device': each token's successor is ``_next``; records every run asked for."""

    def __init__(self):
        self.runs, self.closed, self.num_picked = [], 0, 0
        self.events = []

    def greedy_tokens(self, token, position, num_steps, head, bias, stats, then=None):
        self.runs.append((token, position, num_steps))
        try:
            for step in range(num_steps):
                token = self.last_picked = _next(token)
                self.num_picked += 1
                if step + 1 == num_steps and then is not None:  # after the last launch, before its read
                    then()
                self.events.append(("pick", token))
                yield token
        finally:
            self.closed += 1


class _Device:
    """The one-row verify step that ends a run that is not the request's last: launched from the host, or
    where a step runs without the host (``is_host_free``) queued behind the run's last greedy step."""

    def __init__(self, runner=None, is_host_free: bool = False):
        self.verified, self.runner, self.is_host_free = [], runner, is_host_free
        self.queued = 0  # verify steps queued behind a greedy run, not read yet

    def launch_ahead(self, depth):
        return self.is_host_free

    def verify(self, token, position, depth, head, bias, stats):
        self.verified.append((token, position, depth))
        return np.zeros((1, 4), np.float32), [], [_next(token)]

    def launch_after_greedy(self, head, bias, stats):
        self.queued += 1
        self.runner.events.append(("queued verify",))

    def read_verify(self, depth, stats, position):
        assert depth == 0 and self.queued == 1
        self.queued -= 1
        token = self.runner.events[-1][1]  # the last greedy step's pick, which the queued step verified
        self.runner.events.append(("read verify", position))
        self.verified.append((token, position, depth))
        return 0, [_next(token)]


class _NeverDrafts:
    """A policy at depth 0 that would look again after ``plain_steps`` steps."""

    def __init__(self, plain_steps: int):
        self._plain_steps = plain_steps
        self.recorded = 0

    def depth(self, limit: int) -> int:
        return 0

    def plain_steps(self) -> int:
        return self._plain_steps

    def is_timed(self, depth) -> bool:
        return True

    def record(self, depth, seconds, num_accepted):
        self.recorded += 1


def _speculation(policy, runner, device):
    return Speculation(runner, None, policy, None, SamplingParams(temperature=0.0), None, StreamStats(),
                       device=(device, None, None))


def _expected(token: int, num_tokens: int) -> list[int]:
    out = []
    for _ in range(num_tokens):
        token = _next(token)
        out.append(token)
    return out


def _taken(stream, num_tokens: int) -> list[int]:
    """What a request takes, as ``Generation`` does: its tokens, then it closes the stream (no next() after)."""
    tokens = list(itertools.islice(stream, num_tokens))
    stream.close()
    return tokens


def test_a_run_lasts_until_the_policy_would_look_again_and_the_last_run_ends_the_request():
    runner, device, policy = _Runner(), _Device(), _NeverDrafts(plain_steps=100)
    kv_tokens = []
    tokens = _taken(_speculation(policy, runner, device).tokens(5, None, 40, 250, kv_tokens), 250)
    assert tokens == _expected(5, 250)
    # 100, 100, then the 50 the request has left: each run but the last ends with a verify step
    assert [num for _, _, num in runner.runs] == [99, 99, 50]
    assert [(position, depth) for _, position, depth in device.verified] == [(40 + 99, 0), (40 + 199, 0)]
    assert kv_tokens == [5, *tokens[:-1]]
    assert policy.recorded == 250  # every step timed, the last run's too, though the caller closed it
    assert runner.closed == 3


def test_where_a_step_runs_without_the_host_a_runs_verify_step_is_queued_behind_its_last_greedy_step():
    runner = _Runner()
    device, policy = _Device(runner, is_host_free=True), _NeverDrafts(plain_steps=100)
    kv_tokens = []
    tokens = _taken(_speculation(policy, runner, device).tokens(5, None, 40, 250, kv_tokens), 250)
    assert tokens == _expected(5, 250) and kv_tokens == [5, *tokens[:-1]]
    assert [num for _, _, num in runner.runs] == [99, 99, 50]
    assert [(position, depth) for _, position, depth in device.verified] == [(40 + 99, 0), (40 + 199, 0)]
    # queued before the run's last pick is read, read after it
    kinds = [event[0] for event in runner.events]
    assert kinds[97:101] == ["pick", "queued verify", "pick", "read verify"]
    assert kinds.count("queued verify") == kinds.count("read verify") == 2
    assert policy.recorded == 250 and runner.closed == 3


@pytest.mark.parametrize("num_taken", [99, 100])
def test_a_caller_that_stops_at_a_runs_last_greedy_token_waits_for_its_queued_verify_step(num_taken):
    runner = _Runner()
    runner.ops = _Ops()
    device, policy = _Device(runner, is_host_free=True), _NeverDrafts(plain_steps=100)
    tokens = _taken(_speculation(policy, runner, device).tokens(5, None, 40, 250, []), num_taken)
    assert tokens == _expected(5, num_taken) and policy.recorded == num_taken
    # at 99 the verify step was queued and not read; at 100 it was read, its token taken
    assert device.queued == (num_taken == 99) and runner.ops.num_synchronized == (num_taken == 99)


def test_a_caller_that_stops_inside_a_run_has_its_steps_recorded():
    runner, device, policy = _Runner(), _Device(), _NeverDrafts(plain_steps=100)
    kv_tokens = []
    tokens = _taken(_speculation(policy, runner, device).tokens(5, None, 0, 250, kv_tokens), 130)
    assert tokens == _expected(5, 130) and policy.recorded == 130 and runner.closed == 2
    assert kv_tokens == [5, *tokens[:-1]]  # the cells written for the tokens delivered


def test_runs_are_never_shorter_than_the_floor():
    runner, device = _Runner(), _Device()
    tokens = _taken(_speculation(_NeverDrafts(plain_steps=0), runner, device).tokens(9, None, 0, 40, []), 40)
    assert tokens == _expected(9, 40)
    assert [num for _, _, num in runner.runs] == [PLAIN_RUN_TOKENS - 1, PLAIN_RUN_TOKENS - 1, 40 - 2 * PLAIN_RUN_TOKENS]


class _SlowFirstRunner(_Runner):
    """A run's first greedy step takes 50 ms (the run's first launches, a request's once-only work), later ones 1."""

    def greedy_tokens(self, token, position, num_steps, head, bias, stats, then=None):
        for step, picked in enumerate(super().greedy_tokens(token, position, num_steps, head, bias, stats, then)):
            time.sleep(0.05 if step == 0 else 0.001)
            yield picked


def test_the_run_that_times_plain_decode_first_is_short_and_its_first_step_is_not_timed():
    runner, device, policy = _SlowFirstRunner(), _Device(), DepthPolicy(1)
    policy.depth = lambda limit: 0  # plain decode throughout: the runs' floors and timing alone
    _taken(_speculation(policy, runner, device).tokens(5, None, 40, 40, []), 40)
    # a first run of FIRST_RUN_TOKENS while depth 0 is untimed, then runs of PLAIN_RUN_TOKENS
    assert [num for _, _, num in runner.runs][:2] == [FIRST_RUN_TOKENS - 1, PLAIN_RUN_TOKENS - 1]
    assert policy.seconds[0] < 0.0025  # the slow first steps left out of the average (with them: ~3.5 ms)


def test_plain_decode_is_one_run_with_no_verify_step():
    runner, device = _Runner(), _Device()
    tokens = list(_speculation(PLAIN_DECODE, runner, device).tokens(3, None, 10, 300, []))
    assert tokens == _expected(3, 300) and runner.runs == [(3, 10, 300)] and device.verified == []


def test_a_run_streams_its_tokens_and_a_caller_that_stops_closes_the_device_steps():
    runner, device = _Runner(), _Device()
    stream = _speculation(PLAIN_DECODE, runner, device).tokens(3, None, 10, 300, [])
    assert next(stream) == _next(3)
    assert runner.num_picked == 1  # the first token before the run's other 299 are picked
    stream.close()
    assert runner.closed == 1 and device.verified == []


def test_plain_steps_counts_down_to_the_next_probe_only_where_plain_decode_is_best():
    policy = DepthPolicy(4, probe_every=32)
    assert policy.plain_steps() == 0  # depth 0 not timed yet
    assert policy.depth(10) == 0
    policy.record(0, 0.010, 0)
    assert policy.plain_steps() == 0 and policy.depth(10) == 0  # timed from its second step
    policy.record(0, 0.010, 0)
    assert policy.depth(10) == 1  # an untried depth that could win
    policy.record(1, 0.01312, num_accepted=0)  # drafting costs and nothing is taken
    assert policy.depth(10) == 1  # a first step's time is not yet the depth's
    policy.record(1, 0.01312, num_accepted=0)
    assert policy.depth(10) == 0
    policy.record(0, 0.010, 0)
    # the steps before the next probe, from the last step that timed depth 1: a probe loses 3.12 ms against plain
    # decode's 10 a token, and probes may lose 0.5% of the time: 62.4, so 63 steps (more than probe_every's 32)
    assert policy.plain_steps() == 63 - 2
    fast = DepthPolicy(4, probe_every=32)
    fast.record(0, 0.010, 0)
    fast.record(0, 0.010, 0)
    fast.record(1, 0.006, num_accepted=1)  # one step: depth 1 could still win, so it is tried again
    assert fast.plain_steps() == 0 and fast.depth(10) == 1
    fast.record(1, 0.006, num_accepted=1)  # drafting pays: depth 0 is only ever a probe
    assert fast.plain_steps() == 0
    assert DepthPolicy(4, is_fixed=True).plain_steps() == 0


class _DraftingDevice:
    """Draft and verify steps whose drafts are all taken (each the true successor); records the order of
    the host's calls in ``events``, which the test's consumer also writes to."""

    def __init__(self, events: list, is_launched_ahead: bool = True):
        self.events, self.is_launched_ahead = events, is_launched_ahead
        self._launched = collections.deque()  # (token, depth) of the steps not read yet
        self.drafted_from = []  # (rows given or None, next tokens)
        self.failing_launch = None  # launch_verify raises when the events number this

    def launch_ahead(self, depth):
        return self.is_launched_ahead

    def draft(self, rows, next_tokens, start, depth, oracle):
        self.events.append(("draft", start, depth))
        self.drafted_from.append((rows is not None, list(next_tokens)))

    def launch_verify(self, token, position, depth, head, bias, stats):
        if self.failing_launch == len(self.events):
            raise RuntimeError("a capture failed")
        self.events.append(("launch", token, position))
        self._launched.append((token, depth))
        return np.zeros((depth + 1, 4), np.float32)

    def can_chain(self, depth):
        return self.is_launched_ahead and depth > 0

    def launch_after_greedy(self, head, bias, stats):
        self.events.append(("queued verify",))
        self._launched.append((self.runner.last_picked, 0))

    def launch_chained(self, depth, start, head, bias, stats, oracle):
        token, launched_depth = self._launched[-1]
        assert launched_depth in (0, depth)
        token = _expected(token, launched_depth + 1)[-1]  # what the step before emits last: its token
        self.events.append(("chain", token, start))
        self._launched.append((token, depth))

    def read_verify(self, depth, stats, position):
        token, launched_depth = self._launched.popleft()
        assert depth == launched_depth
        self.events.append(("read", token, position))
        return depth, _expected(token, depth + 1)


class _Ops:
    def __init__(self):
        self.num_synchronized = 0

    def synchronize(self):
        self.num_synchronized += 1


class _TimedPolicy(DepthPolicy):
    def __init__(self, max_depth: int = 2):
        super().__init__(max_depth, is_fixed=True)
        self.times, self.limits = [], []

    def depth(self, limit):
        self.limits.append(limit)
        return super().depth(limit)

    def record(self, depth, seconds, num_accepted):
        self.times.append(seconds)
        super().record(depth, seconds, num_accepted)


class _ChangingPolicy(_TimedPolicy):
    """Answers depth 2, then 1."""

    def depth(self, limit):
        self.limits.append(limit)
        return min(limit, 2 if len(self.limits) == 1 else 1)


class _ScriptedPolicy(_TimedPolicy):
    """Plain decode, then depth 1 from its second answer on; every depth timed."""

    def __init__(self):
        super().__init__(max_depth=1)
        self.is_fixed = False

    def depth(self, limit):
        self.limits.append(limit)
        return 0 if len(self.limits) == 1 else min(limit, 1)

    def plain_steps(self):
        return 0

    def is_timed(self, depth):
        return True


def _drafting(events: list, is_launched_ahead: bool = True, policy=None):
    runner = _Runner()
    runner.ops = _Ops()
    device = _DraftingDevice(events, is_launched_ahead)
    device.runner = runner
    speculation = Speculation(runner, None, policy or _TimedPolicy(), None, SamplingParams(temperature=0.0), None,
                              StreamStats(), device=(device, None, None))
    return runner, speculation


def _kinds(events: list) -> list[str]:
    return [event[0] for event in events]


def test_the_next_step_is_chained_on_the_device_before_a_step_is_read():
    events, kv_tokens = [], []
    runner, speculation = _drafting(events)
    tokens = []
    for token in speculation.tokens(5, np.zeros((1, 4), np.float32), 40, 12, kv_tokens):
        events.append(("yield", token))
        tokens.append(token)
    assert tokens == _expected(5, 12) and kv_tokens == [5, *tokens[:-1]]
    # four steps of three tokens: the first from the host; each later one chained before the one before it is
    # read, while the request has room for it whatever that one takes (6 tokens left at depth 2)
    yields = ["yield"] * 3
    assert _kinds(events) == ["draft", "launch", "chain", "read", *yields, "chain", "read", *yields, "chain", "read",
                              *yields, "read", *yields]
    # a chained step is told where the step before it starts (its own start is on the device)
    assert [event[1:] for event in events if event[0] == "chain"] == [(tokens[2], 40), (tokens[5], 43),
                                                                      (tokens[8], 46)]
    assert [event[2] for event in events if event[0] == "read"] == [40, 43, 46, 49]
    assert speculation.device[0].drafted_from == [(True, [5])]  # the host drafted once: the prefill's row
    # the policy is asked for a chained step with the fewest tokens the request may have left then, less one
    assert speculation.policy.limits == [11, 12 - 3 - 1, 9 - 3 - 1, 6 - 3 - 1]
    assert runner.ops.num_synchronized == 0
    assert speculation.stats.spec_launch_seconds > 0  # every launch timed, chained or not


def test_a_step_that_could_run_past_the_request_is_launched_from_the_host_after_the_read():
    events = []
    _, speculation = _drafting(events)
    tokens = []
    for token in speculation.tokens(5, np.zeros((1, 4), np.float32), 40, 5, []):
        events.append(("yield", token))
        tokens.append(token)
    assert tokens == _expected(5, 5)
    # 5 tokens: the first step takes up to 3, so the next is launched once its read says where, before the yield
    assert _kinds(events) == ["draft", "launch", "read", "draft", "launch", *["yield"] * 3, "read", "yield", "yield"]
    assert [event[1:] for event in events if event[0] == "launch"] == [(5, 40), (tokens[2], 43)]
    assert speculation.device[0].drafted_from == [(True, [5]), (False, tokens[0:3])]


def test_where_the_policy_answers_another_depth_the_step_is_launched_from_the_host_at_that_depth():
    events = []
    policy = _ChangingPolicy()
    _, speculation = _drafting(events, policy=policy)
    tokens = list(speculation.tokens(5, np.zeros((1, 4), np.float32), 40, 13, []))  # 3 + 5 x 2 tokens
    assert tokens == _expected(5, 13)
    # the first step at 2; asked for the second before the first is read, the policy answers 1: the second
    # is launched from the host after the read, at 1, and not asked again; later steps are chained at 1
    assert [event for event in events if event[0] == "draft"][:2] == [("draft", 39, 2), ("draft", 40, 1)]
    assert _kinds(events)[:7] == ["draft", "launch", "read", "draft", "launch", "chain", "read"]
    assert policy.limits[:3] == [12, 13 - 3 - 1, 10 - 2 - 1]


def test_a_step_launched_ahead_is_timed_without_the_callers_time():
    events = []
    _, speculation = _drafting(events)
    for _ in speculation.tokens(5, np.zeros((1, 4), np.float32), 40, 9, []):
        time.sleep(0.02)  # a slow caller: 60 ms a step of three tokens
    assert len(speculation.policy.times) == 3 and max(speculation.policy.times) < 0.02


def test_a_step_that_needs_the_host_between_its_layers_is_not_launched_ahead():
    events = []
    _, speculation = _drafting(events, is_launched_ahead=False)
    for token in speculation.tokens(5, np.zeros((1, 4), np.float32), 40, 6, []):
        events.append(("yield", token))
    assert _kinds(events) == ["draft", "launch", "read", *["yield"] * 3, "draft", "launch", "read", *["yield"] * 3]


def test_a_caller_that_stops_waits_for_the_steps_in_flight():
    events = []
    runner, speculation = _drafting(events)
    assert _taken(speculation.tokens(5, np.zeros((1, 4), np.float32), 40, 12, []), 4) == _expected(5, 4)
    assert _kinds(events).count("launch") + _kinds(events).count("chain") == 3 and runner.ops.num_synchronized == 1


def test_a_launch_that_fails_after_its_draft_is_waited_for():
    events = []
    runner, speculation = _drafting(events)
    speculation.device[0].failing_launch = 1  # after the first draft
    with pytest.raises(RuntimeError, match="a capture failed"):
        list(speculation.tokens(5, np.zeros((1, 4), np.float32), 40, 12, []))
    assert _kinds(events) == ["draft"] and runner.ops.num_synchronized == 1  # the draft's work, queued


def test_a_depth_the_policy_is_still_timing_is_not_chained():
    events = []
    policy = DepthPolicy(1)
    for _ in range(2):
        policy.record(0, 0.010, 0)  # plain decode timed; depth 1 not yet
    _, speculation = _drafting(events, policy=policy)
    tokens = list(speculation.tokens(5, np.zeros((1, 4), np.float32), 40, 10, []))
    assert tokens == _expected(5, 10)
    # the first two steps at depth 1 each wait for the record of the one before; from the third, chained
    kinds = [kind for kind in _kinds(events) if kind != "draft"]
    assert kinds[:5] == ["launch", "read", "launch", "read", "launch"] and "chain" in kinds[5:]
    assert policy.num_steps_at[1] == 5


def test_the_step_after_a_plain_run_is_chained_behind_its_verify_step():
    events, kv_tokens = [], []
    policy = _ScriptedPolicy()
    _, speculation = _drafting(events, policy=policy)
    tokens = []
    for token in speculation.tokens(5, None, 40, PLAIN_RUN_TOKENS + 4, kv_tokens):
        events.append(("yield", token))
        tokens.append(token)
    assert tokens == _expected(5, PLAIN_RUN_TOKENS + 4) and kv_tokens == [5, *tokens[:-1]]
    # the run's verify step queued behind its last greedy step before that is read; the step after it chained behind
    # it, from the position the verify step is at, before the host reads the verify step; nothing drafted from the host
    last_greedy = PLAIN_RUN_TOKENS - 1
    assert _kinds(events)[last_greedy - 1:last_greedy + 4] == ["queued verify", "yield", "chain", "read", "yield"]
    assert [event[2] for event in events if event[0] == "chain"][0] == 40 + last_greedy
    assert speculation.device[0].drafted_from == []
    # the policy asked for the step after the run with the run's greedy steps recorded, the verify step after
    assert policy.limits[:2] == [PLAIN_RUN_TOKENS + 3, 3] and len(policy.times) >= PLAIN_RUN_TOKENS


def test_a_depth_this_request_has_not_run_is_launched_from_the_host_after_a_plain_run():
    events = []
    _, speculation = _drafting(events, policy=_ScriptedPolicy())
    speculation.device[0].can_chain = lambda depth: False
    tokens = []
    for token in speculation.tokens(5, None, 40, PLAIN_RUN_TOKENS + 4, []):
        events.append(("yield", token))
        tokens.append(token)
    assert tokens == _expected(5, PLAIN_RUN_TOKENS + 4)
    # after the verify step's read, launched from the host before its token is yielded
    kinds = _kinds(events)
    assert kinds[PLAIN_RUN_TOKENS:PLAIN_RUN_TOKENS + 4] == ["read", "draft", "launch", "yield"]
