import dataclasses

import pytest
from fakes import MIB, FakeEngine
from loan_setup import ALL_RESOURCES_MIB, make_config, make_host

from strata.engine.loan.runtime_state import RuntimeSettings
from strata.engine.loan.transaction import RESTORE_ATTEMPTS
from strata.errors import AllocationError, LoanRestoreError, PluginError
from strata.hooks import hookimpl
from strata.hooktypes import Geometry

RELEASE_ORDER = ["mtp_experts", "mtp_draft_head", "verifier", "output_head"]


def started(runtime=None, loan=None, extra=None, **engine_args):
    host, config = make_host(make_config(runtime=runtime or {}, loan=loan or {}), extra)
    engine = FakeEngine(config, host, ALL_RESOURCES_MIB, **engine_args)
    engine.loan.start()
    return engine


def idle_ledger(engine):
    """The ledger with every resource resident, the cache at its base and no workspace."""
    by_owner = {"dense_weights": 2048 * MIB, "expert_cache": engine.cache.base_bytes}
    by_owner.update({name: mib * MIB for name, mib in ALL_RESOURCES_MIB.items()})
    return by_owner


def assert_back_to_idle(engine):
    assert dict(engine.ledger.snapshot().by_owner) == idle_ledger(engine)
    assert engine.state.settings == RuntimeSettings()
    assert all(r.is_resident for r in engine.resources.values())
    assert engine.cache.mapped_bytes == engine.cache.base_bytes


