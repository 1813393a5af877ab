"""The loan transaction on the engine's own resources (numpy backend)."""


import dataclasses

import numpy as np
import pytest
from engine_setup import (
    LOAN_RUNTIME,
    SMALL_MOE,
    engine_config,
    greedy,
    reference_greedy,
    write_small_moe,
)
from gguf import GGMLQuantizationType as QType

from strata.engine.facade import Engine
from strata.engine.loan.runtime_state import RuntimeSettings
from strata.engine.sampling import SamplingParams
from strata.gpu.ledger import ACTIVATIONS_OWNER
from strata.hooktypes import LoanRequest
from strata.model.synth import write_synthetic_model

ALL_PLUGINS = ["loan_mtp", "loan_head", "retain_startup_chunk", "repeat_loan"]
PROMPTS = [[int(t) for t in np.random.default_rng(seed).integers(3, 500, size=n)]
           for seed, n in ((1, 300), (2, 40), (3, 400))]


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return write_small_moe(tmp_path_factory.mktemp("models") / "small-moe-mtp.gguf", with_mtp=True)


# 256 experts of 442 KiB (110 MiB) against a 140 MiB budget: the cache holds about half of them,
# prefill streams through a ring borrowed from the cache, and a loan grows the cache by a segment
STREAMING = {"vram_budget": "140MiB", "context_tokens": 2048}


@pytest.fixture(scope="module")
def streaming_path(tmp_path_factory):
    spec = dataclasses.replace(SMALL_MOE, num_layers=4, hidden_size=256, num_experts=64, expert_ffn_size=1024)
    return write_synthetic_model(tmp_path_factory.mktemp("models") / "streaming-moe-mtp.gguf", spec, QType.Q4_0,
                                 seed=7, with_mtp=True)


def loan_engine(path, is_loan=True, planner=None, **runtime):
    loan = {"enabled": True, "plugins": ALL_PLUGINS, "repeat_loan": {"min_tokens": 256}} if is_loan else None
    config = engine_config(path, runtime={**LOAN_RUNTIME, **runtime},
                           planner={"max_chunk_tokens": 64, **(planner or {})}, loan=loan)
    return Engine.load(config, show_progress=False)


def test_startup_loan_defers_decode_resources_and_the_first_request_restores_them(mtp_path, monkeypatch):
    engine = loan_engine(mtp_path)
    assert set(engine.resources) == {"verifier", "output_head", "mtp_draft_head", "mtp_experts"}
    assert not any(r.is_resident for r in engine.resources.values())
    encoded = []  # the host copies were packed at load, not inside the first request's restore
    encode = engine.ops.encode_qtensor
    monkeypatch.setattr(engine.ops, "encode_qtensor", lambda *args: encoded.append(args) or encode(*args))
    _, stats = greedy(engine, PROMPTS[0], 4)
    assert encoded == []
    assert stats.loan.is_taken and stats.loan.reason == "startup loan"
    assert stats.loan.released == ("mtp_experts", "mtp_draft_head", "verifier", "output_head")
    assert all(r.is_resident for r in engine.resources.values())
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)


def test_warm_up_runs_while_a_startup_loan_holds_the_head_back(mtp_path):
    engine = loan_engine(mtp_path)
    assert not engine.resources["output_head"].is_resident
    before = dict(engine.ledger.snapshot().by_owner)
    assert engine.warm_up() > 0
    assert dict(engine.ledger.snapshot().by_owner) == before and engine.kv_tokens == []
    tokens, _ = greedy(engine, PROMPTS[1], 4)
    assert tokens == greedy(loan_engine(mtp_path, is_loan=False), PROMPTS[1], 4)[0]


def test_output_with_the_loan_equals_output_without_at_equal_geometry(mtp_path):
    with_loan, without = loan_engine(mtp_path), loan_engine(mtp_path, is_loan=False)
    expected = reference_greedy(mtp_path, PROMPTS[0], 6)
    for prompt in PROMPTS:
        a, a_stats = greedy(with_loan, prompt, 6)
        b, b_stats = greedy(without, prompt, 6)
        assert a == b and a_stats.geometry == b_stats.geometry
    assert [s for s in (a_stats.loan.is_taken, b_stats.loan.is_taken)] == [True, False]
    assert greedy(loan_engine(mtp_path), PROMPTS[0], 6)[0] == expected
    assert dict(with_loan.ledger.snapshot().by_owner) == dict(with_loan.idle_ledger.by_owner)


