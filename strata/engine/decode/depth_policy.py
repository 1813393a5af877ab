"""How many tokens a speculation step drafts: the depth with the best measured tokens per second.

A verify step over ``d + 1`` tokens reads the union of their experts, so on an MoE model a deep
draft can cost more than the tokens it saves. The policy keeps, while the engine runs:

- the seconds a step takes at each depth (depth 0: one plain decode step), a moving average that
  starts at a depth's second step: its first may pay once-only work (a first launch of a kernel, a
  graph captured for a request's bias), and one slow step must not keep a depth out for good (a
  device's plain steps come in runs, each step recorded at its run's average, a run's first step left
  out of it);
- the acceptance at each place of a draft run: a_j, the share of drafts at place j taken when the
  ones before it were (counts that decay, so the estimate follows the text);

and picks the depth d (0..``max_depth``) with the most expected tokens per second,
``(1 + a_1 + a_1 a_2 + ... + a_1...a_d) / seconds[d]``. A depth with fewer than ``_MIN_STEPS``
steps is tried while it could still win: its tokens what the counts allow (each measured place at
its measured share or, where more, a uniform prior's mean, later places accepting as often as the
last measured one does), its time its own once timed, else the slowest timed depth's below it or, if
longer, the line through the two deepest timed (in a small budget each row's experts stream: no
depth pays there, and trying each deeper one lost ~2% of a 128-token request at 0.8 acceptance). So
one refused draft, or one slow first step, does not end speculation: simulated with the resident
30B's step costs (512 tokens, drafts taken 80% of the time, a first step at each depth 10 ms slower),
the policy gets 1.36x of plain decode where one that judged each depth by its first step stayed at
plain. Every ``probe_every`` steps (more where a probe costs more than ``_PROBE_SHARE`` of the steps
between: a verify step streams its rows' experts in a small budget) the depth next to the chosen one
is timed again, so a change in the text or the cache is seen; a probe that finds the same depth best
as the one before doubles the interval (up to ``_MAX_PROBE_EVERY``), since each costs a step at a
worse depth: on the H200 a plain run with a probe every 32 tokens decoded at 0.92x plain decode.
Trial steps count as a probe, and before any probe plain decode counts as the best found. Between
probes, where plain decode is best, ``plain_steps`` says how long a caller may run plain steps
without asking. ``is_fixed`` always drafts ``max_depth`` (the equality tests, the bench's fixed arm).
"""

from __future__ import annotations

import math

_EMA = 0.2  # weight of a new step's time in the moving average
_DECAY = 0.98  # acceptance counts fade by this per step at or beyond their place
_MAX_PROBE_EVERY = 1024  # steps
_MIN_STEPS = 4  # steps at a depth before only its measured rate decides (until then, what it could give)
_PROBE_SHARE = 0.005  # of the best depth's time, what probes may lose on average (before they double)