class Recorder:
    """Records every loan hook it sees."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def strata_loan_decide(self, ctx):
        self.calls.append("decide")

    @hookimpl
    def strata_prefill_release(self, ctx):
        self.calls.append("release")

    @hookimpl
    def strata_planner_budget(self, ctx, budget):
        self.calls.append("budget")

    @hookimpl
    def strata_planner_geometry(self, ctx, geometry):
        self.calls.append("geometry")

    @hookimpl
    def strata_prefill_restore(self, ctx):
        self.calls.append("restore")


def test_master_switch_off_runs_no_hook_and_plans_as_without_plugins():
    recorder = Recorder()
    off = started(loan={"enabled": False, "plugins": None})
    off.loan.plugins.pm.register(recorder, name="recorder")  # even a registered plugin is never called
    bare = started(loan={"enabled": False, "plugins": None})
    geometry, report = off.prefill(100_000)
    assert recorder.calls == [] and not report.is_taken and report.reason == "loan.enabled is false"
    assert geometry == bare.prefill(100_000)[0]
    assert "release:" not in " ".join(off.history)
    assert_back_to_idle(off)


def test_startup_defers_in_plugin_order_and_the_first_request_restores_in_reverse():
    engine = started()
    assert engine.history == []  # deferred resources were never loaded
    assert [n for n, r in engine.resources.items() if r.is_resident] == []
    geometry, report = engine.prefill(40_000)
    assert report.is_taken and report.reason == "startup loan"
    assert report.released == tuple(RELEASE_ORDER)
    restores = [h.split(":")[1] for h in engine.history if h.startswith("restore:")]
    assert restores == RELEASE_ORDER[::-1]
    assert engine.history.index("free") < engine.history.index(f"shrink:{engine.cache.base_bytes // MIB}MiB") \
        < engine.history.index("restore:output_head")
    assert_back_to_idle(engine)


def test_loan_plan_is_larger_than_the_plan_without_it():
    loan = started()
    loan_geometry, _ = loan.prefill(100_000)
    plain = started(loan={"enabled": False, "plugins": None})
    plain_geometry, _ = plain.prefill(100_000)
    assert loan_geometry.chunk_tokens > plain_geometry.chunk_tokens
    assert loan.loan.plan_preview(is_loan=False) == plain_geometry


def test_later_requests_repeat_only_at_the_threshold():
    engine = started()
    engine.prefill(10)  # first request: the startup loan runs whatever its length
    engine.history.clear()
    _, short = engine.prefill(5_000, unread_tokens=1_023)
    assert not short.is_taken and short.reason == "1,023 unread tokens < repeat threshold 1,024"
    assert not any(h.startswith("release:") for h in engine.history)
    _, long = engine.prefill(5_000, unread_tokens=1_024)
    assert long.is_taken and long.reason == "repeat loan: 1,024 unread tokens >= 1,024"
    releases = [h.split(":")[1] for h in engine.history if h.startswith("release:")]
    restores = [h.split(":")[1] for h in engine.history if h.startswith("restore:")]
    assert releases == RELEASE_ORDER and restores == RELEASE_ORDER[::-1]
    assert_back_to_idle(engine)


@pytest.mark.parametrize("unread, is_taken", [(255, False), (256, True)])
def test_repeat_threshold_at_its_minimum(unread, is_taken):
    engine = started(loan={"repeat_loan": {"min_tokens": 256}})
    engine.prefill(10)
    assert engine.prefill(10_000, unread_tokens=unread)[1].is_taken is is_taken


@pytest.mark.parametrize("unread, is_taken", [(1_023, False), (1_024, True)])
def test_repeat_threshold_default(unread, is_taken):
    engine = started()
    engine.prefill(10)
    assert engine.prefill(10_000, unread_tokens=unread)[1].is_taken is is_taken


def test_without_repeat_loan_later_requests_never_loan():
    engine = started(loan={"plugins": ["loan_mtp", "loan_head"]})
    assert engine.prefill(100)[1].is_taken
    _, report = engine.prefill(90_000)
    assert not report.is_taken and report.reason == "no plugin asked for a repeat loan"


def test_retain_startup_chunk_keeps_the_startup_geometry_for_the_first_request():
    retained = started()
    startup = retained.loan.startup_geometry
    geometry, _ = retained.prefill(90_000)
    assert geometry == startup and geometry.chunk_tokens > 512
    short = started()
    assert short.prefill(300)[0] == dataclasses.replace(startup, chunk_tokens=512)  # capped at the prompt, in quanta
    replanned = started(loan={"plugins": ["loan_mtp", "loan_head", "repeat_loan"]})
    assert replanned.prefill(300)[0].chunk_tokens == 512


def test_runtime_state_changed_by_prefill_is_put_back():
    engine = started()
    engine.state.update(logit_bias=((7, 2.0),), copy_overlap=True)
    before = engine.state.capture()
    engine.prefill(2_000)
    assert engine.state.capture() == before
    assert engine.residency.evicted == 0 and engine.state.restaged_bytes == 3 * MIB
    # the residency comes back once the workspace has given the cache's slots back and the cache shrank
    assert engine.history.index("free") < engine.history.index("restage:3")
    assert engine.history.index(f"shrink:{engine.cache.base_bytes // MIB}MiB") < engine.history.index("restage:3")


def test_a_residency_that_fails_to_stage_once_is_staged_again():
    engine = started()
    engine.faults.arm("residency", times=RESTORE_ATTEMPTS - 1)
    engine.prefill(2_000)
    assert engine.state.settings == RuntimeSettings()
    assert all(r.is_resident for r in engine.resources.values())


def test_a_residency_that_cannot_be_staged_again_says_the_engine_is_unhealthy():
    engine = started()
    engine.faults.arm("residency", times=RESTORE_ATTEMPTS)
    with pytest.raises(LoanRestoreError, match="put back the runtime state.*injected fault at residency"):
        engine.prefill(2_000)
    assert engine.state.settings == RuntimeSettings()  # settings come back before the residency is tried
    assert all(r.is_resident for r in engine.resources.values())


class Give:
    @hookimpl
    def strata_planner_budget(self, budget):
        return 256 * MIB


def test_budget_adjustments_are_summed():
    class Take:
        @hookimpl
        def strata_planner_budget(self, ctx, budget):
            return -1024 * MIB

    plain = started(loan={"plugins": []})
    adjusted = started(loan={"plugins": ["give", "take"]}, extra={"give": Give(), "take": Take()})
    delta = plain.prefill(100_000)[0].chunk_tokens - adjusted.prefill(100_000)[0].chunk_tokens
    assert delta * plain.costs.bytes_per_chunk_token == pytest.approx(768 * MIB, abs=256 * 512 * 1024)


def test_allocation_failures_retry_smaller_geometries_bounded():
    engine = started()
    expected = engine.loan.plan_preview(is_loan=True)
    engine.faults.arm("allocate", times=3, error=AllocationError)
    geometry, report = engine.prefill(100_000)
    assert report.num_retries == 3
    assert geometry.chunk_tokens <= expected.chunk_tokens - 3 * 256
    assert_back_to_idle(engine)


def test_allocation_failures_beyond_the_bound_fail_the_request_and_restore():
    engine = started()
    engine.faults.arm("allocate", times=engine.loan.config.planner.max_retries + 1, error=AllocationError)
    with pytest.raises(AllocationError):
        engine.prefill(100_000)
    assert_back_to_idle(engine)
    assert engine.prefill(100_000)[1].is_taken  # the next request is served, repeating the loan
    assert_back_to_idle(engine)


FAULT_POINTS = ["release:mtp_experts", "release:output_head", "grow", "plan", "allocate", "prefill",
                "budget", "geometry"]


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_fault_at_any_step_restores_everything(point):
    class Faulty:
        @hookimpl
        def strata_planner_budget(self, ctx, budget):
            engine.faults.check("budget")

        @hookimpl
        def strata_planner_geometry(self, ctx, geometry):
            engine.faults.check("geometry")

    engine = started(loan={"plugins": ["loan_mtp", "loan_head", "repeat_loan", "faulty"]}, extra={"faulty": Faulty()})
    engine.prefill(10)  # the startup loan
    real_plan = engine.planner.plan

    def plan(*args):
        engine.faults.check("plan")
        return real_plan(*args)

    engine.planner.plan = plan
    engine.faults.arm(point, times=1)
    with pytest.raises((RuntimeError, PluginError)):
        engine.prefill(50_000)
    assert_back_to_idle(engine)
    _, report = engine.prefill(50_000)  # the next request is served, with the loan
    assert report.is_taken
    assert_back_to_idle(engine)


@pytest.mark.parametrize("name", RELEASE_ORDER)
def test_a_failed_restore_is_retried(name):
    engine = started()
    engine.faults.arm(f"restore:{name}", times=2)
    engine.prefill(3_000)
    assert_back_to_idle(engine)


@pytest.mark.parametrize("name", RELEASE_ORDER)
def test_a_restore_that_keeps_failing_restores_the_rest_and_says_the_engine_is_unhealthy(name):
    engine = started()
    engine.faults.arm(f"restore:{name}", times=99)
    with pytest.raises(LoanRestoreError, match=f"restore {name}.*ledger differs.*restart it"):
        engine.prefill(3_000)
    others = [r for n, r in engine.resources.items() if n != name]
    assert all(r.is_resident for r in others) and not engine.resources[name].is_resident
    assert engine.state.settings == RuntimeSettings()


def test_a_failing_restore_hook_does_not_stop_the_others():
    class Broken:
        @hookimpl
        def strata_prefill_restore(self, ctx):
            raise ValueError("boom")

    recorder = Recorder()
    engine = started(loan={"plugins": ["recorder", "broken"]}, extra={"recorder": recorder, "broken": Broken()})
    with pytest.raises(LoanRestoreError, match="restore hook of broken: ValueError"):
        engine.prefill(1_000)
    assert recorder.calls[-1] == "restore"


def test_hooks_run_in_allow_list_order_and_restore_in_reverse():
    order = []

    def plugin(tag):
        class P:
            @hookimpl
            def strata_prefill_release(self, ctx):
                order.append(f"release {tag}")

            @hookimpl
            def strata_prefill_restore(self, ctx):
                order.append(f"restore {tag}")
        return P()

    started(loan={"plugins": ["b", "a", "c"]}, extra={n: plugin(n) for n in "abc"}).prefill(1_000)
    # start() asks release hooks once for the startup loan, then the request asks again.
    assert order == ["release b", "release a", "release c"] * 2 + ["restore c", "restore a", "restore b"]


@pytest.mark.parametrize("plugins, who", [(["greedy"], "plugin 'greedy'"),
                                          (["loan_mtp", "greedy"], "plugin 'loan_mtp' or 'greedy'")])
def test_unknown_resource_named_by_a_plugin(plugins, who):
    class Greedy:
        @hookimpl
        def strata_prefill_release(self, ctx):
            return ["kv_cache"]

    host, config = make_host(make_config(loan={"plugins": plugins}), {"greedy": Greedy()})
    engine = FakeEngine(config, host, ALL_RESOURCES_MIB)
    with pytest.raises(PluginError, match=f"{who} asked to release 'kv_cache'.*offered: verifier"):
        engine.loan.start()


def test_pluggy_marks_hold_a_wrapper_alters_the_release_list_and_tryfirst_runs_first():
    order = []

    def releasing(tag, names, **marks):
        class P:
            @hookimpl(**marks)
            def strata_prefill_release(self, ctx):
                order.append(tag)
                return names
        return P()

    class KeepHead:
        @hookimpl(wrapper=True)
        def strata_prefill_release(self, ctx):
            order.append("wrapper in")
            asked = yield
            order.append(f"wrapper saw {asked}")
            return [[name for name in names if name != "output_head"] for names in asked]

    plugins = {"keep_head": KeepHead(), "a": releasing("a", ["mtp_experts", "output_head"]),
               "b": releasing("b", ["mtp_draft_head"]), "early": releasing("early", ["verifier"], tryfirst=True)}
    engine = started(loan={"plugins": list(plugins)}, extra=plugins)
    engine.history.clear()
    _, report = engine.prefill(1_000)
    saw = "wrapper saw [['verifier'], ['mtp_experts', 'output_head'], ['mtp_draft_head']]"
    # start() asks once for the startup loan, then the request asks again
    assert order == ["wrapper in", "early", "a", "b", saw] * 2
    assert report.released == ("verifier", "mtp_experts", "mtp_draft_head")
    assert [h for h in engine.history if h.startswith("restore:")] == [
        "restore:mtp_draft_head", "restore:mtp_experts", "restore:verifier"]
    assert_back_to_idle(engine)


def test_planner_geometry_is_firstresult_with_tryfirst_before_allow_list_order():
    called = []

    def choosing(tag, result, **marks):
        class P:
            @hookimpl(**marks)
            def strata_planner_geometry(self, ctx, geometry):
                called.append(tag)
                return result
        return P()

    plugins = {"abstains": choosing("abstains", None), "first": choosing("first", Geometry(1024, 16)),
               "second": choosing("second", Geometry(2048, 16)), "early": choosing("early", None, tryfirst=True),
               "late": choosing("late", Geometry(4096, 16), trylast=True)}
    engine = started(loan={"plugins": list(plugins)}, extra=plugins)
    geometry, _ = engine.prefill(100_000)
    assert geometry == Geometry(1024, 16) and called == ["early", "abstains", "first"]
    assert_back_to_idle(engine)


class FailsInBudget:
    @hookimpl
    def strata_planner_budget(self, ctx, budget):
        raise ValueError("boom")


class FailsAroundBudget:
    @hookimpl(wrapper=True)
    def strata_planner_budget(self, ctx, budget):
        yield
        raise ValueError("boom")


@pytest.mark.parametrize("failing", [FailsInBudget, FailsAroundBudget])
def test_a_failing_hook_among_others_is_named(failing):
    plugins = {"failing": failing(), "give": Give()}
    engine = started(loan={"plugins": ["loan_mtp", "failing", "give", "repeat_loan"]}, extra=plugins)
    with pytest.raises(PluginError, match=r"plugin 'failing' failed in strata_planner_budget: ValueError\('boom'\)"):
        engine.prefill(1_000)
    assert_back_to_idle(engine)


def test_the_report_times_each_phase_of_the_transaction():
    engine = started()
    _, report = engine.prefill(40_000)
    phases = [name for name, _ in report.phase_seconds]
    assert phases == ["decide", "release", "plan", "grow", "allocate", "free", "shrink", "restore", "put back",
                      "hooks"]
    assert all(seconds >= 0 for _, seconds in report.phase_seconds)
    slow = dataclasses.replace(report, phase_seconds=(("restore", 0.0123), ("plan", 0.0001)))
    assert slow.summary().endswith("[ms: restore 12.3]")  # phases under half a millisecond are not shown
    _, off = started(loan={"enabled": False, "plugins": None}).prefill(40_000)
    # a phase that recurs (restore: what a vetoed loan gives back, then after prefill) is summed under one name
    assert [name for name, _ in off.phase_seconds] == ["decide", "restore", "plan", "allocate", "free", "shrink",
                                                        "put back"]


def _ring_growth_expected(engine, free_bytes: int, geometry: Geometry) -> int:
    segment = engine.cache.segment_bytes
    spare = free_bytes - engine.costs.workspace_bytes(Geometry(geometry.chunk_tokens, 0))
    return max(0, min(spare // segment, engine.cache.segments_for(geometry.ring_slots))) * segment


@pytest.mark.parametrize("slots_per_segment", [None, 14])
def test_the_cache_grows_by_what_the_ring_can_use_of_the_memory_the_activations_leave(slots_per_segment):
    engine = started(cache_slots_per_segment=slots_per_segment)
    free = engine.ledger.free_bytes  # the startup loan's resources are already deferred
    slots_before = engine.cache.num_slots
    geometry, report = engine.prefill(1_000)
    # a short chunk leaves most of the released memory free: segments holding the ring's slots, no more
    # (with 14 slots a segment, as when each plane rounds up to the mapping granularity, more segments)
    assert geometry.ring_slots > 0 and report.grown_bytes == _ring_growth_expected(engine, free, geometry)
    grown_slots = engine.cache.slots_after_growth(report.grown_bytes) - slots_before
    assert geometry.ring_slots <= grown_slots < geometry.ring_slots + engine.cache.slots_per_segment
    assert f"grow:{report.grown_bytes // MIB}MiB" in engine.history
    assert_back_to_idle(engine)


def test_the_cache_does_not_grow_when_the_chunks_activations_take_the_released_memory():
    engine = started()
    free = engine.ledger.free_bytes
    geometry, report = engine.prefill(100_000)
    assert engine.costs.workspace_bytes(Geometry(geometry.chunk_tokens, 0)) >= free
    assert report.grown_bytes == 0 and not any(h.startswith("grow:") and h != "grow:0MiB" for h in engine.history)
    assert_back_to_idle(engine)
