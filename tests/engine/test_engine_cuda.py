"""The engine on the Numba kernels: under the simulator in CI (a tiny model, a few tokens) and on a
real GPU when there is one (more tokens, every KV format, and a loan)."""

import contextlib

import numpy as np
import pytest
from engine_setup import LOAN_RUNTIME, SIMULATOR_TINY, engine_config, greedy, reference_greedy
from gguf import GGMLQuantizationType as QType
from launch_recorder import recording_launches
from numba import config as numba_config
from numba import cuda

from strata.backend.ops import DECODE_MAX_ROWS
from strata.backend.select import has_cuda_device
from strata.engine.decode.greedy_tail import BIAS_CAPACITY
from strata.engine.decode import step as step_module
from strata.engine.decode.step import DecodeStep
from strata.engine.facade import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import AllocationError
from strata.gpu.kernels import (
    attention_decode,
    attention_decode_direct,
    moe_rows,
    tensor_core,
)
from strata.gpu.kernels.gemm_config import moe_block_m
from strata.gpu.ledger import ACTIVATIONS_OWNER, DECODE_GRAPHS_OWNER, TRANSIENT_OWNERS
from strata.model.gguf_file import open_gguf
from strata.model.reference import KVCache, ReferenceModel
from strata.model.synth import PRESETS, with_overrides, write_synthetic_model

BACKEND = "cuda" if has_cuda_device() else "cudasim"
pytestmark = pytest.mark.skipif(BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                                reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")
# the simulator runs each thread in Python: a prompt's every row there costs seconds
NUM_PROMPT, NUM_GENERATED = (70, 8) if BACKEND == "cuda" else (2, 2)
TINY = PRESETS["tiny"] if BACKEND == "cuda" else SIMULATOR_TINY
PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 250, size=NUM_PROMPT)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("models") / "tiny.gguf", TINY, QType.Q4_0, seed=3,
                                 with_mtp=True)


def test_warm_up_leaves_the_engine_as_it_was_and_the_output_equals_the_reference(tiny_path, monkeypatch):
    # one test for both: the simulator runs each whole request slowly
    engine = Engine.load(engine_config(tiny_path, runtime={"backend": BACKEND, "vram_budget": "64MiB",
                                                            "warmup": False}), show_progress=False)
    before = dict(engine.ledger.snapshot().by_owner)
    grouped_rows = []  # the tile rows of every MoE prefill grouping
    group = engine.ops.moe_groups

    def recording_group(*args):
        groups = group(*args)
        if groups is not None:
            grouped_rows.append(groups.block_m)
        return groups

    monkeypatch.setattr(engine.ops, "moe_groups", recording_group)
    with _launches(monkeypatch) as warmed:
        assert engine.warm_up() > 0
    monkeypatch.undo()
    assert dict(engine.ledger.snapshot().by_owner) == before
    # each tile shape a chunk may take has its kernels compiled (64 and 128 rows on tensor cores: moe_rows'
    # kernels do not serve this model's 32-wide expert FFN)
    forced = {rows for rows in engine.ops.moe_tile_rows(engine.cache.layout) if rows}
    assert grouped_rows and forced <= set(grouped_rows) and len(set(grouped_rows)) == max(1, len(forced))
    assert engine.kv_tokens == [] and engine.cache.num_cached == 0 and engine.cache.num_evictions == 0
    assert engine.cache.borrowable_bytes() > 0 and engine.workspace.geometry is None
    # a prompt shorter than decode's rows: its chunk runs decode's row kernels with the staging ring's slots
    with _launches(monkeypatch) as requested:
        tokens, stats = greedy(engine, PROMPT, NUM_GENERATED)
    assert tokens == reference_greedy(tiny_path, PROMPT, NUM_GENERATED)
    assert stats.streamed_bytes > 0
    # no launch of the request compiles: on a GPU counted, in the simulator asked of every launch's types
    assert stats.num_compiles == 0, stats.timing_line()
    if requested is not None:
        assert warmed.launches and not requested.launches - warmed.launches, \
            requested.names(requested.launches - warmed.launches)
    idle = {k: v for k, v in engine.idle_ledger.by_owner.items()}
    assert {k: v for k, v in engine.ledger.snapshot().by_owner.items() if k not in TRANSIENT_OWNERS} == idle
    # more tokens than a decode step's rows: the MoE groups them
    num_tokens = DECODE_MAX_ROWS + 3
    ids = cuda.to_device(np.zeros((num_tokens, 2), np.int32))
    weights = cuda.to_device(np.ones((num_tokens, 2), np.float32))
    for rows in engine.ops.moe_tile_rows():  # what the warm-up does for each shape
        with engine.ops.forcing_moe_tile_rows(rows):
            assert engine.ops.moe_groups(ids, weights, 4).block_m == (rows or moe_block_m(2 * num_tokens, 4))
    assert engine.ops.moe_groups(ids, weights, 4).block_m == moe_block_m(2 * num_tokens, 4)
    with pytest.raises(ValueError, match=r"MoE tile rows must be one of \(.*\), got 32"):
        with engine.ops.forcing_moe_tile_rows(32):
            pass


