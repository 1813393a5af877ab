"""A forward of T <= DECODE_MAX_ROWS tokens equals T one-token forwards bit for bit.

A speculative verify runs the last accepted token and its drafts as one forward and must reproduce
plain greedy decode exactly: the hidden rows, the KV cache it writes, and the output head's rows
(``logits_rows``, ``greedy_rows``) must have the bits of one-token decode. On numpy the ops run row by
row; on cudasim the kernels take a row dimension, and the one-token forwards run the captured
``DecodeStep`` where the engine has one (as plain decode does).
"""

import numpy as np
import pytest
from engine_setup import SIMULATOR_TINY, engine_config
from gguf import GGMLQuantizationType as QType
from numba import config as numba_config

from strata.backend.ops import DECODE_MAX_ROWS
from strata.backend.select import has_cuda_device
from strata.engine.facade import Engine
from strata.engine.stream_stats import StreamStats
from strata.model.synth import PRESETS, write_synthetic_model

KERNELS = "cuda" if has_cuda_device() else "cudasim"
BACKENDS = ["numpy", pytest.param(KERNELS, marks=pytest.mark.skipif(
    KERNELS == "cudasim" and not numba_config.ENABLE_CUDASIM,
    reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)"))]
PROMPT = [5, 77, 201, 12, 250]
IS_SIMULATED = KERNELS == "cudasim"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    shape = SIMULATOR_TINY if IS_SIMULATED else PRESETS["tiny"]
    return write_synthetic_model(tmp_path_factory.mktemp("models") / "tiny.gguf", shape, QType.Q4_0, seed=3)


def _engine(path, backend):
    runtime = {"backend": backend, "vram_budget": "64MiB", "warmup": False, "expert_preload": False}
    return Engine.load(engine_config(path, runtime=runtime), show_progress=False)


def _kv_cells(engine, start: int, end: int) -> list[np.ndarray]:
    """The KV cache's cells start..end-1 of every layer, K and V, as host arrays of their stored bits."""
    kv, ops = engine.runner.kv, engine.ops
    if engine.ops.name == "numpy":
        return [kv.data[layer, which, start:end].copy() for layer in range(kv.data.shape[0]) for which in (0, 1)]
    cells = []
    for pair in kv.layers:
        for matrix in pair:
            for plane in (matrix.quants, matrix.scales, matrix.extra):
                host = ops.to_host(plane)
                cells.append(host[start:end].copy() if host.shape[0] == matrix.num_rows else host)
    return cells


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forward_of_rows_equals_one_token_forwards_bit_for_bit(tiny_path, backend):
    engine = _engine(tiny_path, backend)
    runner, ops = engine.runner, engine.ops
    is_captured = runner.decode_step is not None
    assert is_captured == (backend != "numpy")  # one-token forwards replay the captured step there
    # the simulator: ~10 s a token, one forward of rows after a prompt of two
    row_counts = (3,) if backend == "cudasim" else (2, 5, DECODE_MAX_ROWS)
    prompt = PROMPT[:2] if backend == "cudasim" else PROMPT
    rng = np.random.default_rng(11)
    stats = StreamStats()
    runner.forward(np.array(prompt), 0, None, stats)
    start = len(prompt)
    for num_rows in row_counts:
        tokens = rng.integers(3, engine.spec.vocab_size, size=num_rows)
        rows = ops.to_host(runner.forward(tokens, start, None, stats))  # [T, D]
        rows_kv = _kv_cells(engine, start, start + num_rows)
        ones = [ops.to_host(runner.forward(tokens[t:t + 1], start + t, None, stats))[0] for t in range(num_rows)]
        runner.end_request()
        for t, one in enumerate(ones):
            assert np.array_equal(rows[t], one), f"{num_rows} rows: row {t} differs from its one-token forward"
        for got, want in zip(rows_kv, _kv_cells(engine, start, start + num_rows)):
            assert np.array_equal(got, want), f"{num_rows} rows: the KV cache differs from one-token forwards'"
        start += num_rows  # the next rows see these in the cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_output_heads_rows_equal_one_row_logits_and_greedy_tokens(tiny_path, backend):
    engine = _engine(tiny_path, backend)
    ops = engine.ops
    norm, head, eps = engine.output_head()
    rng = np.random.default_rng(12)
    num_rows = 4 if backend == "cudasim" else DECODE_MAX_ROWS  # the simulator: seconds a one-row launch
    x = rng.standard_normal((num_rows, engine.spec.hidden_size)).astype(np.float32)
    x[3] = x[2]  # equal rows, equal picks
    hidden = ops.upload("activations", x)
    logits = ops.logits_rows(hidden, norm, head, eps)  # [R, V]
    assert logits.shape == (num_rows, engine.spec.vocab_size) and logits.dtype == np.float32
    for t in range(num_rows):
        assert np.array_equal(logits[t], ops.logits(ops.upload("activations", x[t:t + 1]), norm, head, eps))
    # a bias that makes two ids tie at the top of row 0: the lower id wins, as np.argmax picks
    top = int(np.argmax(logits[0]))
    other = (top + 7) % engine.spec.vocab_size
    bias_ids = np.array([other, 9, 9], np.int32)  # a repeated id adds twice, in order
    bias_values = np.array([logits[0, top] - logits[0, other], 0.5, -1.25], np.float32)
    bias = (ops.upload("activations", bias_ids), ops.upload("activations", bias_values))
    tokens = ops.upload("activations", np.full(num_rows, -1, np.int32))
    ops.greedy_rows(hidden, norm, head, eps, bias, tokens)
    biased = logits.copy()
    for token_id, value in zip(bias_ids, bias_values):
        biased[:, token_id] += value
    assert ops.to_host(tokens).tolist() == np.argmax(biased, axis=-1).tolist()
    if backend != "numpy":  # each row's pick is greedy_token's for that row alone
        for t in range(num_rows):
            token = ops.upload("activations", np.full(1, -1, np.int32))
            ops.greedy_token(ops.upload("activations", x[t:t + 1]), norm, head, eps, bias, token)
            assert int(ops.to_host(token)[0]) == int(ops.to_host(tokens)[t])
