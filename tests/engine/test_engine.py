"""The whole engine on the numpy backend: streaming, evictions, chunks, prefix reuse, the ledger."""

import numpy as np
import pytest
from engine_setup import engine_config, greedy, reference_greedy, write_small_moe

from strata.engine.facade import Engine
from strata.engine.planning.rates import ASSUMED_COMPUTE_FLOPS_PER_S
from strata.errors import RequestError

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 500, size=90)]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_small_moe(tmp_path_factory.mktemp("models") / "small-moe.gguf")


@pytest.fixture(scope="module")
def expected(moe_path):
    return reference_greedy(moe_path, PROMPT, 12)


def test_greedy_output_equals_the_reference_while_streaming_and_evicting(moe_path, expected):
    engine = Engine.load(engine_config(moe_path, planner={"max_chunk_tokens": 32}), show_progress=False)
    assert engine.cache.num_slots < 96  # not every expert fits: prefill streams, decode evicts
    tokens, stats = greedy(engine, PROMPT, 12)
    assert tokens == expected
    assert stats.num_chunks == 3 and stats.geometry.chunk_tokens == 32
    assert stats.streamed_bytes > 0 and stats.cache_misses > 0
    greedy(engine, PROMPT[::-1], 30)
    assert engine.cache.num_evictions > 0 and engine.cache.num_cached == engine.cache.num_slots
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)


def test_the_cache_is_filled_at_load_with_an_equal_share_of_every_layer(moe_path, expected):
    engine = Engine.load(engine_config(moe_path), show_progress=False)
    cache, spec = engine.cache, engine.spec
    assert 0 < cache.num_slots < spec.num_layers * spec.num_experts and cache.num_cached == cache.num_slots
    share = cache.num_slots // spec.num_layers
    table = cache.slot_table(spec.num_layers, spec.num_experts)  # [L, N], read before any lookup
    for layer in range(spec.num_layers):
        assert all(cache.lookup(layer, e) >= 0 for e in range(share))
        assert table[layer].tolist() == [cache.lookup(layer, e) for e in range(spec.num_experts)]
    assert np.count_nonzero(table >= 0) == cache.num_cached
    tokens, stats = greedy(engine, PROMPT, 12)
    assert tokens == expected and stats.cache_hits > 0
    cold = Engine.load(engine_config(moe_path, runtime={"expert_preload": False}), show_progress=False)
    assert cold.cache.num_cached == 0
    tokens, cold_stats = greedy(cold, PROMPT, 12)
    assert tokens == expected and cold_stats.streamed_bytes > stats.streamed_bytes


def test_a_budget_beyond_the_model_maps_every_expert_and_a_full_ring_and_leaves_the_rest_free(moe_path, expected):
    # slots past every expert and the largest ring would hold nothing; the memory stays free for
    # prefill activations and decode's segments, and a loan does not grow the cache into it
    config = engine_config(moe_path, runtime={"vram_budget": "64MiB"}, planner={"max_ring_slots": 4})
    engine = Engine.load(config, show_progress=False)
    cache, spec = engine.cache, engine.spec
    needed = spec.num_layers * spec.num_experts + 4
    assert needed <= cache.num_slots and cache.storage.segments_for(needed) * cache.segment_bytes == cache.mapped_bytes
    assert cache.num_cached == spec.num_layers * spec.num_experts and engine.ledger.free_bytes > 16 << 20
    assert cache.grow(engine.ledger.free_bytes) == 0
    assert greedy(engine, PROMPT, 12)[0] == expected


@pytest.mark.parametrize("max_chunk", [16, 48, 256])
def test_output_is_the_same_for_every_chunk_size(moe_path, expected, max_chunk):
    # 10 MiB: the cache can unmap a 2 MiB segment for a whole prompt's activations and keep its ring
    config = engine_config(moe_path, runtime={"vram_budget": "10MiB"}, planner={"max_chunk_tokens": max_chunk})
    tokens, stats = greedy(Engine.load(config, show_progress=False), PROMPT, 12)
    assert tokens == expected and stats.geometry.chunk_tokens == min(max_chunk, 96)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_quantized_kv_cache_stays_close(moe_path, expected, kv_type):
    engine = Engine.load(engine_config(moe_path, runtime={"kv_type": kv_type}), show_progress=False)
    tokens, _ = greedy(engine, PROMPT, 12)
    assert sum(a == b for a, b in zip(tokens, expected)) >= 3  # lossy KV: the start agrees


def test_a_prompt_that_extends_the_last_one_prefills_only_the_unread_tokens(moe_path):
    engine = Engine.load(engine_config(moe_path), show_progress=False)
    first, _ = greedy(engine, PROMPT[:50], 4)
    follow_up = PROMPT[:50] + first + PROMPT[50:70]
    tokens, stats = greedy(engine, follow_up, 6)
    # the last sampled token was never fed back, so its KV is not cached
    assert stats.unread_tokens == 21 and stats.prompt_tokens == len(follow_up)
    fresh = Engine.load(engine_config(moe_path), show_progress=False)
    assert tokens == greedy(fresh, follow_up, 6)[0]


