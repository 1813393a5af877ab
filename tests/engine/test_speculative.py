"""MTP speculative decode on the numpy backend: greedy output equals plain greedy decode token for
token, at every depth, with the loan on and off; drafts taken or refused; the draft block against
the NumPy reference; speculative sampling's distribution; the errors a bad configuration gets."""

import numpy as np
import pytest
from engine_setup import LOAN_RUNTIME, engine_config, greedy, write_small_moe
from loan_setup import WRITE_UP_PLUGINS

from strata.bench.draft_oracle import DraftOracle
from strata.engine.decode.depth_policy import DepthPolicy
from strata.engine.decode.speculative import Speculation
from strata.engine.facade import Engine
from strata.engine.sampling import SamplingParams
from strata.engine.stream_stats import StreamStats
from strata.errors import ConfigError
from strata.model.gguf_file import open_gguf
from strata.model.reference import KVCache, ReferenceModel

PROMPT = list(range(5, 60))
NUM_TOKENS = 48


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return write_small_moe(tmp_path_factory.mktemp("models") / "small-moe-mtp.gguf", with_mtp=True)


@pytest.fixture(scope="module")
def plain_tokens(mtp_path):
    engine = Engine.load(engine_config(mtp_path), show_progress=False)
    tokens, stats = greedy(engine, PROMPT, NUM_TOKENS)
    assert not stats.is_speculative and len(tokens) == NUM_TOKENS
    return tokens


def _speculative(path, depth: int, policy: str = "fixed", **runtime):
    return Engine.load(engine_config(path, runtime={"mtp": True, "spec_depth": depth, "spec_policy": policy,
                                                    **runtime}), show_progress=False)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_greedy_with_speculation_equals_plain_greedy(mtp_path, plain_tokens, depth):
    engine = _speculative(mtp_path, depth)
    tokens, stats = greedy(engine, PROMPT, NUM_TOKENS)
    assert tokens == plain_tokens
    assert stats.is_speculative and stats.spec_rounds > 0 and stats.spec_drafted >= stats.spec_rounds
    assert f"| spec drafted {stats.spec_drafted}, accepted {stats.spec_accepted}" in stats.timing_line()


@pytest.mark.parametrize("probability", [1.0, 0.6])
def test_drafts_taken_or_refused_keep_the_output(mtp_path, plain_tokens, probability):
    engine = _speculative(mtp_path, 3)
    oracle = DraftOracle(plain_tokens, len(PROMPT), probability, engine.spec.vocab_size, seed=1)
    generation = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS), draft_oracle=oracle)
    tokens = [event.token_id for event in generation if event.token_id >= 0]
    stats = generation.stats
    assert tokens == plain_tokens
    if probability == 1.0:  # every draft taken: d + 1 tokens a verify step
        assert stats.spec_accepted == stats.spec_drafted and stats.spec_rounds <= -(-(NUM_TOKENS - 1) // 4)
    else:
        assert 0 < stats.spec_accepted < stats.spec_drafted
    assert stats.spec_accepted_by_position[0] >= stats.spec_accepted_by_position[-1]
    assert "draft oracle" in stats.timing_line()
    # the KV cache holds exactly the verified tokens: the next request reuses them as a prefix
    assert engine.kv_tokens == PROMPT + plain_tokens[:-1]


def test_the_draft_oracle_records_the_continuation_from_the_request_itself(mtp_path, plain_tokens):
    engine = _speculative(mtp_path, 2)
    oracle = DraftOracle(None, 0, 1.0, engine.spec.vocab_size)
    generation = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS), draft_oracle=oracle)
    assert [event.token_id for event in generation if event.token_id >= 0] == plain_tokens
    assert oracle.continuation == plain_tokens and oracle.first_position == len(PROMPT)
    assert generation.stats.spec_accepted == generation.stats.spec_drafted > 0
    assert engine.kv_tokens == PROMPT + plain_tokens[:-1]


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 6, 7])
def test_a_request_ending_inside_an_accepted_run_returns_what_plain_decode_returns(mtp_path, plain_tokens,
                                                                                   max_tokens):
    engine = _speculative(mtp_path, 4)
    oracle = DraftOracle(plain_tokens, len(PROMPT), 1.0, engine.spec.vocab_size)
    generation = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens), draft_oracle=oracle)
    assert [event.token_id for event in generation if event.token_id >= 0] == plain_tokens[:max_tokens]