def _launches(monkeypatch):
    """The simulator's launches with their argument types (``launch_recorder``); on a GPU nothing (its
    compile counter answers instead)."""
    return recording_launches(monkeypatch) if BACKEND == "cudasim" else contextlib.nullcontext()


# the simulator runs one two-chunk prompt; a GPU every chunk size from a quantum to the whole prompt
CHUNK_SIZES = [16, 32, 64] if BACKEND == "cuda" else [16]


# float atomics (runtime.deterministic = false) here; the default's fixed-point sums in the simulator below
SUMS = [False, True] if BACKEND == "cuda" else [False]


@pytest.mark.parametrize("max_chunk", CHUNK_SIZES)
@pytest.mark.parametrize("is_deterministic", SUMS, ids=lambda d: "fixed-point" if d else "float")
def test_greedy_output_equals_the_reference_at_every_chunk_size(tiny_path, max_chunk, is_deterministic):
    prompt = PROMPT if BACKEND == "cuda" else [int(t) for t in np.random.default_rng(7).integers(3, 250, size=20)]
    runtime = {"backend": BACKEND, "vram_budget": "64MiB", "warmup": False, "deterministic": is_deterministic}
    engine = Engine.load(engine_config(tiny_path, runtime=runtime, planner={"max_chunk_tokens": max_chunk}),
                         show_progress=False)
    tokens, stats = greedy(engine, prompt, NUM_GENERATED)
    assert stats.num_chunks == -(-len(prompt) // max_chunk) > 1
    assert tokens == reference_greedy(tiny_path, prompt, NUM_GENERATED)
    rates = engine.planner.rates
    if BACKEND == "cuda":
        assert rates.pcie.source.startswith("measured at load") and 1e9 < rates.pcie.value < 1e12
        assert rates.num_chunks == 0  # without the warm-up, the first request's chunks compile their kernels
    else:  # the simulator's chunks are timed on the host, and each takes far more than the model's overhead
        assert "cudasim backend, no GPU to probe" in rates.pcie.source and rates.num_chunks == stats.num_chunks


def test_deterministic_sums_give_the_same_logits_whether_the_experts_were_cached_or_streamed(tiny_path, monkeypatch):
    # runtime.deterministic: a prefill chunk's routed experts add up in fixed point, so the prompt's logits have the
    # same bits with every expert cached (one launch a layer) and with every expert streamed in ring batches (an
    # empty cache: other launches, another order of adds), the short last chunk (fewer rows than decode's kernels
    # take) included. (With float sums the short chunk's experts were added batch by batch, and the logits of these
    # two differed in 212 entries on the simulator.)
    from strata.gpu.kernels import fixed_sums

    prompt = PROMPT[:37] if BACKEND == "cuda" else [int(t) for t in np.random.default_rng(8).integers(3, 250, size=21)]
    max_chunk = 32 if BACKEND == "cuda" else 16  # a last chunk of 5 rows
    folds = []
    fold = fixed_sums.add_fixed_sums
    monkeypatch.setattr(fixed_sums, "add_fixed_sums", lambda *args, **kwargs: folds.append(1) or fold(*args, **kwargs))
    first_logits = []
    for is_preloaded in (True, False):
        runtime = {"backend": BACKEND, "vram_budget": "64MiB", "warmup": False, "greedy_on_device": False,
                   "deterministic": True, "expert_preload": is_preloaded, "mtp": True, "spec_depth": 1}
        engine = Engine.load(engine_config(tiny_path, runtime=runtime, planner={"max_chunk_tokens": max_chunk}),
                             show_progress=False)
        logits, host_logits = [], engine.ops.logits

        def recording_logits(*args, logits=logits, host_logits=host_logits):
            logits.append(host_logits(*args))
            return logits[-1]

        monkeypatch.setattr(engine.ops, "logits", recording_logits)
        num_folds = len(folds)
        tokens, stats = greedy(engine, prompt, 1)
        assert tokens == reference_greedy(tiny_path, prompt, 1)
        assert stats.num_chunks == 2 and (stats.streamed_bytes > 0) != is_preloaded, stats.timing_line()
        # every main layer of both chunks added its sums once; the MTP block's pass over the prompt writes its
        # cache alone, no experts
        assert len(folds) - num_folds == 2 * TINY.num_layers
        first_logits.append(logits[0])
        engine.close()
    np.testing.assert_array_equal(first_logits[1], first_logits[0])


def test_a_prefill_cancelled_between_layers_while_experts_stream_leaves_the_next_request_exact(tiny_path):
    # the cancel comes after a layer whose experts streamed through the ring into fixed-point sums: the ring's
    # copies finish, the cache's borrowed segments come back, and the next request is the reference
    runtime = {"backend": BACKEND, "vram_budget": "64MiB", "warmup": False, "expert_preload": False}
    engine = Engine.load(engine_config(tiny_path, runtime=runtime, planner={"max_chunk_tokens": 16}),
                         show_progress=False)
    # seed 10: neither tiny shape's greedy continuation starts with an end-of-generation id (seed 9's did on the
    # GPU's, token 509, so the request rightly returned nothing and the comparison with the reference failed)
    prompt = [int(t) for t in np.random.default_rng(10).integers(3, 250, size=18)]
    asked = []
    generation = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=2),
                                 lambda: asked.append(0) or len(asked) > 1)
    assert list(generation) == [] and generation.stats.finish_reason == "cancelled"
    assert generation.stats.prefill_streamed_bytes > 0 and generation.stats.num_chunks == 0
    assert _lasting(engine) == dict(engine.idle_ledger.by_owner)
    assert greedy(engine, prompt, 2)[0] == reference_greedy(tiny_path, prompt, 2)
    engine.close()