def test_repeat_loan_only_for_long_unread_prompts(mtp_path):
    engine = loan_engine(mtp_path)
    reasons = [greedy(engine, prompt, 2)[1].loan.reason for prompt in PROMPTS]
    assert reasons == ["startup loan", "40 unread tokens < repeat threshold 256",
                       "repeat loan: 400 unread tokens >= 256"]


def test_the_plan_with_the_loan_is_larger_when_memory_limits_the_chunk(mtp_path):
    # the whole startup cache is kept (keep share 1), so only free memory feeds the workspace
    planner = {"max_chunk_tokens": 8192, "cache_keep_share": 1.0}
    probe = loan_engine(mtp_path, planner=planner, context_tokens=8192)
    deferred = sum(r.num_bytes for r in probe.resources.values())
    assert deferred > 16 * probe.placement.costs.bytes_per_chunk_token  # more than a quantum's bytes
    without = probe.loan.plan_preview(is_loan=False)
    with_loan = probe.loan.plan_preview(is_loan=True)
    assert with_loan.chunk_tokens > without.chunk_tokens
    prompt = PROMPTS[2] * 7
    _, stats = greedy(probe, prompt, 1)
    assert stats.loan.is_taken and stats.geometry.chunk_tokens >= min(with_loan.chunk_tokens, len(prompt))


def test_runtime_state_is_put_back_before_the_first_decoded_token(streaming_path):
    # decode's copies are configured not to overlap; the ring's two halves overlap theirs, and its
    # slots, borrowed from the cache, evict experts decode had cached
    engine = loan_engine(streaming_path, is_loan=False, copy_overlap=False, **STREAMING)
    forced = 123
    engine.state.update(logit_bias=((forced, 1e4),))
    before_settings, before_residency = engine.state.settings, engine.cache.residency()
    seen = []  # (is prefill, copies overlapped, logit bias, cache residency) at every forward

    def recording(tokens, start, workspace, stats, *rest):
        seen.append((workspace is not None, engine.ops.is_copy_overlapped, engine.state.settings.logit_bias,
                     engine.cache.residency()))
        return real_forward(tokens, start, workspace, stats, *rest)

    real_forward = engine.runner.forward
    engine.runner.forward = recording
    tokens, stats = greedy(engine, PROMPTS[0], 3)
    prefill = [s[1:] for s in seen if s[0]]
    decode = [s[1:] for s in seen if not s[0]]
    assert len(prefill) > 1 and all(s[:2] == (True, ()) for s in prefill)  # prefill ran with its own settings
    assert prefill[0][2] != before_residency  # ... and the ring evicted cached experts
    assert decode[0] == (False, before_settings.logit_bias, before_residency)  # decode starts from the captured
    assert tokens[0] == forced  # the logit bias was back for the first token
    evicted = set(before_residency) - set(prefill[0][2])
    assert engine.state.restaged_bytes == len(evicted) * engine.cache.layout.slot_bytes > 0
    assert stats.restaged_bytes == engine.state.restaged_bytes and "restaged" in stats.timing_line()


def test_the_loan_grows_the_cache_and_output_equals_output_without_it(streaming_path):
    with_loan = loan_engine(streaming_path, **STREAMING)
    without = loan_engine(streaming_path, is_loan=False, **STREAMING)
    base_bytes = with_loan.cache.mapped_bytes
    a, a_stats = greedy(with_loan, PROMPTS[0], 4)
    b, b_stats = greedy(without, PROMPTS[0], 4)
    assert a_stats.loan.grown_bytes >= with_loan.config.runtime.vmm_segment_bytes
    assert a_stats.cache_misses > 0 and a_stats.geometry == b_stats.geometry and a == b
    assert with_loan.cache.mapped_bytes == base_bytes
    assert dict(with_loan.ledger.snapshot().by_owner) == dict(with_loan.idle_ledger.by_owner)


def assert_restored_and_served(engine, expected: list[int]) -> None:
    """Every loaned resource back, the ledger idle, decode's settings put back; then PROMPTS[0] prefilled whole
    gives ``expected``."""
    assert all(r.is_resident for r in engine.resources.values())
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)
    assert engine.state.settings == RuntimeSettings(copy_overlap=engine.config.runtime.copy_overlap)
    assert engine.counters.restored_bytes == engine.counters.released_bytes > 0
    tokens, stats = greedy(engine, PROMPTS[0], 4)
    assert tokens == expected and stats.unread_tokens == len(PROMPTS[0])