def test_the_context_limit_cuts_speculation_where_it_cuts_plain_decode(mtp_path):
    context = len(PROMPT) + 9
    plain = Engine.load(engine_config(mtp_path, runtime={"context_tokens": context}), show_progress=False)
    expected, _ = greedy(plain, PROMPT, 50)
    engine = _speculative(mtp_path, 4, context_tokens=context)
    oracle = DraftOracle(expected, len(PROMPT), 1.0, engine.spec.vocab_size)
    generation = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=50), draft_oracle=oracle)
    assert [event.token_id for event in generation if event.token_id >= 0] == expected


def test_speculation_with_the_loan_equals_plain_greedy(mtp_path, plain_tokens):
    runtime = {**LOAN_RUNTIME, "spec_depth": 3, "spec_policy": "fixed"}
    engine = Engine.load(engine_config(mtp_path, runtime=runtime, loan={"enabled": True, "plugins": WRITE_UP_PLUGINS}),
                         show_progress=False)
    tokens, stats = greedy(engine, PROMPT, NUM_TOKENS)
    assert tokens == plain_tokens and stats.loan.is_taken and stats.spec_rounds
    assert {"mtp_draft_head", "mtp_experts"} <= set(stats.loan.released)
    assert dict(engine.ledger.snapshot().by_owner) == dict(engine.idle_ledger.by_owner)


def test_a_loaned_prefill_fills_the_draft_cache_as_a_plain_one(mtp_path):
    # the loan releases the MTP block's draft head and experts during prefill, but not the tensors its pass over
    # the prompt reads: the block's cache holds the prompt after a loaned prefill as after a plain one
    runtime = {**LOAN_RUNTIME, "spec_depth": 3, "spec_policy": "fixed"}
    caches = []
    for loan in ({"enabled": True, "plugins": WRITE_UP_PLUGINS}, {}):
        engine = Engine.load(engine_config(mtp_path, runtime=runtime, loan=loan), show_progress=False)
        prompt_weights = engine.mtp.prompt_weights
        assert prompt_weights is not None and not set(prompt_weights.sources) & set(engine.mtp.weights.sources)
        _, stats = greedy(engine, PROMPT, 1)
        assert stats.loan.is_taken == bool(loan) and prompt_weights.is_resident
        if loan:
            assert "mtp_draft_head" in stats.loan.released and stats.prefill_mtp_seconds > 0
        caches.append(engine.mtp.kv.data[:, :, :len(PROMPT) - 1].copy())
    np.testing.assert_array_equal(caches[0], caches[1])
    assert np.any(caches[0] != 0)


def test_a_block_with_its_own_embedding_keeps_its_prompt_pass_in_the_loan(mtp_path):
    # a block with an embedding table of its own (a vocabulary's rows) lends every dense tensor, as before
    import dataclasses

    from strata.engine import loading

    model = open_gguf(mtp_path)
    kept = loading.mtp_prompt_sources(model)
    prefix = f"blk.{model.spec.num_layers}."
    assert sorted(kept) == sorted(f"{prefix}{name}.weight" for name in loading.MTP_PROMPT_TENSORS
                                  if f"{prefix}{name}.weight" in model.tensors)
    assert f"{prefix}nextn.eh_proj.weight" in kept
    with_embedding = dataclasses.replace(model, tensors={**model.tensors,
                                                         f"{prefix}nextn.embed_tokens.weight": model.tensors[
                                                             "token_embd.weight"]})
    assert loading.mtp_prompt_sources(with_embedding) == {}


def test_the_draft_block_matches_the_reference(mtp_path):
    engine = _speculative(mtp_path, 1)
    model = open_gguf(mtp_path)
    reference = ReferenceModel.from_gguf(model)
    tokens = np.array(PROMPT[:12])
    kv = KVCache.for_spec(model.spec, 64)
    hidden = reference.forward_hidden(tokens, 0, kv)  # [12, D]
    expected = reference.mtp_hidden(hidden[:-1], tokens[1:], 0, kv)
    got = engine.mtp.hidden(hidden[:-1].astype(np.float32), tokens[1:], 0)
    assert np.max(np.abs(got - expected)) <= 2e-3 * np.max(np.abs(expected))
    logits = reference.mtp_forward(hidden[:-1], tokens[1:], 0, KVCache.for_spec(model.spec, 64))[-1]
    assert int(np.argmax(engine.mtp.logits(got))) == int(np.argmax(logits))


