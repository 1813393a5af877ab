"""Prefill streams every expert of a layer that is not cached, through a staging ring of a few
slots in alternating halves; the routing never comes back to the host."""

import numpy as np
import pytest
from engine_setup import engine_config, greedy, reference_greedy, write_small_moe

from strata.engine.facade import Engine

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 500, size=90)]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_small_moe(tmp_path_factory.mktemp("models") / "small-moe.gguf")


@pytest.mark.parametrize("ring_slots", [1, 2, 5])
def test_streaming_every_uncached_expert_through_a_small_ring_keeps_the_output(moe_path, ring_slots):
    engine = Engine.load(engine_config(moe_path, planner={"max_chunk_tokens": 32, "max_ring_slots": ring_slots,
                                                          "min_ring_slots": 1}), show_progress=False)
    tokens, stats = greedy(engine, PROMPT, 6)
    assert tokens == reference_greedy(moe_path, PROMPT, 6)
    assert stats.geometry.ring_slots == ring_slots and stats.num_chunks == 3  # 32 + 32 + 26 tokens
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)


def test_prefill_counts_every_expert_of_every_layer_and_never_reads_the_routing(moe_path, monkeypatch):
    engine = Engine.load(engine_config(moe_path, planner={"max_chunk_tokens": 32, "max_ring_slots": 4}),
                         show_progress=False)
    greedy(engine, PROMPT[:40], 4)  # decode fills the cache a little
    to_host_calls = []
    monkeypatch.setattr(engine.ops, "to_host", lambda a: to_host_calls.append(a) or np.asarray(a))
    _, stats = greedy(engine, PROMPT[40:], 1)  # one token: no decode step runs
    spec = engine.spec
    assert [a.shape for a in to_host_calls] == [(1, engine.spec.hidden_size)]  # the last token's hidden state
    assert stats.cache_hits + stats.cache_misses == stats.num_chunks * spec.num_layers * spec.num_experts
    # and after prefill, what the ring's borrowed slots evicted is staged again for decode
    restaged = engine.state.restaged_bytes
    assert stats.cache_hits > 0
    assert stats.streamed_bytes == stats.cache_misses * engine.cache.layout.slot_bytes + restaged


def test_a_chunk_too_short_to_touch_every_expert_streams_only_its_routed_misses(moe_path):
    engine = Engine.load(engine_config(moe_path), show_progress=False)
    tokens, stats = greedy(engine, PROMPT[:3], 1)  # 3 tokens x 4 experts < 32 experts
    assert tokens == reference_greedy(moe_path, PROMPT[:3], 1)
    assert 0 < stats.cache_hits + stats.cache_misses <= engine.spec.num_layers * 3 * engine.spec.num_experts_used


def test_a_layer_timed_prefill_marks_every_layer_and_the_rings_waits_and_keeps_the_output(moe_path):
    engine = Engine.load(engine_config(moe_path, planner={"max_chunk_tokens": 32, "max_ring_slots": 2,
                                                          "min_ring_slots": 1}), show_progress=False)
    from strata.engine.sampling import SamplingParams

    generation = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6), is_timing_layers=True)
    tokens = [event.token_id for event in generation]
    stats = generation.stats
    assert tokens == reference_greedy(moe_path, PROMPT, 6)
    layers = stats.prefill_layers
    assert layers["layers"] == stats.num_chunks * engine.spec.num_layers  # every layer of every chunk
    assert layers["device_ms"] >= layers["attention_ms"] > 0 and layers["moe_ms"] > 0
    assert layers["device_ms"] <= 1e3 * stats.prefill_forward_seconds + 1e-6  # inside the chunks' forward
    assert 0 < stats.prefill_forward_seconds < stats.prefill_seconds
    assert "| prefill device: forward " in stats.timing_line() and "copy stall" in stats.timing_line()
    assert "MTP pass" not in stats.timing_line() and stats.prefill_mtp_seconds == 0  # the model has no MTP block
    untimed = engine.generate(PROMPT[:40], SamplingParams(temperature=0, max_tokens=1))
    list(untimed)
    assert untimed.stats.prefill_layers is None and untimed.stats.prefill_forward_seconds > 0
