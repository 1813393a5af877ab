"""The fault matrix: a failure injected at every step of the loan transaction of the real engine, on
the numpy backend (1,000 seeded requests) and under the CUDA simulator (a few), with the checks of
``fault_matrix.run_matrix`` after each request."""

import os

import pytest
from engine_setup import LOAN_RUNTIME, engine_config, write_small_moe
from fault_matrix import greedy_tokens, loan_on_every_request, run_matrix

from strata.engine.facade import Engine

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
