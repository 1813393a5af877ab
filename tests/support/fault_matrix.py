"""Failures injected into the real engine at each step of the loan transaction, through its own seams
(a real method of the engine's own objects, wrapped to raise on its Nth call), and the checks after
each request: it failed cleanly or completed, nothing leaked, nothing moved, the output is a fresh
engine's."""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

from strata.engine.sampling import SamplingParams
from strata.errors import AllocationError, LoanRestoreError
from strata.hooks import hookimpl
from strata.hooktypes import LoanVote
from strata.plugins import register


class InjectedFault(RuntimeError):
    pass


class EveryRequest:
    """A third-party loan plugin that asks for the loan on every request, so that short prompts run
    the whole transaction (the built-in repeat loan waits for 256 unread tokens)."""

    @staticmethod
    @hookimpl
    def strata_loan_decide(ctx):
        return LoanVote(True, "every request (fault matrix)")


def loan_on_every_request(engine) -> None:
    register(engine.plugins.pm, "every_request", EveryRequest)


@dataclasses.dataclass(frozen=True)
class Site:
    """One step of the transaction: the engine's (object, method) pairs whose calls count, the error
    the Nth raises, and which calls count."""

    name: str
    targets: Callable[[object], list[tuple[object, str]]]
    error: Callable[[], BaseException] = lambda: InjectedFault("injected")
    counts: Callable[[tuple, dict], bool] = lambda args, kwargs: True
    max_nth: int = 2


def _is_prefill(args, kwargs) -> bool:
    return (kwargs.get("workspace") if "workspace" in kwargs else args[2]) is not None


def _resources(method: str):
    return lambda engine: [(r, method) for r in engine.resources.values()]


SITES = {site.name: site for site in (
    Site("release", _resources("release"), max_nth=4),
    Site("budget", lambda e: [(e.loan, "budget")]),
    Site("allocate workspace", lambda e: [(e.workspace, "allocate")]),
    Site("allocate workspace: out of memory", lambda e: [(e.workspace, "allocate")],
         error=lambda: AllocationError("injected: out of device memory")),
    Site("prefill chunk", lambda e: [(e.runner, "forward")], counts=_is_prefill, max_nth=3),
    Site("cache growth", lambda e: [(e.cache, "grow")], max_nth=1),
    Site("restore", _resources("restore"), max_nth=4),
    Site("restage", lambda e: [(e.cache, "stage_from")], max_nth=2),
    Site("graph capture", lambda e: [(e.ops, "capture")], max_nth=6),
)}


class Injector:
    """Wraps every target of the sites once; ``arm`` makes the Nth counted call of one site raise."""

    def __init__(self, engine, site_names: list[str]):
        self.engine = engine
        self.armed: Site | None = None
        self.nth = 0
        self.num_calls = 0
        self.num_fired = 0
        wrapped = set()
        for name in site_names:
            for obj, method in SITES[name].targets(engine):
                if (id(obj), method) not in wrapped:
                    wrapped.add((id(obj), method))
                    setattr(obj, method, self._wrap(obj, method, getattr(obj, method)))

    def _wrap(self, obj, method, real):
        def injected(*args, **kwargs):
            site = self.armed
            if site is not None and any(o is obj and m == method for o, m in site.targets(self.engine)) \
                    and site.counts(args, kwargs):
                self.num_calls += 1
                if self.num_calls == self.nth:
                    self.num_fired += 1
                    raise site.error()
            return real(*args, **kwargs)

        return injected

    def arm(self, site: Site, nth: int) -> None:
        self.armed, self.nth, self.num_calls, self.num_fired = site, nth, 0, 0

    def disarm(self) -> None:
        self.armed = None


def state_of(engine) -> tuple:
    """What must be as it was after a request's loan: settings, the cache's residency, the resources."""
    residency = engine.cache.residency() if engine.cache else None
    return (engine.state.settings, residency, {n: r.is_resident for n, r in engine.resources.items()})


def greedy_tokens(engine, prompt: list[int], max_tokens: int) -> list[int]:
    # a seed: the request is prefilled from its first token, as on a fresh engine
    generation = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, seed=0))
    return [event.token_id for event in generation if event.token_id >= 0]


def run_matrix(engine, expected_probes: dict[tuple, list[int]], site_names: list[str], num_requests: int,
               seed: int, prompt_tokens: tuple[int, int], vocab_size: int) -> dict[str, list[int]]:
    """``num_requests`` requests, each with one fault armed; returns per site [requests, faults fired,
    requests failed]. After each: checks (see the module doc) and a probe request against a fresh engine."""
    rng = random.Random(seed)
    injector = Injector(engine, site_names)
    closed_states = []
    real_close = engine.loan._close

    def spying_close(*args, **kwargs):  # the state as the loan leaves it, before any decode step
        try:
            return real_close(*args, **kwargs)
        finally:
            closed_states.append(state_of(engine))

    engine.loan._close = spying_close
    tally = {name: [0, 0, 0] for name in site_names}
    probes = list(expected_probes.items())
    greedy_tokens(engine, list(probes[0][0]), 1)  # a startup loan's first request restores what load deferred
    for index in range(num_requests):
        site = SITES[rng.choice(site_names)]
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_tokens))]
        before = state_of(engine)
        closed_states.clear()
        injector.arm(site, rng.randint(1, site.max_nth))
        is_failed = False
        try:
            greedy_tokens(engine, prompt, rng.choice([1, 2, 3]))
        except LoanRestoreError:
            raise AssertionError(f"request {index}: a fault at {site.name!r} left the engine unhealthy")
        except (InjectedFault, AllocationError):
            is_failed = True
        finally:
            injector.disarm()
        counts = tally[site.name]
        counts[0] += 1
        counts[1] += injector.num_fired
        counts[2] += is_failed
        where = f"request {index} (fault at {site.name!r}, call {injector.nth})"
        assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner), where
        assert closed_states and closed_states[0] == before, where  # the loan put everything back
        assert state_of(engine)[0] == before[0] and state_of(engine)[2] == before[2], where
        probe, tokens = probes[index % len(probes)]
        assert greedy_tokens(engine, list(probe), len(tokens)) == tokens, where
        assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner), where
    return tally
