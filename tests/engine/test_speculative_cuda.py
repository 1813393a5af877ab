"""MTP speculation on the Numba kernels (the simulator in CI, the GPU where there is one): drafts
and picks on the device through captured segments, greedy output equal to plain greedy decode."""

import numpy as np
import pytest
from engine_setup import LOAN_RUNTIME, SIMULATOR_TINY, engine_config, greedy, reference_greedy
from gguf import GGMLQuantizationType as QType
from loan_setup import WRITE_UP_PLUGINS
from numba import config as numba_config

from strata.backend.select import has_cuda_device
from strata.bench.draft_oracle import DraftOracle
from strata.engine.decode import speculative, step
from strata.engine.decode.depth_policy import DepthPolicy
from strata.engine.decode.device_speculation import DeviceSpeculation
from strata.engine.decode.speculative import Speculation
from strata.engine.facade import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import EngineError
from strata.gpu.ledger import ACTIVATIONS_OWNER, DECODE_GRAPHS_OWNER, TRANSIENT_OWNERS
from strata.hooktypes import MTP_DRAFT_HEAD, VERIFIER
from strata.model.synth import PRESETS, write_synthetic_model

BACKEND = "cuda" if has_cuda_device() else "cudasim"
pytestmark = pytest.mark.skipif(BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                                reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")
NUM_PROMPT, NUM_GENERATED = (70, 40) if BACKEND == "cuda" else (2, 4)  # the simulator: seconds a row
DEPTHS = (1, 2, 3, 4) if BACKEND == "cuda" else (2,)
PROMPT = [int(t) for t in np.random.default_rng(6).integers(3, 250, size=NUM_PROMPT)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    shape = PRESETS["tiny"] if BACKEND == "cuda" else SIMULATOR_TINY
    return write_synthetic_model(tmp_path_factory.mktemp("models") / "tiny.gguf", shape, QType.Q4_0, seed=3,
                                 with_mtp=True)


def _runtime(**runtime):
    return {"backend": BACKEND, "vram_budget": "64MiB", "warmup": BACKEND == "cuda", **runtime}


@pytest.fixture(scope="module")
def plain_tokens(tiny_path):
    """Plain greedy decode's tokens on the device; in the simulator, the NumPy reference's, which
    plain decode there equals (test_engine_cuda.py), for a simulated request takes minutes."""
    if BACKEND == "cudasim":
        return reference_greedy(tiny_path, PROMPT, NUM_GENERATED)
    engine = Engine.load(engine_config(tiny_path, runtime=_runtime()), show_progress=False)
    tokens, stats = greedy(engine, PROMPT, NUM_GENERATED)
    assert not stats.is_speculative
    return tokens


@pytest.mark.parametrize("depth", DEPTHS)
def test_device_speculation_equals_plain_greedy(tiny_path, plain_tokens, depth, monkeypatch):
    monkeypatch.setattr(step, "TOKEN_PART_LAYERS", 1)  # each layer of a whole token its own segment
    engine = Engine.load(engine_config(tiny_path, runtime=_runtime(mtp=True, spec_depth=depth, spec_policy="fixed")),
                         show_progress=False)
    assert engine.runner.can_pick_greedy_on_device
    if BACKEND == "cudasim":  # the load's warm-up (off in the simulator) keeps the segments
        engine.prepare_decode()
    speculation = engine.runner.speculation
    kept = speculation.segments
    assert speculation.is_kept and len(kept) == depth + 1 + (depth > 1)  # first(R) for R = 1..depth + 1, the chain
    if BACKEND == "cuda":  # the model's own drafts (the simulator runs only the oracle's: minutes a request)
        tokens, stats = greedy(engine, PROMPT, NUM_GENERATED)
        assert tokens == plain_tokens and stats.spec_rounds > 0
    # every draft the greedy continuation, which the request records first by plain decode on the
    # device (one run of greedy steps, each queued ahead): each verify step takes all its drafts
    oracle = DraftOracle(None, 0, 1.0, engine.spec.vocab_size)
    generation = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NUM_GENERATED, seed=0),
                                 draft_oracle=oracle)
    assert [event.token_id for event in generation if event.token_id >= 0] == plain_tokens
    assert oracle.continuation == plain_tokens
    assert generation.stats.spec_accepted == generation.stats.spec_drafted > 0
    assert speculation.is_kept and speculation.segments == kept  # the load's, not captured again
    idle = dict(engine.idle_ledger.by_owner)
    assert {k: v for k, v in engine.ledger.snapshot().by_owner.items() if k not in TRANSIENT_OWNERS} == idle


