"""The loan's cost prediction (``LoanContext.predict``) and the cost_gate plugin that decides by it."""

import pytest
from fakes import MIB, FakeEngine
from loan_setup import ALL_RESOURCES_MIB, make_config, make_host

from strata.config import PlannerConfig
from strata.engine.loan.transaction import DEFAULT_LOAN_OVERHEAD_SECONDS
from strata.engine.planning.prefill_cost import PrefillCostModel
from strata.engine.planning.rates import PrefillRates
from strata.hooktypes import LoanRequest

GATED = ["loan_mtp", "loan_head", "retain_startup_chunk", "cost_gate"]  # the engine's own choice: no threshold


def _cost_model() -> PrefillCostModel:
    # 2,048 expert slots of the fakes' 4 MiB, none cached: every chunk streams 8 GiB (~0.16 s), so each
    # chunk the loan's bigger plan saves is worth far more than the host's noise in the measured overhead
    return PrefillCostModel(weight_flops_per_token=6e7, attention_flops_per_pair=0.0, num_expert_slots=2048,
                            slot_bytes=4 * MIB, pcie_bytes_per_s=55e9, compute_flops_per_s=200e12,
                            chunk_overhead_s=0.01)


def started(plugins=GATED, cost_model=True, tables=None, resident_mib=2048, cache_mib=1024):
    config = make_config(loan={"plugins": plugins, **(tables or {})})
    host, config = make_host(config)
    engine = FakeEngine(config, host, ALL_RESOURCES_MIB, resident_mib=resident_mib, cache_mib=cache_mib,
                        cost_model=_cost_model() if cost_model else None,
                        rates=PrefillRates.from_config(PlannerConfig(), None) if cost_model else None)
    engine.loan.start()
    return engine


def test_without_a_cost_model_there_is_no_prediction_and_the_gate_does_not_vote():
    engine = started(cost_model=False)
    assert engine.loan.predict(LoanRequest(0, 100_000, 100_000, is_startup_loan=True)) is None
    _, report = engine.prefill(100_000)
    assert report.is_taken and report.reason == "startup loan"


def test_a_long_prompt_takes_the_loan_its_bigger_chunk_pays_for():
    engine = started()
    prediction = engine.loan.predict(LoanRequest(0, 100_000, 100_000, is_startup_loan=True))
    assert prediction.on_geometry.chunk_tokens > prediction.off_geometry.chunk_tokens
    assert prediction.on_seconds < prediction.off_seconds and prediction.gain_seconds > 0
    assert prediction.reload_seconds == DEFAULT_LOAN_OVERHEAD_SECONDS  # a startup loan's uploads happen anyway
    _, report = engine.prefill(100_000)
    assert report.is_taken and report.reason.startswith("cost model: the loan saves")


def test_a_prompt_the_loan_off_chunk_holds_skips_the_loan():
    engine = started()
    prediction = engine.loan.predict(LoanRequest(0, 2_000, 2_000, is_startup_loan=True))
    assert prediction.on_geometry == prediction.off_geometry and prediction.gain_seconds < 0
    _, report = engine.prefill(2_000)
    assert not report.is_taken and report.reason.startswith("cost model: the loan would not pay")
    assert all(r.is_resident for r in engine.resources.values())  # a vetoed startup loan restored all


def test_a_repeat_loan_pays_for_uploading_what_it_releases_and_the_overhead_is_learnt():
    engine = started()
    _, first = engine.prefill(100_000)  # loan
    loan_only = sum(seconds for name, seconds in first.phase_seconds if name in ("release", "grow", "shrink", "hooks"))
    engine.prefill(2_000)  # no loan: its phases do not count
    assert engine.loan.overhead_seconds() == pytest.approx(loan_only)
    prediction = engine.loan.predict(LoanRequest(2, 100_000, 100_000, is_startup_loan=False))
    released_bytes = sum(ALL_RESOURCES_MIB.values()) * MIB
    assert prediction.reload_seconds == pytest.approx(loan_only + released_bytes / 55e9, rel=1e-6)
    assert prediction.gain_seconds > 0.1  # whatever the host's timing noise in the overhead
    _, report = engine.prefill(100_000)
    assert report.is_taken and "ms of loan against" in report.reason


def test_a_request_only_the_loans_memory_can_plan_takes_it():
    engine = started(resident_mib=6200, cache_mib=128)  # 64 MiB free when idle: no workspace fits without the loan
    prediction = engine.loan.predict(LoanRequest(0, 100_000, 100_000, is_startup_loan=True))
    assert prediction.off_geometry is None and prediction.gain_seconds == float("inf")
    _, report = engine.prefill(100_000)
    assert report.is_taken and "only the loan fits a plan" in report.reason


def test_min_gain_raises_the_bar_and_a_skip_wins_over_repeat_loans_run():
    strict = started(tables={"cost_gate": {"min_gain": 0.5}})
    _, report = strict.prefill(100_000)
    assert not report.is_taken and "would not pay" in report.reason
    both = started(plugins=[*GATED, "repeat_loan"])
    both.prefill(100_000)
    _, report = both.prefill(3_000)  # repeat_loan votes run (>= 1,024), the gate votes skip
    assert not report.is_taken and "cost model" in report.reason


def test_min_gain_outside_its_range_is_refused_naming_the_key():
    from strata.errors import ConfigError

    with pytest.raises(ConfigError, match="min_gain"):
        started(tables={"cost_gate": {"min_gain": 0.9}})


def test_the_mtp_blocks_prompt_pass_costs_its_input_and_qkv_projections_alone():
    from strata.model.synth import PRESETS

    spec = PRESETS["qwen3-30b-a3b"].spec(with_mtp=True)
    model = PrefillCostModel.from_spec(spec, 1 << 20, pcie_bytes_per_s=55e9, compute_flops_per_s=1e14,
                                      chunk_overhead_s=0.0)
    d = spec.hidden_size
    per_token = 2.0 * (2 * d * d + d * (spec.q_size + 2 * spec.kv_size))  # eh_proj [2D -> D] and Q, K, V
    assert model.mtp_share(spec) == per_token / model.weight_flops_per_token
    assert model.mtp_share(spec) < 0.5 / spec.num_layers  # a third of a layer with its experts here


def test_the_mtp_pass_is_saved_by_the_loan_only_where_the_loan_holds_what_it_reads():
    engine = started()
    engine.loan.mtp_prefill_share = 0.01
    request = LoanRequest(0, 100_000, 100_000, is_startup_loan=True)
    model = engine.loan.planner.cost_model  # at the rates' compute figure
    mtp_seconds = 0.01 * 100_000 * model.weight_flops_per_token / model.compute_flops_per_s
    engine.loan.is_mtp_prompt_kept = False  # a block with an embedding of its own: loan_mtp lends the pass
    lent = engine.loan.predict(request)
    engine.loan.is_mtp_prompt_kept = True  # its tensors resident outside the loan: the pass runs in both plans
    kept = engine.loan.predict(request)
    assert kept.off_seconds == pytest.approx(lent.off_seconds)
    assert kept.on_seconds - lent.on_seconds == pytest.approx(mtp_seconds)
    assert lent.gain_seconds - kept.gain_seconds == pytest.approx(mtp_seconds)