def test_the_prompts_draft_cache_holds_what_the_whole_block_writes(mtp_path):
    # prefill writes the block's keys and values alone (cache_prompt), not its attention output and experts,
    # whose rows no draft reads: the cache must hold what the whole block (hidden) writes there, bit for bit
    engine = _speculative(mtp_path, 1)
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((11, engine.spec.hidden_size)).astype(np.float32)
    tokens = np.array(PROMPT[1:12])
    engine.mtp.hidden(hidden, tokens, 3)
    whole = engine.mtp.kv.data.copy()
    engine.mtp.kv.data[...] = 0
    engine.mtp.cache_prompt(hidden, tokens, 3)
    np.testing.assert_array_equal(engine.mtp.kv.data, whole)
    assert np.any(whole != 0)


def test_speculative_sampling_draws_from_the_target_distribution():
    """The first token a step emits follows the target's distribution p whatever the draft's q."""
    vocab = 6
    target = np.log(np.array([0.35, 0.25, 0.2, 0.1, 0.07, 0.03]))
    draft = np.log(np.array([0.05, 0.05, 0.1, 0.2, 0.3, 0.3]))
    params = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(0)
    spec = Speculation(None, None, DepthPolicy(1, is_fixed=True), None, params, rng, StreamStats())
    counts = np.zeros(vocab)
    num_draws = 20000
    for _ in range(num_draws):
        q = []
        proposed = spec._propose(0, draft, 0, q)
        emitted, _ = spec._verify([proposed], np.stack([target, target]), q)
        counts[emitted[0]] += 1
    expected = np.exp(target) * num_draws
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 20.5  # 5 degrees of freedom: p < 0.001 under the target distribution


def test_sampled_speculation_keeps_the_ledger_and_the_budget(mtp_path):
    engine = _speculative(mtp_path, 2)
    before = engine.ledger.snapshot()
    generation = engine.generate(PROMPT, SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=20))
    tokens = [event.token_id for event in generation if event.token_id >= 0]
    assert len(tokens) == 20 and all(0 <= t < engine.spec.vocab_size for t in tokens)
    assert generation.stats.spec_rounds
    assert engine.ledger.snapshot() == before


def test_the_policy_backs_off_when_drafts_never_pay():
    policy = DepthPolicy(4)
    depths = []
    for _ in range(60):
        depth = policy.depth(10)
        depths.append(depth)
        policy.record(depth, 0.010 + 0.004 * depth, num_accepted=0)  # drafts cost, none taken
    assert depths[:3] == [0, 0, 1]  # plain first (timed from its second step), then one probe
    assert 2 not in depths and depths[-10:].count(0) >= 9


def test_two_refused_drafts_end_the_trial_of_a_depth_that_costs_a_third_more():
    policy = DepthPolicy(1)
    depths = []
    for _ in range(20):
        depths.append(depth := policy.depth(100))
        policy.record(depth, 0.0132 if depth else 0.010, num_accepted=0)  # a verify step: 1.32 plain steps
    # a refusal leaves the draft a third of a chance, two a quarter: 1.25 tokens cannot pay 1.32 steps
    assert depths.count(1) == 2 and depths[:4] == [0, 0, 1, 1]


def test_steps_timed_at_zero_seconds_leave_the_policy_answering():
    policy = DepthPolicy(2)
    for depth, seconds in ((0, 0.0), (0, 0.0), (1, 0.01), (1, 0.01), (0, 0.0)):
        policy.record(depth, seconds, num_accepted=0)
    assert policy.depth(10) == 0 and policy.plain_steps() > 0


def test_a_deeper_depth_is_not_tried_where_steps_grow_with_depth_past_what_it_could_give():
    policy = DepthPolicy(4)
    for depth, seconds, num_accepted in ((0, 0.010, 0), (0, 0.010, 0), (1, 0.021, 1), (1, 0.021, 1)):
        assert policy.depth(10) == depth
        policy.record(depth, seconds, num_accepted)
    # every draft taken, but a step costs a plain step more per row (a small budget streams each row's experts):
    # depth 2 at the line through depths 0 and 1 (32 ms) gives at most 3 tokens, fewer a second than plain decode
    assert policy.depth(10) == 0


