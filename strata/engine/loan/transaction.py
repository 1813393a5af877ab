"""The request-scoped prefill VRAM loan: one transaction around every prefill.

decide → release in plugin order → adjust the planner budget → plan, as if the elastic expert cache
had grown into all that was released (the cost model weighs the chunk against the cache its
workspace borrows; the chunk capped at the prompt) → grow the cache by what the workspace's staging
ring can use of it → allocate the workspace (smaller geometries on failure, bounded) → prefill →
finally: free the workspace (mapping back the cache segments it unmapped), shrink the cache, restore
resources in reverse order, put back the runtime state (settings, and the expert cache's residency,
staging again what the ring evicted), run the restore hooks, and check that the ledger and state
equal what they were before. A restore or a put-back that fails is tried again
(``RESTORE_ATTEMPTS``) before the engine is declared unhealthy.

With ``loan.enabled`` false the same object plans and allocates, and no hook runs: the plan is the
one a build without plugins makes, or, with ``runtime.prefill_head_alias``, the one it makes with
the output head's bytes lent to the prompt workspace (released before planning, uploaded again
from its host copy after prefill, like a loan's release). The sequence of hooks is documented in
``strata.hooks``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from collections import deque
from collections.abc import Iterator
from typing import Mapping, Protocol

from strata.config import Config
from strata.engine.loan.resources import ElasticCache, Resource
from strata.engine.loan.runtime_state import RuntimeState
from strata.engine.planning.planner import CacheState, Candidate, Planner
from strata.errors import AllocationError, LoanRestoreError, PluginError
from strata.gpu.ledger import TRANSIENT_OWNERS, VramLedger
from strata.hooktypes import (
    MTP_DRAFT_HEAD,
    OUTPUT_HEAD,
    Geometry,
    LoanContext,
    LoanPrediction,
    LoanRequest,
    LoanVote,
    PlannerBudget,
)
from strata.plugins import PluginHost, name_plugins

RESTORE_ATTEMPTS = 3
# the phases only a taken loan has; their median over the last loans is its own work beyond prefill
# (restores are predicted from their bytes, restaging by the planner, and the rest every request has)
LOAN_ONLY_PHASES = ("release", "grow", "shrink", "hooks")
# that work before any loan has been timed (~10 ms on the reference H200 while the cache grew into all the
# released memory; growing only for the ring leaves less, which the median of the loans taken then says)
DEFAULT_LOAN_OVERHEAD_SECONDS = 0.01
_OVERHEAD_SAMPLES = 8
_ALIAS_REASON = "output head lent to the prompt workspace (runtime.prefill_head_alias)"


class Workspace(Protocol):
    """The prompt workspace and staging ring of one prefill."""

    def allocate(self, geometry: Geometry) -> None:
        """Take the memory for ``geometry`` or raise ``AllocationError`` having taken nothing."""

    def free(self) -> None:
        """Give it back; a no-op when nothing is allocated."""


@dataclasses.dataclass(frozen=True)
class LoanReport:
    is_taken: bool
    reason: str
    geometry: Geometry | None
    released: tuple[str, ...] = ()
    released_bytes: int = 0
    grown_bytes: int = 0
    num_retries: int = 0
    # (phase, host seconds) of the transaction itself, inside the request's prefill time
    phase_seconds: tuple[tuple[str, float], ...] = ()

    def summary(self) -> str:
        if not self.is_taken:
            return f"loan off ({self.reason}){self._phases()}"
        return (f"loan on ({self.reason}; released {', '.join(self.released) or 'nothing'}: "
                f"{self.released_bytes / 2**20:.1f} MiB; cache +{self.grown_bytes / 2**20:.1f} MiB; "
                f"retries {self.num_retries}){self._phases()}")

    def _phases(self) -> str:
        shown = [f"{phase} {1e3 * seconds:.1f}" for phase, seconds in self.phase_seconds if seconds >= 5e-4]
        return f" [ms: {', '.join(shown)}]" if shown else ""


class LoanTransaction:
    def __init__(self, *, config: Config, plugins: PluginHost, ledger: VramLedger,
                 resources: Mapping[str, Resource], cache: ElasticCache | None, planner: Planner,
                 workspace: Workspace, state: RuntimeState, mtp_prefill_share: float = 0.0,
                 is_mtp_prompt_kept: bool = False):
        """mtp_prefill_share: the compute the MTP block adds to a prefill while resident, as a fraction
        of the main model's (``PrefillCostModel.mtp_share``; 0 without one): the predictions count it
        where the block stays resident, and a loan that releases it saves it, unless is_mtp_prompt_kept:
        what that pass reads stays resident outside the loan (``loading.mtp_prompt_sources``), so it runs
        under the loan too."""
        self.config = config
        self.mtp_prefill_share = mtp_prefill_share
        self.is_mtp_prompt_kept = is_mtp_prompt_kept
        self.plugins = plugins
        self.ledger = ledger
        self.resources = dict(resources)
        self.cache = cache
        self.planner = planner
        self.workspace = workspace
        self.state = state
        self.startup_geometry: Geometry | None = None
        self.last_report: LoanReport | None = None
        self._loan_overheads: deque[float] = deque(maxlen=_OVERHEAD_SAMPLES)
        self._deferred: list[str] = []
        self._num_requests = 0

    @property
    def is_enabled(self) -> bool:
        return self.config.loan.enabled

    def start(self, expected_cache: CacheState | None = None) -> None:
        """Load every resource except those the startup loan defers; plan the startup geometry for
        the longest prompt and ``expected_cache``, what the cache will hold for the first request
        (None: what it holds now).

        Call after admission: nothing is deferred before every rule has passed.
        """
        if self.is_enabled:
            ctx = self._context(LoanRequest(0, 0, 0, is_startup_loan=True))
            self._deferred = self._release_names(ctx, already=[])
        for name, resource in self.resources.items():
            if name not in self._deferred:
                resource.restore()
        self.startup_geometry = self.planner.plan(self.budget(), cache=expected_cache or self.cache_state())

    @contextlib.contextmanager
    def lend(self, prompt_tokens: int, unread_tokens: int) -> Iterator[Geometry]:
        """The loan around one request's prefill: ``with loan.lend(...) as geometry:`` prefill in it.

        Entering decides, releases, grows the cache, plans and allocates the workspace; leaving (also
        by an exception) frees, restores and checks, then ``last_report`` says what the loan did.
        """
        request = LoanRequest(self._num_requests, prompt_tokens, unread_tokens,
                              is_startup_loan=self.is_enabled and self._num_requests == 0)
        self._num_requests += 1
        ctx = self._context(request)
        phases = _PhaseClock()
        vote = self._decide(ctx)
        phases.mark("decide")
        before = self.ledger.snapshot()
        expected = dict(before.by_owner)
        for name in self._deferred:
            expected[name] = expected.get(name, 0) + self.resources[name].num_bytes
        captured = self.state.capture()
        cache_bytes_before = self.cache.mapped_bytes if self.cache else 0
        released, self._deferred = list(self._deferred), []
        report = LoanReport(vote.is_run, vote.reason, None)
        try:
            if vote.is_run:
                for name in self._release_names(ctx, already=released):
                    self.resources[name].release()
                    released.append(name)
                phases.mark("release")
                report = dataclasses.replace(report, released=tuple(released),
                                             released_bytes=sum(self.resources[n].num_bytes for n in released))
            else:
                self._restore_all(released)  # a vetoed startup loan gives everything back first
                released = []
                for name in self.aliased_names():
                    self.resources[name].release()
                    released.append(name)
                if released:
                    report = dataclasses.replace(report, reason=f"{report.reason}; {_ALIAS_REASON}")
                phases.mark("restore")
            geometry = self.planner.capped(self._plan(ctx, vote.is_run), unread_tokens)
            phases.mark("plan")
            if vote.is_run and self.cache:
                report = dataclasses.replace(report, grown_bytes=self.cache.grow(self._ring_growth(geometry)))
                phases.mark("grow")
            geometry, num_retries = self._allocate(geometry)
            phases.mark("allocate")
            report = dataclasses.replace(report, geometry=geometry, num_retries=num_retries)
            yield geometry
            phases.mark("prefill")
        finally:
            self.last_report = report
            try:
                self._close(ctx, vote.is_run, released, captured, cache_bytes_before, expected, phases)
            finally:
                self.last_report = dataclasses.replace(report, phase_seconds=phases.without("prefill"))
                if vote.is_run:
                    self._loan_overheads.append(sum(seconds for name, seconds in self.last_report.phase_seconds
                                                    if name in LOAN_ONLY_PHASES))

    def plan_preview(self, is_loan: bool, unread_tokens: int | None = None,
                     cache: CacheState | None = None) -> Geometry:
        """The geometry a prompt of ``unread_tokens`` (None: any) gets from the idle engine (every
        resource resident) whose cache holds ``cache``, without the loan (with the head alias, when
        configured) or with its release."""
        return self.planner.plan(self.preview_budget(is_loan), unread_tokens, cache)

    def preview_budget(self, is_loan: bool) -> PlannerBudget:
        """The budget ``plan_preview`` plans in: the idle engine's, less what it lends to prefill."""
        budget = self.budget()
        idle_free = budget.free_bytes - sum(r.num_bytes for r in self.resources.values() if not r.is_resident)
        names = self.aliased_names()
        if is_loan and self.is_enabled:
            names = self._release_names(self._context(LoanRequest(0, 0, 0, is_startup_loan=True)), already=[])
        freed = sum(self.resources[n].num_bytes for n in names)
        return dataclasses.replace(budget, free_bytes=max(0, idle_free + freed))

    def aliased_names(self) -> list[str]:
        """What every prefill without the loan lends to its prompt workspace: the native output head
        under ``runtime.prefill_head_alias`` (admission refuses the alias with the loan on)."""
        if self.config.runtime.prefill_head_alias and OUTPUT_HEAD in self.resources:
            return [OUTPUT_HEAD]
        return []

    def _context(self, request: LoanRequest) -> LoanContext:
        return LoanContext(self.config, request, self.resources, self.startup_geometry,
                           functools.partial(self.predict, request))

    def predict(self, request: LoanRequest, cache: CacheState | None = None) -> LoanPrediction | None:
        """The cost model's prefill time for ``request`` from the idle engine whose cache holds
        ``cache`` (None: what it holds now), without the loan and with the release of every resource
        the plugins name (their budget adjustments and geometry choices aside), and what taking it
        adds; None without a cost model, or when no plan fits even with the loan. Valid before the
        loan releases anything (``strata_loan_decide``): later the budget is no longer the idle one."""
        unread, cache = request.unread_tokens or None, cache or self.cache_state()
        off = self._predicted(self.preview_budget(is_loan=False), unread, cache)
        on = self._predicted(self.preview_budget(is_loan=True), unread, cache)
        if on is None:
            return None
        reload_seconds = self.overhead_seconds()
        rates, names = self.planner.rates, self._release_names(self._context(request), already=[])
        if not request.is_startup_loan and rates is not None:
            reload_seconds += sum(self.resources[n].num_bytes for n in names) / rates.pcie.value
        mtp_seconds = self._mtp_prefill_seconds(request.unread_tokens or self.planner.predicted_tokens(None))
        is_mtp_pass_lent = MTP_DRAFT_HEAD in names and not self.is_mtp_prompt_kept
        on_seconds = on.predicted_seconds + (0.0 if is_mtp_pass_lent else mtp_seconds)
        if off is None:  # only the loan's memory holds a plan
            return LoanPrediction(None, math.inf, on.geometry, on_seconds, reload_seconds)
        return LoanPrediction(off.geometry, off.predicted_seconds + mtp_seconds, on.geometry, on_seconds,
                              reload_seconds)

    def _mtp_prefill_seconds(self, unread_tokens: int) -> float:
        """The MTP block's pass over a prompt (``mtp_prefill_share`` of the main model's weight FLOPs a
        token: its projections, no attention over the prompt)."""
        model = self.planner.cost_model
        if not self.mtp_prefill_share or model is None:
            return 0.0
        return self.mtp_prefill_share * unread_tokens * model.weight_flops_per_token / model.compute_flops_per_s

    def overhead_seconds(self) -> float:
        """The transaction's own work a taken loan adds: the median, over the last loans, of the
        phases only a loan has (``LOAN_ONLY_PHASES``); ``DEFAULT_LOAN_OVERHEAD_SECONDS`` before any."""
        return statistics.median(self._loan_overheads) if self._loan_overheads else DEFAULT_LOAN_OVERHEAD_SECONDS

    def _predicted(self, budget: PlannerBudget, unread: int | None, cache: CacheState | None) -> Candidate | None:
        try:
            geometry, candidates = self.planner.weigh(budget, unread, cache)
        except AllocationError:
            return None
        return next((c for c in candidates if c.geometry == geometry), None)

    def _decide(self, ctx: LoanContext) -> LoanVote:
        if not self.is_enabled:
            return LoanVote(False, "loan.enabled is false")
        votes = self.plugins.call("strata_loan_decide", ctx=ctx)
        skips = [v.reason for v in votes if not v.is_run]
        runs = [v.reason for v in votes if v.is_run]
        if skips:
            return LoanVote(False, "; ".join(skips))
        if runs:
            return LoanVote(True, "; ".join(runs))
        if ctx.request.is_startup_loan:
            return LoanVote(True, "startup loan")
        return LoanVote(False, "no plugin asked for a repeat loan")

    def _release_names(self, ctx: LoanContext, already: list[str]) -> list[str]:
        names: list[str] = []
        for asked in self.plugins.call("strata_prefill_release", ctx=ctx):
            for name in asked:
                if name not in self.resources:
                    # pluggy returns results without their plugins: name every plugin that may have asked
                    who = name_plugins(self.plugins.implementers("strata_prefill_release"))
                    raise PluginError(f"{who} asked to release {name!r}, which this engine does not "
                                      f"offer (offered: {', '.join(self.resources) or 'nothing'})")
                if name not in names and name not in already:
                    names.append(name)
        return names

    def budget(self, adjust_bytes: int = 0, is_grown: bool = False) -> PlannerBudget:
        """The planner's budget now; ``is_grown``: as it would be with the expert cache grown into all
        free memory (a loan plans so: its workspace may take the released memory as cache slots)."""
        free = self.ledger.free_bytes
        borrowable = self.cache.borrowable_bytes() if self.cache else 0
        if is_grown and self.cache:
            grown = self.cache.growable_bytes(free)
            free, borrowable = free - grown, self.cache.borrowable_bytes(grown)
        return PlannerBudget(free, borrowable, adjust_bytes)

    def _ring_growth(self, geometry: Geometry) -> int:
        """What a loan grows the cache by for ``geometry``: the staging ring lives in the cache's top
        slots, so the released memory that the chunk's activations leave free serves as ring slots
        instead of evicting cached experts. More would be mapped only to be unmapped again: prefill
        never fills empty slots (expert_cache.py), and the activations would unmap them first (a 64 MiB
        segment costs ~0.3-0.5 ms each way on the reference H200, 10-20 segments a loan)."""
        costs, segment_bytes = self.planner.costs, self.cache.segment_bytes
        if not costs.is_ring_in_cache:
            return 0
        spare = self.ledger.free_bytes - costs.workspace_bytes(Geometry(geometry.chunk_tokens, 0))
        return max(0, min(spare // segment_bytes, self.cache.segments_for(geometry.ring_slots))) * segment_bytes

    def cache_state(self, is_grown: bool = False) -> CacheState | None:
        """What the expert cache holds now, for the planner's cost model; ``is_grown``: its slots as
        ``budget(is_grown=True)`` counts them."""
        if not self.cache:
            return None
        grown = self.cache.growable_bytes(self.ledger.free_bytes) if is_grown else 0
        return CacheState(self.cache.slots_after_growth(grown), self.cache.num_cached)

    def _plan(self, ctx: LoanContext, is_loan: bool) -> Geometry:
        if not is_loan:
            return self.planner.plan(self.budget(), ctx.request.unread_tokens, self.cache_state())
        adjust_bytes = sum(self.plugins.call("strata_planner_budget", ctx=ctx, budget=self.budget(is_grown=True)))
        budget = self.budget(adjust_bytes, is_grown=True)
        geometry = self.planner.plan(budget, ctx.request.unread_tokens, self.cache_state(is_grown=True))
        chosen = self.plugins.call("strata_planner_geometry", ctx=ctx, geometry=geometry)
        return geometry if chosen is None else chosen

    def _allocate(self, geometry: Geometry) -> tuple[Geometry, int]:
        for num_retries in range(self.config.planner.max_retries + 1):
            try:
                self.workspace.allocate(geometry)
                return geometry, num_retries
            except AllocationError:
                smaller = self.planner.smaller(geometry)
                if smaller is None or num_retries == self.config.planner.max_retries:
                    raise
                geometry = smaller
        raise AssertionError("unreachable")

    def _close(self, ctx: LoanContext, is_loan: bool, released: list[str], captured, cache_bytes_before: int,
               expected: dict[str, int], phases: _PhaseClock) -> None:
        failures: list[str] = []
        phases.mark("prefill")
        for step, phase, action in (("free the workspace", "free", self.workspace.free),
                                    ("shrink the expert cache", "shrink",
                                     lambda: self.cache and self.cache.shrink_to(cache_bytes_before))):
            try:
                action()
            except Exception as exc:
                failures.append(f"{step}: {exc!r}")
            phases.mark(phase)
        failures.extend(self._restore_all(released, raise_now=False))
        phases.mark("restore")
        failures.extend(self._put_back(captured))
        phases.mark("put back")
        if is_loan:
            failures.extend(f"restore hook of {p}: {e!r}" for p, e in
                            self.plugins.call_each_reversed("strata_prefill_restore", ctx=ctx))
            phases.mark("hooks")
        after = {k: v for k, v in self.ledger.snapshot().by_owner.items() if k not in TRANSIENT_OWNERS}
        if after != {k: v for k, v in expected.items() if v and k not in TRANSIENT_OWNERS}:
            diff = {o: after.get(o, 0) - expected.get(o, 0) for o in set(after) | set(expected)}
            failures.append(f"ledger differs from before the loan: {({o: d for o, d in diff.items() if d})}")
        if self.state.capture() != captured:
            failures.append("runtime state differs from before the loan")
        if failures:
            raise LoanRestoreError("the loan could not put everything back: " + "; ".join(failures)
                                   + ". The engine is unhealthy; restart it.")

    def _put_back(self, captured) -> list[str]:
        """The runtime state, tried again like a restore: a restage that failed forgot the slots it
        had not filled, so the next attempt stages them again."""
        for attempt in range(RESTORE_ATTEMPTS):
            try:
                self.state.put_back(captured)
                return []
            except Exception as exc:
                if attempt == RESTORE_ATTEMPTS - 1:
                    return [f"put back the runtime state: {exc!r}"]
        return []

    def _restore_all(self, released: list[str], raise_now: bool = True) -> list[str]:
        failures = []
        for name in reversed(released):
            for attempt in range(RESTORE_ATTEMPTS):
                try:
                    self.resources[name].restore()
                    break
                except Exception as exc:
                    if attempt == RESTORE_ATTEMPTS - 1:
                        failures.append(f"restore {name}: {exc!r}")
        if failures and raise_now:
            raise LoanRestoreError("; ".join(failures))
        return failures


class _PhaseClock:
    """Host seconds between marks, summed by phase name (a phase may recur: restore on entry and exit)."""

    def __init__(self):
        self._last = time.perf_counter()
        self._seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._seconds[phase] = self._seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def without(self, phase: str) -> tuple[tuple[str, float], ...]:
        return tuple((name, seconds) for name, seconds in self._seconds.items() if name != phase)
