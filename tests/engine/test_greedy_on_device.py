"""How a request drives greedy decode on the device (``runtime.greedy_on_device``): the first token
from the prefill's logits, the rest from ``ModelRunner.greedy_tokens`` with the state's and the
request's logit bias, never more steps than the request and the context allow. The numpy backend
has no captured decode, so a recording runner stands in for the device's loop; the kernels and the
captured loop are tested in tests/kernels/test_ops_greedy.py and tests/engine/test_engine_cuda.py."""

import numpy as np
import pytest
from engine_setup import engine_config, write_small_moe

from strata.engine.facade import Engine
from strata.engine.sampling import SamplingParams

PROMPT = [int(t) for t in np.random.default_rng(8).integers(3, 500, size=40)]


class RecordingRunner:
    """The engine's runner, plus a ``greedy_tokens`` that steps on the host as the device does
    (forward, head, bias in list order, argmax) and records how it was called."""

    can_pick_greedy_on_device = True

    def __init__(self, engine):
        self._engine, self._runner = engine, engine.runner
        self.calls = []

    def greedy_tokens(self, token, position, num_steps, head, bias, stats):
        ids, values = bias
        self.calls.append((token, position, num_steps, ids.tolist(), values.tolist()))
        for _ in range(num_steps):
            logits = self._engine.output_logits(self._runner.forward(np.array([token]), position, None, stats))
            for token_id, value in zip(ids, values):
                logits[token_id] += value
            token, position = int(np.argmax(logits)), position + 1
            yield token

    def __getattr__(self, name):
        return getattr(self._runner, name)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_small_moe(tmp_path_factory.mktemp("models") / "small-moe.gguf")


def _engines(moe_path, **runtime):
    host = Engine.load(engine_config(moe_path, runtime={"greedy_on_device": False, **runtime}), show_progress=False)
    device = Engine.load(engine_config(moe_path, runtime=runtime), show_progress=False)
    device.runner = RecordingRunner(device)
    return host, device


def _run(engine, prompt, params):
    generation = engine.generate(prompt, params)
    return [event.token_id for event in generation if event.token_id >= 0], generation.stats


def test_the_device_loop_gets_the_state_and_request_bias_and_gives_the_host_tokens(moe_path):
    host, device = _engines(moe_path)
    plain, _ = _run(host, PROMPT, SamplingParams(temperature=0, max_tokens=6))
    banned = {plain[2]: float("-inf"), 5: 0.5}  # changes the third token on
    for engine in (host, device):
        engine.state.update(logit_bias=((plain[3], -1.0), (5, 0.25)))
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias=banned)
    expected, host_stats = _run(host, PROMPT, params)
    tokens, stats = _run(device, PROMPT, params)
    assert tokens == expected and tokens[:2] == plain[:2] and tokens[2] != plain[2]
    assert device.runner.calls == [(tokens[0], len(PROMPT), 5, [plain[3], 5, plain[2], 5], [-1.0, 0.25, -np.inf, 0.5])]
    assert device.kv_tokens == host.kv_tokens == PROMPT + tokens[:-1]  # the last token is not forwarded
    assert stats.generated_tokens == host_stats.generated_tokens == 6


def test_the_device_loop_stops_at_the_context_and_is_not_used_for_sampling(moe_path):
    host, device = _engines(moe_path, context_tokens=len(PROMPT) + 3)
    params = SamplingParams(temperature=0, max_tokens=50)
    expected, _ = _run(host, PROMPT, params)
    tokens, _ = _run(device, PROMPT, params)
    assert tokens == expected and len(tokens) == 4  # positions len(PROMPT) .. context - 1, then one more token
    assert [call[1:3] for call in device.runner.calls] == [(len(PROMPT), 3)]
    _run(device, PROMPT, SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=3))
    assert len(device.runner.calls) == 1  # a sampled request picks its tokens on the host