class DepthPolicy:
    def __init__(self, max_depth: int, is_fixed: bool = False, probe_every: int = 32):
        if not 1 <= max_depth <= 8:
            raise ValueError(f"max_depth must be in 1..8, got {max_depth}")
        self.max_depth = max_depth
        self.is_fixed = is_fixed
        self.probe_every = probe_every
        self.seconds: list[float | None] = [None] * (max_depth + 1)  # [d] seconds of a step at depth d
        self.num_steps_at = [0] * (max_depth + 1)  # [d] steps recorded at depth d
        self._drafted = [0.0] * max_depth  # [place] decayed counts
        self._accepted = [0.0] * max_depth
        self._num_steps = 0
        self._last_probe = 0  # _num_steps when a neighbour of the best depth was last timed
        self._num_settled = 0  # probes in a row that found the best depth of the probe before
        self._best_at_probe = 0  # the best depth when the last probe was made (before any: plain decode's)
        self.last_depth = 0

    def depth(self, limit: int) -> int:
        """The depth of the next step, at most ``limit`` (the tokens the request still wants, less one)."""
        limit = max(0, min(limit, self.max_depth))
        if self.is_fixed or limit == 0:
            return limit
        if not self.is_timed(0):
            return 0
        best = self._best(limit)
        to_try = self._depth_to_try(limit, best)
        if to_try is not None:  # timing a depth, as a probe does: the next probe counts from here
            self._last_probe = self._num_steps
            return to_try
        if self._num_steps - self._last_probe >= self._probe_interval(best, limit):  # time a neighbour again
            if limit == self.max_depth:  # near a request's end the best is the one the request leaves room for
                self._num_settled = self._num_settled + 1 if best == self._best_at_probe else 0
                self._best_at_probe = best
            self._last_probe = self._num_steps
            return _neighbour(best, limit)
        return best

    def plain_steps(self) -> int:
        """Steps in a row that ``depth`` answers 0 from now on, as the records stand: where plain decode is
        the best depth, the steps until the next probe; else 0 (depth 0 is not yet timed, a depth of few
        steps could still beat it, or it is probed as the neighbour of a better depth). A caller may run that many
        plain steps without asking."""
        if self.is_fixed or not self.is_timed(0) or self._best(self.max_depth) != 0 \
                or self._depth_to_try(self.max_depth, 0) is not None:
            return 0
        return max(0, self._probe_interval(0, self.max_depth) - (self._num_steps - self._last_probe))

    def record(self, depth: int, seconds: float, num_accepted: int) -> None:
        """A step at ``depth`` took ``seconds`` and its first ``num_accepted`` drafts were taken."""
        self._num_steps += 1
        self.last_depth = depth
        self.num_steps_at[depth] += 1
        old = self.seconds[depth]
        self.seconds[depth] = seconds if self.num_steps_at[depth] <= 2 else (1 - _EMA) * old + _EMA * seconds
        for place in range(min(depth, num_accepted + 1)):  # places past the first refusal were not judged
            self._drafted[place] = _DECAY * self._drafted[place] + 1
            self._accepted[place] = _DECAY * self._accepted[place] + (place < num_accepted)

    def acceptance(self, place: int) -> float | None:
        """a_place: the share of drafts at ``place`` taken when every one before was; None if unmeasured."""
        if self._drafted[place] == 0:
            return None
        return self._accepted[place] / self._drafted[place]

    def expected_tokens(self, depth: int, is_bound: bool = False) -> float:
        """Tokens a step at ``depth`` gives on average. is_bound: what it could give, as far as the counts
        tell: each measured place at its measured share or, where more, (taken + 1) / (drafted + 2) (a
        uniform prior's mean: one refusal leaves a third, two a quarter, where a draft's verify step costs
        ~1.35 plain steps), unmeasured ones accepting as often as the last measured one does (as often as
        not, if none is)."""
        total, chance, last = 1.0, 1.0, 0.5
        for place in range(depth):
            rate = measured = self.acceptance(place)
            if rate is None:
                if not is_bound:
                    return total
                rate = last
            elif is_bound:
                rate = max(measured, (self._accepted[place] + 1) / (self._drafted[place] + 2))
            chance *= rate
            total += chance
            last = last if measured is None else measured
        return total

    def summary(self) -> str:
        """Each depth's steps and time, each place's acceptance: what the policy chose from."""
        times = ", ".join(f"{d}: {self.num_steps_at[d]} x {self.seconds[d] * 1e3:.2f} ms"
                          for d in range(self.max_depth + 1) if self.seconds[d] is not None)
        rates = " ".join("-" if (a := self.acceptance(place)) is None else f"{a:.2f}"
                         for place in range(self.max_depth))
        return f"steps by depth {{{times}}}, acceptance by place {rates}, last depth {self.last_depth}"

    def _depth_to_try(self, limit: int, best: int) -> int | None:
        """The shallowest depth up to ``limit`` with fewer than _MIN_STEPS steps that could beat ``best``."""
        best_rate = self._rate(best)
        return next((d for d in range(1, limit + 1)
                     if self.num_steps_at[d] < _MIN_STEPS and self._bound(d) > best_rate), None)

    def is_timed(self, depth: int) -> bool:
        """Whether ``depth`` has a time of its own (two steps: a first may pay once-only work)."""
        return self.num_steps_at[depth] >= 2

    def _probe_interval(self, best: int, limit: int) -> int:
        """Steps from a probe to the next: ``probe_every``, or where more, the steps at ``best`` whose
        time a probe's loss (its time less what ``best`` takes for the tokens it gives) is _PROBE_SHARE of;
        doubled for each probe in a row that found the best depth unchanged, up to _MAX_PROBE_EVERY."""
        interval = self.probe_every
        neighbour = _neighbour(best, limit)
        if neighbour != best and self.is_timed(neighbour):
            best_seconds = max(self.seconds[best], 1e-9)
            loss = self.seconds[neighbour] - self.expected_tokens(neighbour) * best_seconds / self.expected_tokens(best)
            interval = max(interval, math.ceil(loss / (_PROBE_SHARE * best_seconds)))
        return min(interval << min(self._num_settled, 16), _MAX_PROBE_EVERY)

    def _best(self, limit: int) -> int:
        """The timed depth up to ``limit`` with the most expected tokens per second."""
        return max(range(limit + 1), key=lambda d: self._rate(d) if self.is_timed(d) else -1.0)

    def _rate(self, depth: int) -> float:
        return self.expected_tokens(depth) / max(self.seconds[depth], 1e-9)

    def _bound(self, depth: int) -> float:
        """Tokens a second ``depth`` could give: optimistic acceptance, its own time once timed, else the
        slowest timed depth's below it, or where two are timed, the line through the two deepest if longer (a
        verify step's rows each stream their experts in a small budget: a step grows ~linearly with depth)."""
        if self.is_timed(depth):
            seconds = self.seconds[depth]
        else:
            timed = [d for d in range(depth) if self.is_timed(d)]
            seconds = max(self.seconds[d] for d in timed)
            if len(timed) >= 2:
                (a, b), s = timed[-2:], self.seconds
                seconds = max(seconds, s[b] + (depth - b) * (s[b] - s[a]) / (b - a))
        return self.expected_tokens(depth, is_bound=True) / max(seconds, 1e-9)


def _neighbour(best: int, limit: int) -> int:
    """The depth a probe times next to ``best``: one deeper where ``limit`` allows, else one shallower."""
    return min(limit, best + 1) if best < limit else best - 1