@pytest.mark.skipif(not tensor_core.is_available(), reason="moe_rows' kernels need tensor cores")
@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q8_0], ids=lambda q: q.name)
def test_experts_of_64_multiples_prefill_on_the_rows_kernels_and_give_the_reference_output(tmp_path, monkeypatch,
                                                                                           qtype):
    path = write_synthetic_model(tmp_path / "rows.gguf", with_overrides(PRESETS["tiny"], hidden_size=128,
                                                                        expert_ffn_size=64), qtype, seed=6)
    engine = Engine.load(engine_config(path, runtime={"backend": BACKEND, "vram_budget": "64MiB"}),
                         show_progress=False)
    assert engine.ops.moe_tile_rows(engine.cache.layout) == (moe_rows.TILE_ROWS,)
    launched = []
    real = moe_rows.rows_launches
    monkeypatch.setattr(moe_rows, "rows_launches", lambda *a, **k: launched.append(1) or real(*a, **k))
    tokens, _ = greedy(engine, PROMPT, NUM_GENERATED)
    assert launched
    assert tokens == reference_greedy(path, PROMPT, NUM_GENERATED)


@pytest.mark.skipif(BACKEND != "cuda" or not tensor_core.is_available(),
                    reason="misses read in place need the C++ rows on a GPU")