def test_a_failure_mid_prefill_restores_every_resource_and_the_next_request_is_served(mtp_path):
    engine = loan_engine(mtp_path)
    expected, _ = greedy(loan_engine(mtp_path), PROMPTS[0], 4)
    real_forward = engine.runner.forward
    calls = []

    def failing(tokens, start, workspace, stats, *rest):
        calls.append(start)
        if len(calls) == 3:
            raise RuntimeError("injected kernel failure")
        return real_forward(tokens, start, workspace, stats, *rest)

    engine.runner.forward = failing
    with pytest.raises(RuntimeError, match="injected"):
        greedy(engine, PROMPTS[0], 4)
    assert engine.counters.num_failed_requests == 1 and engine.counters.num_loans_failed == 1
    assert_restored_and_served(engine, expected)


def test_a_request_cancelled_mid_prefill_ends_at_the_next_layer_restored_and_the_next_request_is_served(mtp_path):
    engine = loan_engine(mtp_path)
    expected, _ = greedy(loan_engine(mtp_path), PROMPTS[0], 4)
    asked = []

    def is_cancelled():  # asked before every prefill layer (and after every decoded token)
        asked.append(len(asked))
        return len(asked) > 3  # before the fourth layer the prefill runs

    generation = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), is_cancelled)
    assert list(generation) == []
    stats = generation.stats
    assert stats.finish_reason == "cancelled" and stats.generated_tokens == 0 and len(asked) == 4
    assert engine.spec.num_layers == 3  # so the first chunk ran whole, and the second stopped at its first layer
    assert stats.loan.is_taken and stats.num_chunks == 1 and stats.unread_tokens == 64 and stats.is_prefill_cut
    assert engine.counters.num_completed_prefills == 0 and engine.counters.last_prefill_tokens_per_s == 0
    assert engine.counters.num_failed_requests == 0 and engine.counters.num_requests == 1
    assert_restored_and_served(engine, expected)  # nothing of the cut prefill is reused


def test_a_cancel_while_the_ring_streams_puts_the_cache_back(streaming_path):
    # no loan: the chunk's ring borrows cache segments, and the cancel comes in the middle of a chunk's layers
    engine = loan_engine(streaming_path, is_loan=False, **STREAMING)
    expected, _ = greedy(loan_engine(streaming_path, is_loan=False, **STREAMING), PROMPTS[2], 4)
    residency = engine.cache.residency()
    asked = []
    generation = engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=4),
                                 lambda: asked.append(0) or len(asked) > engine.spec.num_layers + 2)
    assert list(generation) == [] and generation.stats.finish_reason == "cancelled"
    assert generation.stats.prefill_streamed_bytes > 0  # the ring had streamed
    assert engine.cache.residency() == residency
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)
    assert greedy(engine, PROMPTS[2], 4)[0] == expected


def test_admission_fails_before_anything_is_loaded(mtp_path):
    from strata.errors import AdmissionError

    with pytest.raises(AdmissionError, match="runtime.vram_elastic = False"):
        loan_engine(mtp_path, vram_elastic=False)


def test_without_the_loan_prefill_borrows_cache_segments_and_stages_them_back(streaming_path):
    # free memory holds a few quanta of activations; the chunk unmaps cache segments for the rest,
    # and decode finds the cache, the ledger and the output as if it had not
    planner, runtime = {"max_chunk_tokens": 1024, "cache_keep_share": 0.25}, {**STREAMING, "vmm_segment": "2MiB"}
    engine = loan_engine(streaming_path, is_loan=False, planner=planner, **runtime)
    narrow = loan_engine(streaming_path, is_loan=False, planner={**planner, "max_chunk_tokens": 16}, **runtime)
    costs = engine.planner.costs
    free_only_tokens = engine.ledger.free_bytes // costs.bytes_per_chunk_token
    mapped, num_cached = engine.cache.mapped_bytes, engine.cache.num_cached
    tokens, stats = greedy(engine, PROMPTS[2], 4)
    assert stats.geometry.chunk_tokens > free_only_tokens and stats.num_chunks == 1
    assert stats.restaged_bytes >= costs.segment_bytes // 2  # the unmapped segments' experts came back
    assert engine.cache.mapped_bytes == mapped and engine.cache.num_cached == num_cached  # decode found it full
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)
    assert tokens == greedy(narrow, PROMPTS[2], 4)[0]


class ChargedWhileAlive:
    """A device temporary as the GPU backend's are: charged to the ledger until it is collected."""

    def __init__(self, ledger, num_bytes: int):
        self._ledger, self._charge = ledger, ledger.charge(ACTIVATIONS_OWNER, num_bytes)

    def __del__(self):
        self._ledger.discharge(self._charge)