def test_chained_steps_equal_plain_greedy_and_take_what_steps_launched_from_the_host_take(tiny_path, plain_tokens,
                                                                                           monkeypatch):
    """Steps launched before the step before them is read (``launch_chained``) take their token, positions and
    draft rows from that step's acceptance on the device; an oracle that refuses about half the drafts makes
    the count taken vary, so the chain starts from every row and reads the oracle's window at every offset.
    An oracle position's token depends on the position alone (a chained step's window draws positions a step
    launched from the host skips): launched from the host instead, the same request takes exactly the same
    drafts (a window read at the wrong place would not)."""
    num_tokens, depth = (NUM_GENERATED, 3) if BACKEND == "cuda" else (6, 1)
    expected = plain_tokens if BACKEND == "cuda" else reference_greedy(tiny_path, PROMPT, num_tokens)
    engine = Engine.load(engine_config(tiny_path, runtime=_runtime(mtp=True, spec_depth=depth, spec_policy="fixed")),
                         show_progress=False)
    chained = []
    launch_chained = DeviceSpeculation.launch_chained

    def counted(self, chained_depth, *args, **kwargs):
        chained.append(chained_depth)
        return launch_chained(self, chained_depth, *args, **kwargs)

    def run() -> tuple[int, int, int]:
        # seed 11: the simulator's drafts at positions 3 (refused), 4 and 6 (taken); the truth at 19 of the GPU's 40
        oracle = DraftOracle(expected, len(PROMPT), 0.5, engine.spec.vocab_size, seed=11)
        generation = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=num_tokens, seed=0),
                                     draft_oracle=oracle)
        assert [event.token_id for event in generation if event.token_id >= 0] == expected
        stats = generation.stats
        return stats.spec_drafted, stats.spec_accepted, stats.spec_rounds

    monkeypatch.setattr(DeviceSpeculation, "launch_chained", counted)
    drafted, accepted, rounds = run()
    assert chained and set(chained) == {depth} and 0 < accepted < drafted
    num_chained = len(chained)
    monkeypatch.setattr(Speculation, "_is_chained_next", lambda self, depth, num_left: False)
    assert run() == (drafted, accepted, rounds) and len(chained) == num_chained


def test_device_speculation_with_the_depth_policy_equals_plain_greedy(tiny_path, plain_tokens, monkeypatch):
    """spec_policy "auto": runs of plain steps on the device between the policy's looks, drafts where it
    probes. A first run of three tokens (plain decode not timed yet) ends in a one-row verify step queued behind its
    greedy steps, on the token the last picked on the device, and depth 1 is tried after it."""
    monkeypatch.setattr(speculative, "FIRST_RUN_TOKENS", 3)
    queued = []
    launch_after_greedy = DeviceSpeculation.launch_after_greedy

    def counted(self, *args):
        queued.append(True)
        return launch_after_greedy(self, *args)

    monkeypatch.setattr(DeviceSpeculation, "launch_after_greedy", counted)
    num_tokens = NUM_GENERATED if BACKEND == "cuda" else 6
    expected = plain_tokens if BACKEND == "cuda" else reference_greedy(tiny_path, PROMPT, num_tokens)
    engine = Engine.load(engine_config(tiny_path, runtime=_runtime(mtp=True, spec_depth=2, spec_policy="auto")),
                         show_progress=False)
    tokens, stats = greedy(engine, PROMPT, num_tokens)
    assert tokens == expected
    assert queued and stats.spec_rounds > 0


class _ScriptedPolicy(DepthPolicy):
    """Depth 1, then a plain run of two steps, then depth 1 again (every depth timed), then plain decode."""

    def __init__(self):
        super().__init__(1)
        self.answers = [1, 0, 1]

    def depth(self, limit):
        return min(limit, self.answers.pop(0) if self.answers else 0)

    def plain_steps(self):
        return 0

    def is_timed(self, depth):
        return True