@pytest.mark.parametrize("greedy_on_device", [True, False])
def test_misses_read_in_place_give_the_reference_output_in_one_graph_a_token(tmp_path, monkeypatch,
                                                                             greedy_on_device):
    # half of every layer's experts cached, the others read by the expert kernels from the pinned pack:
    # the tokens are the reference's, every decode step is the whole-token segment kept from load, and
    # it counts the pairs it read from host memory as misses; nothing is staged during decode
    path = write_synthetic_model(tmp_path / "rows.gguf", with_overrides(PRESETS["tiny"], hidden_size=128,
                                                                        expert_ffn_size=64), QType.Q4_0, seed=6)
    runtime = {"backend": BACKEND, "vram_budget": "64MiB", "expert_preload": False, "decode_misses": "host",
               "greedy_on_device": greedy_on_device}
    engine = Engine.load(engine_config(path, runtime=runtime), show_progress=False)
    spec, cache = engine.spec, engine.cache
    placed = [((layer, e), cache.insert(layer, e, set())) for layer in range(spec.num_layers)
              for e in range(0, spec.num_experts, 2)]
    cache.stage_from(engine.pack, placed)
    engine.ops.synchronize()
    counts, staged = [], []
    count = DecodeStep._count_token_reads

    def spied_count(step, stats, num_steps):
        misses, hits = stats.misses, stats.hits
        count(step, stats, num_steps)
        counts.append((step.kind, stats.misses - misses, stats.hits - hits))

    monkeypatch.setattr(DecodeStep, "_count_token_reads", spied_count)
    decode_slots = engine.runner.decode_slots
    monkeypatch.setattr(engine.runner, "decode_slots", lambda *a, **k: staged.append(1) or decode_slots(*a, **k))
    tokens, _ = greedy(engine, PROMPT, NUM_GENERATED)
    assert tokens == reference_greedy(path, PROMPT, NUM_GENERATED)
    assert counts and all(kind == "addressed" for kind, _, _ in counts) and not staged
    assert sum(m for _, m, _ in counts) > 0 and sum(h for _, _, h in counts) > 0
    assert engine.runner.decode_step.is_kept and cache.num_cached == len(placed)  # the cache as it was
    assert _lasting(engine) == dict(engine.idle_ledger.by_owner)


@pytest.mark.skipif(BACKEND != "cudasim", reason="the simulator cannot read experts in place: the fallback")
def test_misses_asked_to_be_read_in_place_where_they_cannot_be_are_staged_with_a_warning(tiny_path, caplog):
    runtime = {"backend": BACKEND, "vram_budget": "64MiB", "warmup": False, "decode_misses": "host"}
    with caplog.at_level("WARNING", logger="strata.engine"):
        engine = Engine.load(engine_config(tiny_path, runtime=runtime), show_progress=False)
    assert not engine.runner.decode_step.is_reading_in_place
    assert [r.message for r in caplog.records].count(
        'runtime.decode_misses = "host": the expert kernels cannot read this model\'s experts in place (formats '
        'without C++ rows, no expert pack, or no GPU); decode stages them') == 1


