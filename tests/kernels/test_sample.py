import numpy as np
import pytest
from kernel_data import dev, host

from strata.engine import sampling
from strata.gpu.kernels.sample import argmax, sample

SMALL = dict(num_blocks=2, threads=4)


class _FixedUniform:
    """Stands in for the engine's generator: hands out one given uniform number."""

    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def test_argmax_takes_the_lowest_id_among_equal_maxima():
    logits = np.random.default_rng(100).standard_normal(97).astype(np.float32)
    logits[[77, 90]] = logits.max() + 1
    assert int(host(argmax(dev(logits), **SMALL))[0]) == 77


@pytest.mark.parametrize("top_k, top_p, temperature", [(5, 1.0, 1.0), (6, 0.6, 0.7), (1, 1.0, 0.8)])
def test_sample_matches_the_engine_sampler(top_k, top_p, temperature):
    rng = np.random.default_rng(101 + top_k)
    logits = (rng.standard_normal(97) * 2).astype(np.float32)
    logits[rng.integers(0, 97, 10)] = -np.inf  # banned tokens
    logits[10] = logits[60] = logits.max()  # a tie at the top, across the two blocks' slices
    params = sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    logits_dev = dev(logits)
    drawn = set()
    for u in (0.03, 0.45, 0.999):
        expected = sampling.sample(logits, params, _FixedUniform(u))
        got = int(host(sample(logits_dev, top_k=top_k, temperature=temperature, top_p=top_p, uniform=u, **SMALL))[0])
        assert got == expected, (u, got, expected)
        drawn.add(got)
    assert len(drawn) > 1 or top_k == 1  # the draws really depend on u


def test_temperature_zero_is_greedy_and_params_and_workspace_can_live_on_the_device():
    logits = np.random.default_rng(102).standard_normal(64).astype(np.float32)
    workspace = (dev(np.zeros(8, np.float32)), dev(np.zeros(8, np.int32)))  # 2 blocks x top-4
    token = sample(dev(logits), top_k=4, params=dev(np.array([0.0, 1.0, 0.9], np.float32)), workspace=workspace,
                   **SMALL)
    assert int(host(token)[0]) == int(np.argmax(logits))
    assert sorted(host(workspace[1])[:4]) == sorted(np.argsort(-logits[:32])[:4])  # block 0's candidates


def test_sample_rejects_settings_it_cannot_serve():
    logits = np.zeros(100, np.float32)
    with pytest.raises(ValueError, match=r"top_k must lie in \[1, 64\]"):
        sample(logits, top_k=0)
    with pytest.raises(ValueError, match="top_p must lie in"):
        sample(logits, top_k=4, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must lie in"):
        sample(logits, top_k=4, temperature=-1.0)