def test_a_prefill_failing_with_its_activations_alive_still_maps_the_cache_back(streaming_path):
    # the failing forward's frames hold every byte that is free once the chunk has unmapped cache
    # segments; the loan must still map them back, so the request fails alone
    planner, runtime = {"max_chunk_tokens": 1024, "cache_keep_share": 0.25}, {**STREAMING, "vmm_segment": "2MiB"}
    engine = loan_engine(streaming_path, is_loan=False, planner=planner, **runtime)
    expected = greedy(loan_engine(streaming_path, is_loan=False, planner=planner, **runtime), PROMPTS[2], 4)[0]
    engine.ops.is_activation_charged = True  # as on the GPU: the workspace reserves nothing for them
    real_forward = engine.runner.forward

    def failing(tokens, start, workspace, stats, *rest):
        assert workspace.unmapped_bytes > 0
        activations = ChargedWhileAlive(engine.ledger, engine.ledger.free_bytes)  # noqa: F841 (held by the frame)
        raise RuntimeError("a kernel failed")

    engine.runner.forward = failing
    with pytest.raises(RuntimeError, match="a kernel failed"):
        greedy(engine, PROMPTS[2], 4)
    engine.runner.forward = real_forward
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)
    assert greedy(engine, PROMPTS[2], 4)[0] == expected


def test_the_head_alias_lends_the_output_head_to_every_prefill_without_the_loan(tmp_path):
    # a 32k vocabulary makes the head worth 200 chunk tokens; the budget leaves the chunk ~400
    spec = dataclasses.replace(SMALL_MOE, vocab_size=32768)
    path = write_synthetic_model(tmp_path / "wide-head.gguf", spec, QType.Q4_0, seed=7, with_mtp=True)
    aliased, plain = (loan_engine(path, is_loan=False, planner={"max_chunk_tokens": 1024, "cache_keep_share": 1.0},
                                  vram_budget="76MiB", prefill_head_alias=is_alias) for is_alias in (True, False))
    gained_tokens = aliased.loan.plan_preview(is_loan=False).chunk_tokens - plain.loan.startup_geometry.chunk_tokens
    head_tokens = aliased.resources["output_head"].num_bytes / aliased.placement.costs.bytes_per_chunk_token
    assert head_tokens > 100 and abs(gained_tokens - head_tokens) <= aliased.config.planner.chunk_quantum_tokens
    prompt = PROMPTS[0] + PROMPTS[2][:200]  # 500 tokens: one chunk with the alias, two without
    a, a_stats = greedy(aliased, prompt, 4)
    b, b_stats = greedy(plain, prompt, 4)
    assert (a_stats.num_chunks, b_stats.num_chunks) == (1, 2) and a == b
    assert "runtime.prefill_head_alias" in a_stats.loan.reason and not a_stats.loan.is_taken
    assert aliased.resources["output_head"].is_resident
    assert dict(aliased.ledger.snapshot().by_owner) == dict(aliased.idle_ledger.by_owner)


def test_the_cost_gate_takes_the_loan_where_it_is_predicted_to_pay_and_the_output_is_unchanged(streaming_path):
    # the engine's own choice: no threshold plugin. In 120 MiB a 1,200-token prompt prefills in one chunk
    # with the loan and in two without; a 40-token one is one chunk either way, and there the loan saves
    # only the MTP block's pass over the prompt
    runtime = {**LOAN_RUNTIME, "vram_budget": "120MiB", "context_tokens": 2048}
    config = engine_config(streaming_path, runtime=runtime,
                           loan={"enabled": True, "plugins": ["loan_mtp", "loan_head", "retain_startup_chunk",
                                                              "cost_gate"]})
    gated = Engine.load(config, show_progress=False)
    plain = Engine.load(engine_config(streaming_path, runtime=runtime), show_progress=False)
    for index, prompt in enumerate((PROMPTS[0] * 4, PROMPTS[1], PROMPTS[2] * 3)):
        prediction = gated.loan.predict(LoanRequest(index, len(prompt), len(prompt), is_startup_loan=index == 0))
        assert (prediction.on_geometry.chunk_tokens > prediction.off_geometry.chunk_tokens) == (len(prompt) == 1200)
        tokens, stats = greedy(gated, prompt, 4)
        assert tokens == greedy(plain, prompt, 4)[0]
        assert stats.loan.reason.startswith("cost model: "), stats.loan.reason
        assert stats.loan.is_taken == (prediction.gain_seconds > 0)
        if len(prompt) == 1200:
            assert stats.loan.is_taken  # one chunk instead of two
        assert {k: v for k, v in gated.ledger.snapshot().by_owner.items() if v} == \
            {k: v for k, v in gated.idle_ledger.by_owner.items() if v}