def test_a_step_chained_behind_a_plain_runs_verify_step_equals_plain_greedy(tiny_path, plain_tokens, monkeypatch):
    """After a plain run whose verify step is queued behind its greedy step, the next step of a depth the request
    ran before is chained behind that verify step: its drafts, token and positions are what the verify step's
    acceptance wrote on the device (``DeviceSpeculation.launch_chained`` after a step of no drafts)."""
    monkeypatch.setattr(speculative, "PLAIN_RUN_TOKENS", 2)
    chained = []
    launch_chained = DeviceSpeculation.launch_chained

    def counted(self, depth, *args, **kwargs):
        chained.append((self._pending[-1][0], depth))
        return launch_chained(self, depth, *args, **kwargs)

    monkeypatch.setattr(DeviceSpeculation, "launch_chained", counted)
    num_tokens = NUM_GENERATED if BACKEND == "cuda" else 7  # the prefill's, depth 1 (2), the run (2), depth 1 (2)
    expected = plain_tokens if BACKEND == "cuda" else reference_greedy(tiny_path, PROMPT, num_tokens)
    engine = Engine.load(engine_config(tiny_path, runtime=_runtime(mtp=True, spec_depth=1, spec_policy="auto")),
                         show_progress=False)
    engine.depth_policy = _ScriptedPolicy()
    tokens, stats = greedy(engine, PROMPT, num_tokens)
    assert tokens == expected
    assert chained[0] == (0, 1) and stats.spec_rounds >= 2


@pytest.mark.skipif(BACKEND != "cuda", reason="the loan on the device: GPU only (slow in the simulator)")
def test_device_speculation_with_the_loan_equals_plain_greedy(tiny_path, plain_tokens):
    runtime = _runtime(**{**LOAN_RUNTIME, "spec_depth": 3, "spec_policy": "fixed"})
    engine = Engine.load(engine_config(tiny_path, runtime=runtime, loan={"enabled": True, "plugins": WRITE_UP_PLUGINS}),
                         show_progress=False)
    for _ in range(2):  # the second request captures over the weights the loan uploaded again
        # seeded: no prefix reuse, each request prefills the whole prompt under a loan
        generation = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NUM_GENERATED, seed=0))
        assert [event.token_id for event in generation if event.token_id >= 0] == plain_tokens
        assert generation.stats.spec_rounds and engine.mtp.is_resident


def test_kept_draft_segments_are_captured_again_over_what_a_loan_uploads_again(tiny_path):
    """A loan frees the verifier arena and the MTP block and uploads them again: the kept segments read the
    old addresses, so the next request's start captures the whole kept set again, kept, at the same size."""
    engine = Engine.load(engine_config(tiny_path, runtime=_runtime(mtp=True, spec_depth=2, spec_policy="fixed")),
                         show_progress=False)
    if BACKEND == "cudasim":  # the load's warm-up (off in the simulator) keeps the segments
        engine.prepare_decode()
    speculation, kept_bytes = engine.runner.speculation, engine.ledger.snapshot().by_owner[DECODE_GRAPHS_OWNER]
    kept = speculation.segments
    speculation.begin_request(engine.output_head())  # nothing uploaded again: the same segments
    assert speculation.segments == kept
    for name in (VERIFIER, MTP_DRAFT_HEAD):
        engine.resources[name].release()
        engine.resources[name].restore()
    speculation.begin_request(engine.output_head())
    again = speculation.segments
    assert speculation.is_kept and len(again) == len(kept) == 4 and all(a is not b for a, b in zip(again, kept))
    assert engine.ledger.snapshot().by_owner[DECODE_GRAPHS_OWNER] == kept_bytes
    with pytest.raises(EngineError, match="pass the rows"):  # no verify step has left its rows for a draft
        speculation.draft(None, [5], 3, 2)
    hidden = engine.ops.upload(ACTIVATIONS_OWNER, np.zeros((1, engine.spec.hidden_size), np.float32))
    speculation.draft(hidden, [5], 3, 2)  # replays what the request's start captured
    engine.ops.synchronize()
    engine.ops.free(hidden)
    speculation.end_request()
    assert speculation.segments == again