def test_probes_grow_rarer_while_the_best_depth_stays_the_same():
    policy = DepthPolicy(4, probe_every=32)
    depths = []
    for step in range(2000):
        cost = 0.010 + 0.004 * (depth := policy.depth(10))
        depths.append(depth)
        policy.record(depth, cost, num_accepted=0)
    probes = [step for step, depth in enumerate(depths) if depth and step > 2]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 512  # each probe that changes nothing doubles the interval
    assert len(probes) <= 8
    policy.record(1, 0.001, num_accepted=1)  # a probe finds drafts paying: they are drafted at once
    assert policy.depth(10) >= 1


def test_the_policy_drafts_deep_when_drafts_are_taken():
    policy = DepthPolicy(4)
    for _ in range(40):
        depth = policy.depth(10)
        policy.record(depth, 0.010 + 0.001 * depth, num_accepted=depth)  # cheap verify, every draft taken
    assert policy.depth(10) == 4 and policy.expected_tokens(4) > 4.5
    assert policy.depth(2) == 2  # never past what the request still wants


def test_one_slow_first_step_does_not_keep_a_depth_out():
    policy = DepthPolicy(2)
    policy.record(0, 0.010, 0)
    policy.record(0, 0.010, 0)
    assert policy.depth(10) == 1
    policy.record(1, 0.200, num_accepted=1)  # a first step that paid once-only work
    assert policy.depth(10) == 1  # tried again: one step is not a time
    policy.record(1, 0.012, num_accepted=1)
    assert policy.seconds[1] == 0.012  # the second step's time replaces the first's
    depths = []
    for _ in range(20):
        depths.append(depth := policy.depth(10))
        policy.record(depth, 0.010 + 0.002 * depth, num_accepted=depth)
    assert depths[-5:] == [2] * 5
    assert "1: " in policy.summary() and "acceptance by place 1.00 1.00" in policy.summary()


def _simulated_speedup(acceptance: float, first_step_seconds: float, num_tokens: int, seed: int) -> float:
    """Tokens a second against plain decode's, for a policy run as speculation runs it (plain runs of 16 steps
    where it answers 0): each draft taken with probability ``acceptance`` while the ones before it were; a step
    at depth d costing 1 + 0.35 d plain steps (as the resident 30B's did on the GPU), its first at each depth
    ``first_step_seconds`` more (once-only work)."""
    rng, policy, plain_seconds = np.random.default_rng(seed), DepthPolicy(4), 0.0034
    num_left, seconds = num_tokens, 0.0
    while num_left > 0:
        depth = policy.depth(num_left - 1)
        if depth == 0:
            num_plain = min(num_left, max(16, policy.plain_steps()))
            for _ in range(num_plain):
                policy.record(0, plain_seconds, 0)
            seconds, num_left = seconds + num_plain * plain_seconds, num_left - num_plain
            continue
        num_accepted = 0
        while num_accepted < depth and rng.random() < acceptance:
            num_accepted += 1
        step = plain_seconds * (1 + 0.35 * depth) + (first_step_seconds if not policy.num_steps_at[depth] else 0)
        policy.record(depth, step, num_accepted)
        seconds, num_left = seconds + step, num_left - num_accepted - 1
    return num_tokens * plain_seconds / seconds


@pytest.mark.parametrize("first_step_seconds", [0.0, 0.01])
def test_the_policy_finds_drafts_that_pay_despite_slow_first_steps_and_early_refusals(first_step_seconds):
    # the best fixed depth gives 1.44x at acceptance 0.8 and 1.19x at 0.6; drafts never taken must cost little
    speedups = {p: np.median([_simulated_speedup(p, first_step_seconds, 512, seed) for seed in range(25)])
                for p in (0.8, 0.6, 0.0)}
    assert speedups[0.8] > 1.3 and speedups[0.6] > 1.08 and speedups[0.0] > 0.98, speedups


def test_bad_speculation_settings_name_the_key(mtp_path, tmp_path):
    with pytest.raises(ConfigError, match="runtime.mtp = true needs runtime.spec_depth in 1..8"):
        engine_config(mtp_path, runtime={"mtp": True, "spec_depth": 0})
    with pytest.raises(ConfigError, match="spec_depth"):
        engine_config(mtp_path, runtime={"mtp": True, "spec_depth": 9})
    with pytest.raises(ConfigError, match="spec_policy"):
        engine_config(mtp_path, runtime={"mtp": True, "spec_depth": 2, "spec_policy": "greedy"})
    plain = write_small_moe(tmp_path / "no-mtp.gguf")
    with pytest.raises(ConfigError, match="no-mtp.gguf has no MTP block"):
        _speculative(plain, 2)