def test_the_ledger_is_back_at_idle_after_every_request(moe_path):
    engine = Engine.load(engine_config(moe_path), show_progress=False)
    idle = dict(engine.idle_ledger.by_owner)
    for length in (5, 90, 33, 1, 64):
        greedy(engine, PROMPT[:length], 3)
        assert dict(engine.ledger.snapshot().by_owner) == idle


def test_a_prompt_longer_than_the_context_is_refused(moe_path):
    engine = Engine.load(engine_config(moe_path, runtime={"context_tokens": 64}), show_progress=False)
    with pytest.raises(RequestError, match="the prompt has 90 tokens but the context holds 64"):
        engine.generate(PROMPT, __import__("strata.engine.sampling").engine.sampling.SamplingParams())


def test_expert_pack_file_round_trip(moe_path, expected, tmp_path):
    from strata.backend.layouts import expert_layout
    from strata.engine.memory.expert_pack import ExpertPack
    from strata.model.gguf_file import open_gguf

    model = open_gguf(moe_path)
    pack = ExpertPack.from_gguf(model, expert_layout(model), lambda n: np.empty(n, np.uint8))
    pack.write(tmp_path / "small.strpack", model)
    engine = Engine.load(engine_config(moe_path, model={"path": str(moe_path),
                                                        "expert_pack": str(tmp_path / "small.strpack")}),
                         show_progress=False)
    assert greedy(engine, PROMPT, 12)[0] == expected


def test_a_failed_decode_copy_leaves_no_unfilled_expert_in_the_cache(moe_path, expected):
    engine = Engine.load(engine_config(moe_path, planner={"max_chunk_tokens": 32}), show_progress=False)
    greedy(engine, PROMPT[::-1], 2)  # fills the cache
    stage = engine.ops.stage_experts
    calls = {"decode": 0}

    def failing_decode_stage(storage, slots, hosts, *args):
        if len(engine.kv_tokens) >= len(PROMPT):  # decode: the prompt is in the KV cache
            calls["decode"] += 1
            raise RuntimeError("copy failed")
        return stage(storage, slots, hosts, *args)

    engine.ops.stage_experts = failing_decode_stage
    with pytest.raises(RuntimeError, match="copy failed"):
        greedy(engine, PROMPT, 4)
    assert calls["decode"] == 1
    engine.ops.stage_experts = stage
    tokens, _ = greedy(engine, PROMPT, 12)
    assert tokens == expected


def test_a_decode_miss_without_a_free_slot_is_refused_and_leaves_the_cache_whole(moe_path, expected):
    from strata.errors import EngineError

    engine = Engine.load(engine_config(moe_path, planner={"max_chunk_tokens": 32}), show_progress=False)
    greedy(engine, PROMPT[::-1], 2)
    cache, insert, stage_into_cache = engine.cache, engine.cache.insert, engine.runner._stage_into_cache
    inserted = []  # the slots of the staging call under way

    def staging_call(*args, **kwargs):
        inserted.clear()
        return stage_into_cache(*args, **kwargs)

    def insert_once(layer, expert, protected):  # a decode layer's second miss finds no slot
        if inserted:
            return -1
        inserted.append(insert(layer, expert, protected))
        return inserted[-1]

    cache.insert, engine.runner._stage_into_cache = insert_once, staging_call
    with pytest.raises(EngineError, match="no expert-cache slot is free for a decode miss .* raise "
                                          "runtime.vram_budget"):
        greedy(engine, PROMPT, 4)
    assert inserted and inserted[0] not in cache._key_of  # the one inserted is forgotten, not left unfilled
    cache.insert, engine.runner._stage_into_cache = insert, stage_into_cache
    assert greedy(engine, PROMPT, 12)[0] == expected


def test_an_abandoned_generation_collected_late_leaves_the_next_request_alone(moe_path, expected):
    import gc

    from strata.engine.sampling import SamplingParams

    engine = Engine.load(engine_config(moe_path), show_progress=False)
    released = []
    end_request = engine.runner.end_request
    engine.runner.end_request = lambda: (released.append(True), end_request())  # holds no generation
    abandoned = engine.generate(PROMPT[:40], SamplingParams(temperature=0, max_tokens=8))
    next(iter(abandoned))  # one token, then dropped without close(): a reference cycle keeps it
    current = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))
    events = iter(current)
    tokens = [next(events).token_id]  # the next request ended the unfinished one before it began
    num_released = len(released)
    del abandoned
    gc.collect()  # collected in the middle of the next request, it must not touch it
    assert engine.current_generation is current and len(released) == num_released
    tokens += [event.token_id for event in events if event.token_id >= 0]
    assert tokens == expected
    assert engine.current_generation is None and len(released) == num_released + 1
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)


def test_closing_a_generation_ends_its_request_at_once(moe_path):
    from strata.engine.sampling import SamplingParams

    engine = Engine.load(engine_config(moe_path), show_progress=False)
    generation = engine.generate(PROMPT[:40], SamplingParams(temperature=0, max_tokens=8))
    next(iter(generation))
    generation.close()
    assert generation.stats.finish_reason == "cancelled" and engine.current_generation is None