@pytest.mark.parametrize("head_dim, module, name", [
    pytest.param(32, attention_decode, "decode_kernel", id="ffma"),
    pytest.param(64, attention_decode_direct, "attention_decode", id="direct", marks=pytest.mark.skipif(
        not tensor_core.is_available(),
        reason="the simulator runs its twin in tests/kernels; an engine there is slow")),
])
def test_decode_attention_kernel_in_the_captured_step_gives_the_reference_logits(tmp_path, monkeypatch, head_dim,
                                                                                   module, name):
    # the tiny preset's head dim (16) goes to attention.py's kernel; at 32 a decode token's attention
    # is attention_decode's, at 64 attention_decode_direct's (tensor cores, on a GPU), captured in the
    # layers' segments over the shared split scratch, its KV length read from the position on the device
    path = write_synthetic_model(tmp_path / f"head-dim-{head_dim}.gguf",
                                 with_overrides(TINY, head_dim=head_dim), QType.Q4_0, seed=4)
    kernels = []
    decode_kernel = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: kernels.append(args) or decode_kernel(*args, **kwargs))
    runtime = {"backend": BACKEND, "vram_budget": "64MiB", "warmup": False, "greedy_on_device": False}
    engine = Engine.load(engine_config(path, runtime=runtime), show_progress=False)
    logits = []
    host_logits = engine.ops.logits
    monkeypatch.setattr(engine.ops, "logits", lambda *args: logits.append(host_logits(*args)) or logits[-1])
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 250, size=5)]
    tokens, _ = greedy(engine, prompt, 3)
    assert engine.runner.decode_step is not None and kernels  # the captured step ran the decode kernel
    model = open_gguf(path)
    reference, kv = ReferenceModel.from_gguf(model), KVCache.for_spec(model.spec, 64)
    expected = [reference.forward(np.array(prompt), 0, kv)[-1]]
    for position, token in enumerate(tokens[:-1], start=len(prompt)):
        expected.append(reference.forward(np.array([token]), position, kv)[-1])
    assert len(logits) == len(expected) == 3
    for got, want in zip(logits, expected):  # an F16 KV cache against the reference's float32
        assert np.max(np.abs(np.ravel(got) - want)) <= 2e-3 * np.max(np.abs(want))


