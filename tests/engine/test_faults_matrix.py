"""The fault matrix: a failure injected at every step of the loan transaction of the real engine, on
the numpy backend (1,000 seeded requests) and under the CUDA simulator (a few), with the checks of
``fault_matrix.run_matrix`` after each request."""

import gc
import os

import numpy as np
import pytest
from engine_setup import LOAN_RUNTIME, SIMULATOR_TINY, engine_config, reference_greedy, write_small_moe
from fault_matrix import SITES, InjectedFault, Injector, greedy_tokens, loan_on_every_request, run_matrix, state_of
from gguf import GGMLQuantizationType as QType
from numba import config as numba_config

from strata.engine.facade import Engine
from strata.gpu.ledger import ACTIVATIONS_OWNER, TRANSIENT_OWNERS
from strata.model.synth import write_synthetic_model

NUM_REQUESTS = int(os.environ.get("STRATA_FAULT_REQUESTS", "1000"))  # on numpy, over the two configurations
LOAN_SITES = ["release", "budget", "allocate workspace", "allocate workspace: out of memory", "prefill chunk",
              "cache growth", "restore"]
# without the loan the transaction still plans, allocates, prefills in chunks and, the ring having
# evicted cached experts, stages them back
STREAMING_SITES = ["budget", "allocate workspace", "allocate workspace: out of memory", "prefill chunk", "restage"]
PROBES = [(5, 9, 200, 17, 3), (300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316)]


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return write_small_moe(tmp_path_factory.mktemp("models") / "small-moe-mtp.gguf", with_mtp=True)


def loan_config(path):
    return engine_config(path, runtime=LOAN_RUNTIME, planner={"max_chunk_tokens": 16},
                         loan={"enabled": True, "plugins": ["loan_mtp", "loan_head", "retain_startup_chunk"]})


def streaming_config(path):
    return engine_config(path, planner={"max_chunk_tokens": 16})


def fresh_probes(config, is_every_request: bool) -> dict:
    expected = {}
    for probe in PROBES:
        engine = Engine.load(config, show_progress=False)
        if is_every_request:
            loan_on_every_request(engine)
        expected[probe] = greedy_tokens(engine, list(probe), 3)
    return expected


@pytest.mark.parametrize("name, make_config, sites, share", [
    ("loan", loan_config, LOAN_SITES, 0.6),
    ("streaming", streaming_config, STREAMING_SITES, 0.4),
])
def test_every_step_of_the_transaction_fails_cleanly_and_leaves_the_engine_as_a_fresh_one(
        mtp_path, name, make_config, sites, share):
    config = make_config(mtp_path)
    is_loan = config.loan.enabled
    expected = fresh_probes(config, is_loan)
    engine = Engine.load(config, show_progress=False)
    if is_loan:
        loan_on_every_request(engine)
    tally = run_matrix(engine, expected, sites, int(NUM_REQUESTS * share), seed=31, prompt_tokens=(4, 40),
                       vocab_size=engine.spec.vocab_size)
    for site, (num_requests, num_fired, num_failed) in tally.items():
        assert num_requests > 0 and num_fired > 0, (site, tally)  # every step was hit
    assert sum(f for _, _, f in tally.values()) > 0 and sum(n - f for n, _, f in tally.values()) > 0
    if is_loan:
        assert engine.counters.num_loans_failed > 0 and engine.loan.last_report.is_taken


@pytest.mark.skipif(not numba_config.ENABLE_CUDASIM, reason="the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")
def test_faults_on_the_kernels_under_the_simulator_fail_cleanly_and_the_next_request_is_the_reference(tmp_path):
    # each request takes tens of seconds in the simulator: one fault per step that only the GPU
    # backends have or that the kernels run (the captured decode step's graph, a prefill chunk, the
    # workspace), then one request against the reference forward (which a fresh engine matches:
    # tests/engine/test_engine_cuda.py)
    path = write_synthetic_model(tmp_path / "tiny.gguf", SIMULATOR_TINY, QType.Q4_0, seed=3)
    engine = Engine.load(engine_config(path, runtime={"backend": "cudasim", "vram_budget": "64MiB",
                                                      "warmup": False}), show_progress=False)
    assert engine.runner.decode_step is not None  # decode is captured: the graph-capture step exists
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 250, size=2)]
    expected = reference_greedy(path, prompt, 2)
    faults = [("graph capture", 1, 2), ("prefill chunk", 1, 1), ("allocate workspace", 1, 1)]
    injector = Injector(engine, [name for name, _, _ in faults])
    for name, nth, max_tokens in faults:
        before = state_of(engine)
        injector.arm(SITES[name], nth)
        is_failed = False
        try:
            greedy_tokens(engine, prompt, max_tokens)
        except InjectedFault:
            is_failed = True  # the exception goes here: its frames would hold device temporaries
        injector.disarm()
        gc.collect()  # a GPU backend's temporaries leave the ledger when they are collected
        assert is_failed and injector.num_fired == 1, name
        assert lasting(engine) == dict(engine.idle_ledger.by_owner), name  # the transaction's own check
        assert state_of(engine)[0] == before[0] and state_of(engine)[2] == before[2], name
    assert greedy_tokens(engine, prompt, 2) == expected
    gc.collect()
    assert lasting(engine) == dict(engine.idle_ledger.by_owner)
    transient = {k: v for k, v in engine.ledger.snapshot().by_owner.items() if k in TRANSIENT_OWNERS and v}
    assert transient.get(ACTIVATIONS_OWNER, 0) <= 4096, transient  # a failed capture's temporaries went


def lasting(engine) -> dict:
    """The ledger without the owners of computations in flight (on a GPU backend, temporaries leave it
    when collected, and freed blocks wait in the allocator's cache)."""
    return {k: v for k, v in engine.ledger.snapshot().by_owner.items() if k not in TRANSIENT_OWNERS}