def test_requests_never_interleave_a_new_one_ends_the_unfinished_one(moe_path, expected):
    from strata.engine.sampling import SamplingParams

    engine = Engine.load(engine_config(moe_path), show_progress=False)
    first = engine.generate(PROMPT[:40], SamplingParams(temperature=0, max_tokens=8))
    first_events = iter(first)
    taken = [next(first_events).token_id, next(first_events).token_id]
    tokens, stats = greedy(engine, PROMPT, 12)
    assert tokens == expected and stats.finish_reason == "length"
    assert first.stats.finish_reason == "cancelled" and first.stats.generated_tokens == len(taken)
    assert list(first_events) == []  # it yields nothing more: its KV cache now holds the other prompt
    assert engine.current_generation is None
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)


def test_a_fixed_geometry_is_every_requests_and_keeps_the_output(moe_path, expected):
    engine = Engine.load(engine_config(moe_path, planner={"chunk_tokens": 32, "ring_slots": 8}), show_progress=False)
    tokens, stats = greedy(engine, PROMPT, len(expected))
    assert tokens == expected
    assert (stats.geometry.chunk_tokens, stats.geometry.ring_slots, stats.num_chunks) == (32, 8, -(-len(PROMPT) // 32))


def test_the_compute_rate_is_calibrated_from_the_engines_own_chunks_unless_configured(moe_path):
    # no per-chunk overhead in the model: a numpy chunk of this model takes milliseconds
    engine = Engine.load(engine_config(moe_path, planner={"max_chunk_tokens": 32, "chunk_overhead_s": 0.0}),
                         show_progress=False)
    rates = engine.planner.rates
    assert rates.compute.value == ASSUMED_COMPUTE_FLOPS_PER_S and "numpy backend, no GPU" in rates.pcie.source
    _, stats = greedy(engine, PROMPT, 2)
    # the host's chunks are compute-bound (their streamed bytes take microseconds at the assumed PCIe rate)
    assert rates.num_chunks == stats.num_chunks == 3
    assert rates.compute.source == "calibrated from 3 compute-bound prefill chunk(s)"
    assert 0 < rates.compute.value < 1e12 and engine.planner.cost_model.compute_flops_per_s == rates.compute.value
    fixed = Engine.load(engine_config(moe_path, planner={"max_chunk_tokens": 32, "chunk_overhead_s": 0.0,
                                                         "compute_flops_per_s": 5e12}), show_progress=False)
    greedy(fixed, PROMPT, 2)
    assert fixed.planner.cost_model.compute_flops_per_s == 5e12 and fixed.planner.rates.num_chunks == 0


def test_a_loaded_engine_is_frozen_out_of_the_collector_and_a_request_shows_what_a_pass_cost(moe_path, expected,
                                                                                              monkeypatch):
    import dataclasses
    import gc

    from strata.engine.collector import CollectorTally

    assert gc.get_freeze_count() == 0
    engine = Engine.load(engine_config(moe_path), show_progress=False)
    assert gc.get_freeze_count() > 0  # the model's objects: a full pass over them would stall a chunk or a token
    forward = engine.runner.forward

    def forward_with_a_full_pass(*args, **kwargs):
        gc.collect()
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", forward_with_a_full_pass)
    tokens, stats = greedy(engine, PROMPT, 12)
    assert tokens == expected
    assert stats.prefill_collector.num_full_passes >= 1 and stats.collector.num_full_passes >= 12
    assert 0 < stats.prefill_collector.seconds <= stats.collector.seconds
    # the line names the collector once it cost a millisecond
    cheap = dataclasses.replace(stats, collector=CollectorTally(40, 1, 0.0009))
    assert "| collector" not in cheap.timing_line()
    costly = dataclasses.replace(stats, collector=CollectorTally(40, 1, 0.3125),
                                 prefill_collector=CollectorTally(1, 1, 0.25))
    assert "| collector 40 pass(es) (1 full) 312.5 ms, in prefill 250.0 ms |" in costly.timing_line()
    engine.close()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("is_warmup", [True, False])
def test_with_warmup_the_load_dequantizes_what_the_first_request_multiplies_by(moe_path, expected, monkeypatch,
                                                                               is_warmup):
    from strata.backend import numpy_ops

    engine = Engine.load(engine_config(moe_path, runtime={"warmup": is_warmup}), show_progress=False)
    weight_shapes = {tuple(tensor.shape) for tensor in engine.matmul_weights()}
    dequantized = []
    real = numpy_ops.quants.dequantize

    def recording(raw, qtype, shape):
        dequantized.append(tuple(shape))
        return real(raw, qtype, shape)

    monkeypatch.setattr(numpy_ops.quants, "dequantize", recording)
    tokens, _ = greedy(engine, PROMPT, 12)
    assert tokens == expected
    whole_matrices = [shape for shape in dequantized if shape in weight_shapes]
    assert bool(whole_matrices) != is_warmup  # without the warm-up the first request dequantizes them
    assert len(engine.matmul_weights()) == sum(1 for n in engine.weights.matrices if n != "token_embd") + 1