def test_decode_segments_replay_at_every_position_like_plain_launches(tiny_path, monkeypatch):
    # captured per-layer segments (graphs on the GPU, re-run in the simulator), captured before
    # the first request and kept, against plain launches over several tokens: positions move,
    # misses are staged between a layer's routing and its experts, and the next layer's predicted
    # experts are staged ahead; the logits go to the host (the device's greedy tail runs in the
    # warm-up test's streaming decode). A second request replays the same segments: one a layer
    # and one more (a layer's experts and the next layer's attention are one).
    runtime = {"backend": BACKEND, "vram_budget": "64MiB", "warmup": False, "expert_preload": False,  # misses
               "decode_prefetch": True, "greedy_on_device": False}
    prompt, num_generated = PROMPT[:4], NUM_GENERATED + 1  # the simulator takes ~10 s per decode step
    plain = Engine.load(engine_config(tiny_path, runtime={**runtime, "decode_graphs": False, "decode_prefetch": False}),
                        show_progress=False)
    captured = Engine.load(engine_config(tiny_path, runtime=runtime), show_progress=False)
    assert plain.runner.decode_step is None and captured.runner.decode_step is not None
    decode_scratches = []
    attention = captured.ops.attention

    def spied_attention(q, kv, layer, start, positions=None, split_scratch=None):
        if q.shape[0] == 1:
            decode_scratches.append(split_scratch)
        return attention(q, kv, layer, start, positions, split_scratch)

    monkeypatch.setattr(captured.ops, "attention", spied_attention)
    capture, owners = captured.ops.capture, []
    monkeypatch.setattr(captured.ops, "capture", lambda fn, owner: owners.append(owner) or capture(fn, owner))
    captured.prepare_decode()
    assert len(owners) == captured.spec.num_layers + 1  # greedy_on_device is off here: no tail
    owners.clear()
    events = []  # ("staged" | "routed", layer, experts) in the order the decode step saw them
    prefetch, decode_slots = captured.runner.prefetch, captured.runner.decode_slots

    staging_options = []  # what each decode staging (no prompt workspace) was told about waiting for the kernels

    def spied_prefetch(layer, ids, in_use, stats, **kwargs):
        if captured.workspace.geometry is None:
            staging_options.append(kwargs)
        ticket, experts = prefetch(layer, ids, in_use, stats, **kwargs)
        events.append(("staged", layer, set(experts)))
        return ticket, experts

    def spied_decode_slots(layer, ids, stats, **kwargs):
        if captured.workspace.geometry is None:
            staging_options.append(kwargs)
        events.append(("routed", layer, set(ids.ravel().tolist())))
        return decode_slots(layer, ids, stats, **kwargs)

    monkeypatch.setattr(captured.runner, "prefetch", spied_prefetch)
    monkeypatch.setattr(captured.runner, "decode_slots", spied_decode_slots)
    expected, _ = greedy(plain, prompt, num_generated)
    tokens, stats = greedy(captured, prompt, num_generated)
    assert tokens == expected == reference_greedy(tiny_path, prompt, num_generated)
    assert stats.cache_misses > 0 and stats.prefetched_experts > 0
    # each follows a readback, so none waits for the kernels (the prefill's stagings do)
    assert staging_options and all(o == {"is_after_compute": False} for o in staging_options)
    assert 0 < stats.decode_wait_seconds < stats.decode_seconds  # blocked on each layer's routing
    # a staged expert counts as used when the next routing of its layer picks it
    pending, num_used = {}, 0
    for kind, layer, experts in events:
        if kind == "staged":
            pending[layer] = experts
        else:
            num_used += len(pending.pop(layer, set()) & experts)
    assert stats.prefetched_experts == sum(len(e) for kind, _, e in events if kind == "staged")
    assert stats.prefetched_used_experts == num_used
    # every layer's attention shares one scratch: a captured layer does not keep its own
    assert len(decode_scratches) >= captured.spec.num_layers and None not in decode_scratches
    assert len({id(s) for s in decode_scratches}) == 1
    assert _lasting(captured) == dict(captured.idle_ledger.by_owner) and DECODE_GRAPHS_OWNER in _lasting(captured)
    # the first request's decode may have cached every expert (on the GPU it runs more tokens),
    # which would drop the kept segments; one expert less keeps the model streaming
    cache = captured.cache
    cache.forget([next(s for s in (cache.lookup(0, e) for e in range(captured.spec.num_experts)) if s >= 0)])
    follow_up = prompt + tokens[:1]
    assert greedy(captured, follow_up, 2)[0] == reference_greedy(tiny_path, follow_up, 2)
    assert owners == [] and _lasting(captured) == dict(captured.idle_ledger.by_owner)


