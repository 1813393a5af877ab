"""Log-probabilities of the picked tokens (``SamplingParams.num_logprobs``): the reference forward's log
softmax at every step, the same tokens as without them, with speculation too, and on the kernels."""

import numpy as np
import pytest
from engine_setup import SIMULATOR_TINY, engine_config, write_small_moe
from gguf import GGMLQuantizationType as QType
from numba import config as numba_config

from strata.backend.select import has_cuda_device
from strata.engine.facade import Engine
from strata.engine.sampling import SamplingParams, TokenLogprobs, token_logprobs
from strata.errors import ConfigError
from strata.model.gguf_file import open_gguf
from strata.model.reference import KVCache, ReferenceModel
from strata.model.synth import write_synthetic_model

PROMPT = [int(t) for t in np.random.default_rng(4).integers(3, 500, size=40)]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return write_small_moe(tmp_path_factory.mktemp("models") / "small-moe-mtp.gguf", with_mtp=True)


def reference_steps(path, prompt: list[int], num_tokens: int) -> list[np.ndarray]:
    """The reference forward's logits [V] before each greedy token."""
    model = open_gguf(path)
    ref = ReferenceModel.from_gguf(model)
    kv = KVCache.for_spec(model.spec, 1024)
    logits, steps = ref.forward(np.array(prompt), 0, kv)[-1], []
    for position in range(len(prompt), len(prompt) + num_tokens):
        steps.append(logits)
        logits = ref.forward(np.array([int(np.argmax(logits))]), position, kv)[-1]
    return steps


def events(engine, prompt, params):
    return [event for event in engine.generate(prompt, params) if event.token_id >= 0]


def test_token_logprobs_are_the_log_softmax_with_the_most_likely_first_lower_ids_first_on_ties():
    logits = np.array([1.0, 3.0, 0.0, 3.0, 3.0, -np.inf], np.float32)
    picked = token_logprobs(logits, 2, 2)
    log_z = np.log(np.exp(1.0) + 3 * np.exp(3.0) + 1.0)
    assert picked.logprob == pytest.approx(-log_z)
    assert [i for i, _ in picked.top] == [1, 3] and picked.top[0][1] == pytest.approx(3.0 - log_z)
    assert [i for i, _ in token_logprobs(logits, 0, 9).top] == [1, 3, 4, 0, 2, 5]  # all of them, -inf last
    assert token_logprobs(logits, 5, 0) == TokenLogprobs(-np.inf)  # a banned token; no alternatives asked for
    with pytest.raises(ConfigError, match=r"num_logprobs must be null or an integer in \[0, 20\], got 21"):
        SamplingParams(num_logprobs=21)


@pytest.mark.parametrize("runtime", [{}, {"mtp": True, "spec_depth": 2, "spec_policy": "fixed"}],
                         ids=["plain", "speculative"])
def test_greedy_logprobs_are_the_references_and_leave_the_tokens_as_they_were(mtp_path, runtime):
    engine = Engine.load(engine_config(mtp_path, runtime=runtime), show_progress=False)
    picked = events(engine, PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, num_logprobs=4))
    steps = reference_steps(mtp_path, PROMPT, NUM_TOKENS)
    assert [e.token_id for e in picked] == [int(np.argmax(logits)) for logits in steps]
    for event, logits in zip(picked, steps):
        expected = token_logprobs(logits, event.token_id, 4)
        assert event.logprobs.logprob == pytest.approx(expected.logprob, abs=1e-4)
        assert [i for i, _ in event.logprobs.top] == [i for i, _ in expected.top]
        assert event.logprobs.top[0] == (event.token_id, event.logprobs.logprob)
    if runtime:
        assert engine.mtp is not None
    without = events(engine, PROMPT[::-1], SamplingParams(temperature=0, max_tokens=NUM_TOKENS))
    assert all(e.logprobs is None for e in without)


def test_asking_for_logprobs_changes_no_sampled_token(mtp_path):
    engine = Engine.load(engine_config(mtp_path), show_progress=False)
    params = dict(temperature=0.9, top_k=40, seed=11, max_tokens=NUM_TOKENS)
    plain = events(engine, PROMPT, SamplingParams(**params))
    with_logprobs = events(engine, PROMPT, SamplingParams(**params, num_logprobs=0))
    assert [e.token_id for e in with_logprobs] == [e.token_id for e in plain]
    assert all(e.logprobs.top == () and e.logprobs.logprob <= 0 for e in with_logprobs)


def test_sampled_speculation_records_each_emitted_tokens_own_logprobs(mtp_path):
    # accepted drafts and the residual's draw alike: a token among its top 20 reads its own entry there
    runtime = {"mtp": True, "spec_depth": 3, "spec_policy": "fixed"}
    engine = Engine.load(engine_config(mtp_path, runtime=runtime), show_progress=False)
    params = dict(temperature=0.3, seed=5, max_tokens=24)
    generation = engine.generate(PROMPT, SamplingParams(**params, num_logprobs=20))
    picked = [e for e in generation if e.token_id >= 0]
    assert len(picked) == 24 and generation.stats.spec_accepted > 0, generation.stats
    assert [e.token_id for e in picked] == [e.token_id for e in events(engine, PROMPT, SamplingParams(**params))]
    in_top = [e for e in picked if e.token_id in dict(e.logprobs.top)]
    assert len(in_top) >= 16
    assert all(dict(e.logprobs.top)[e.token_id] == e.logprobs.logprob for e in in_top)


GPU_BACKEND = "cuda" if has_cuda_device() else "cudasim"


@pytest.mark.skipif(GPU_BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                    reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")
def test_a_greedy_request_with_logprobs_decodes_on_the_host_of_a_gpu_engine(tmp_path, monkeypatch):
    path = write_synthetic_model(tmp_path / "tiny.gguf", SIMULATOR_TINY, QType.Q4_0, seed=3)
    prompt, num_tokens = [t % 250 for t in PROMPT[:6]], 2
    engine = Engine.load(engine_config(path, runtime={"backend": GPU_BACKEND, "vram_budget": "64MiB",
                                                      "warmup": False}), show_progress=False)
    assert engine.config.runtime.greedy_on_device and engine.runner.can_pick_greedy_on_device

    def on_the_device(*args, **kwargs):
        raise AssertionError("a request with log-probabilities picked its tokens on the device")

    monkeypatch.setattr(engine.runner, "greedy_tokens", on_the_device)
    picked = events(engine, prompt, SamplingParams(temperature=0, max_tokens=num_tokens, num_logprobs=2))
    steps = reference_steps(path, prompt, num_tokens)
    assert [e.token_id for e in picked] == [int(np.argmax(logits)) for logits in steps]
    for event, logits in zip(picked, steps):
        assert event.logprobs.logprob == pytest.approx(token_logprobs(logits, event.token_id, 0).logprob, abs=2e-3)