def test_a_fully_cached_model_decodes_from_segments_kept_across_requests(tiny_path, monkeypatch):
    # the budget holds every expert and the ring beside them: the fill at load caches them all, the
    # ring borrows only free slots, and decode maps routed ids to slots on the device. The segments
    # (here a layer each: the token's parts) are captured before the first request and kept: a request
    # captures again only a greedy tail, when the output head was uploaded again or for a bias longer
    # than the kept tail holds
    calls = []
    whole_token = DecodeStep._whole_token
    monkeypatch.setattr(DecodeStep, "_whole_token",
                        lambda self, *layers: calls.append(layers) or whole_token(self, *layers))
    monkeypatch.setattr(step_module, "TOKEN_PART_LAYERS", 1)
    engine = Engine.load(engine_config(tiny_path, runtime={"backend": BACKEND, "vram_budget": "64MiB",
                                                            "warmup": False}), show_progress=False)
    spec = engine.spec
    assert engine.cache.num_cached == spec.num_layers * spec.num_experts
    captured = []
    capture = engine.ops.capture
    monkeypatch.setattr(engine.ops, "capture", lambda fn, owner: captured.append(owner) or capture(fn, owner))
    engine.prepare_decode()
    num_parts = spec.num_layers
    assert len(captured) == num_parts + 1 and engine.runner.decode_step.is_resident  # the token's layers, the tail
    assert engine.idle_ledger.by_owner[DECODE_GRAPHS_OWNER] > 0
    prompt, num_generated = PROMPT[:4], NUM_GENERATED + 1
    tokens, stats = greedy(engine, prompt, num_generated)
    assert tokens == reference_greedy(tiny_path, prompt, num_generated)
    assert set(calls) == {(layer, layer + 1) for layer in range(num_parts)}  # a segment a layer, recorded or rerun
    assert stats.cache_misses == 0 and engine.cache.num_cached == spec.num_layers * spec.num_experts
    assert 0 < stats.decode_wait_seconds < stats.decode_seconds  # blocked on each step's token id
    assert len(captured) == num_parts + 1 and _lasting(engine) == dict(engine.idle_ledger.by_owner)

    head = engine.resources["output_head"]
    head.release()
    head.restore()  # a new tensor, as after a loan: the kept tail is captured again over it
    follow_up = prompt + tokens[:1]
    assert greedy(engine, follow_up, 2)[0] == reference_greedy(tiny_path, follow_up, 2)
    assert captured[num_parts + 1:] == [DECODE_GRAPHS_OWNER] and _lasting(engine) == dict(engine.idle_ledger.by_owner)
    zero_bias = {token_id: 0.0 for token_id in range(3, 3 + BIAS_CAPACITY + 1)}
    events = engine.generate(follow_up, SamplingParams(temperature=0, max_tokens=2, logit_bias=zero_bias))
    assert [e.token_id for e in events if e.token_id >= 0] == reference_greedy(tiny_path, follow_up, 2)
    assert captured[num_parts + 2:] == [ACTIVATIONS_OWNER]  # a tail for this request's longer bias, dropped at its end
    assert _lasting(engine) == dict(engine.idle_ledger.by_owner)

    engine.cache.forget([engine.cache.lookup(0, 0)])  # no longer complete: the kept segments go
    assert greedy(engine, follow_up, 2)[0] == reference_greedy(tiny_path, follow_up, 2)
    assert not engine.runner.decode_step.is_kept and DECODE_GRAPHS_OWNER not in engine.idle_ledger.by_owner
    assert _lasting(engine) == dict(engine.idle_ledger.by_owner)


def test_segments_that_would_leave_no_room_for_a_prefill_are_not_kept(tiny_path, monkeypatch, caplog):
    engine = Engine.load(engine_config(tiny_path, runtime={"backend": BACKEND, "vram_budget": "64MiB",
                                                            "warmup": False}), show_progress=False)
    before = _lasting(engine)

    def no_room(is_loan):
        raise AllocationError("the prefill budget cannot hold the smallest geometry")

    monkeypatch.setattr(engine.loan, "plan_preview", no_room)
    engine.prepare_decode()
    assert not engine.runner.decode_step.is_kept and "not kept across requests" in caplog.text
    assert _lasting(engine) == before == dict(engine.idle_ledger.by_owner)


@pytest.mark.skipif(BACKEND != "cuda", reason="events time a GPU's chunks; the simulator's are timed on the host")
def test_chunks_are_timed_on_the_device_and_calibrate_the_compute_rate(tiny_path, monkeypatch):
    engine = Engine.load(engine_config(tiny_path, runtime={"backend": "cuda", "vram_budget": "64MiB"},
                                       planner={"max_chunk_tokens": 32, "chunk_overhead_s": 0.0}), show_progress=False)
    timed = []
    calibrate = engine.planner.calibrate
    monkeypatch.setattr(engine.planner, "calibrate", lambda chunks: (timed.extend(chunks), calibrate(chunks)))
    _, stats = greedy(engine, PROMPT, 2)
    assert [c.num_tokens for c in timed] == [32, 32, len(PROMPT) - 64] and [c.start for c in timed] == [0, 32, 64]
    assert all(c.seconds > 0 for c in timed) and sum(c.seconds for c in timed) < stats.prefill_seconds
    assert sum(c.streamed_bytes for c in timed) == stats.prefill_streamed_bytes
    rates = engine.planner.rates
    assert engine.planner.cost_model.compute_flops_per_s == rates.compute.value
    assert rates.num_chunks == 0 or rates.compute.source.startswith("calibrated from")


@pytest.mark.skipif(BACKEND != "cuda", reason="the loan and KV formats on the kernels take minutes in the simulator")
@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_loan_on_the_gpu_restores_everything_and_keeps_the_output(tiny_path, kv_type):
    loan = {"enabled": True, "plugins": ["loan_mtp", "loan_head", "retain_startup_chunk", "repeat_loan"],
            "repeat_loan": {"min_tokens": 256}}
    runtime = {**LOAN_RUNTIME, "backend": BACKEND, "kv_type": kv_type, "vram_budget": "1GiB"}
    with_loan = Engine.load(engine_config(tiny_path, runtime=runtime, loan=loan), show_progress=False)
    without = Engine.load(engine_config(tiny_path, runtime=runtime), show_progress=False)
    for prompt in (PROMPT, PROMPT + PROMPT[:5], PROMPT[::-1] * 5):
        a, a_stats = greedy(with_loan, prompt, NUM_GENERATED)
        b, _ = greedy(without, prompt, NUM_GENERATED)
        assert a == b
        assert _lasting(with_loan) == dict(with_loan.idle_ledger.by_owner)
        # the warm-up compiled every launch, the MTP block's draft rows included though the startup loan held
        # the block back then: the second request (no loan) is the first to decode without a loan before it
        assert a_stats.num_compiles == 0, a_stats.timing_line()
    assert a_stats.loan.is_taken and all(r.is_resident for r in with_loan.resources.values())



@pytest.mark.skipif(BACKEND != "cuda", reason="four requests on two engines take ~4 minutes in the simulator; "
                                              "CI runs the pieces in tests/kernels/test_ops_greedy.py and above")
def test_greedy_on_the_device_gives_the_host_sampled_tokens_with_a_bias_and_an_early_stop(tiny_path):
    # the captured resident step with the greedy tail (bias kernel, argmax, the step queued ahead)
    # against the captured resident step that returns logits to the host, and a request after the
    # early stop that reuses the prefix over the KV cell the step ahead wrote
    runtime = {"backend": BACKEND, "vram_budget": "64MiB", "warmup": False}
    host = Engine.load(engine_config(tiny_path, runtime={**runtime, "greedy_on_device": False}), show_progress=False)
    device = Engine.load(engine_config(tiny_path, runtime=runtime), show_progress=False)
    prompt, num_generated = PROMPT[:4], NUM_GENERATED + 1
    plain = reference_greedy(tiny_path, prompt, num_generated)
    params = SamplingParams(temperature=0, max_tokens=num_generated, logit_bias={plain[1]: float("-inf"), 7: 0.5})
    outputs = []
    for engine in (host, device):
        engine.state.update(logit_bias=((plain[1], -1.0), (7, 0.25)))
        outputs.append([e.token_id for e in engine.generate(prompt, params) if e.token_id >= 0])
        engine.state.update(logit_bias=())
        outputs.append(greedy(engine, prompt + outputs[-1][:2], 2)[0])
        assert engine.runner.decode_step.is_resident is None  # reset at the request's end
    assert outputs[0] == outputs[2] and outputs[0][1] != plain[1] and outputs[1] == outputs[3]
    assert outputs[1] == reference_greedy(tiny_path, prompt + outputs[0][:2], 2)


def _lasting(engine) -> dict:
    """The ledger without the owners of computations in flight."""
    return {k: v for k, v in engine.ledger.snapshot().by_owner.items() if k not in TRANSIENT_OWNERS}
