"""KV cells past ``runtime.kv_resident_cells`` live in the host tier, and the output is the
all-resident output bit for bit: a prompt that crosses the resident cells in several prefill chunks,
then decode steps past them, give the same tokens, the same KV bits in every cell and the same
logits as a cache whose every cell is resident (numpy, and the kernels on a GPU).
A host tier larger than the host's memory and fewer resident cells than a chunk are refused."""

import dataclasses
import weakref

import numpy as np
import pytest
from engine_setup import engine_config, greedy
from gguf import GGMLQuantizationType as QType
from numba import config as numba_config

from strata.backend.select import has_cuda_device
from strata.engine import loading
from strata.engine.facade import Engine
from strata.engine.stream_stats import StreamStats
from strata.errors import ConfigError
from strata.model.synth import PRESETS, write_synthetic_model

# the simulator runs the tier's kernels in tests/kernels/test_ops_kv_tier.py (a whole request there takes minutes)
BACKENDS = ["numpy", pytest.param("cuda", marks=pytest.mark.skipif(not has_cuda_device(), reason="no GPU"))]
CHUNK, RESIDENT, CONTEXT = 16, 16, 64
# (prompt tokens, generated) by backend: on numpy two chunks, the second across the resident cells; on a GPU
# ten chunks, eight of them in the host tier, and decode steps past them (captured, positions on the device)
SIZES = {"numpy": (CHUNK + 5, 3), "cuda": (10 * CHUNK - 3, 12)}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    shape = dataclasses.replace(PRESETS["tiny"], head_dim=32)  # quantized KV rows of one 32-wide block a head
    return write_synthetic_model(tmp_path_factory.mktemp("models") / "tiny.gguf", shape, QType.Q4_0, seed=3)


def _engine(path, backend, kv_type, resident_cells=0, context=CONTEXT):
    runtime = {"backend": backend, "vram_budget": "64MiB", "warmup": False, "context_tokens": context,
               "kv_type": kv_type, "kv_resident_cells": resident_cells}
    return Engine.load(engine_config(path, runtime=runtime, planner={"chunk_tokens": CHUNK}), show_progress=False)


def _kv_cells(engine, end: int) -> list[np.ndarray]:
    """Cells 0..end-1 of every layer, K and V, every plane, as host arrays of their stored bits; a
    tiered cache's host cells follow its resident ones."""
    kv, ops = engine.runner.kv, engine.ops
    if ops.name == "numpy":
        return [kv.data[layer, which, :end].copy() for layer in range(kv.data.shape[0]) for which in (0, 1)]
    cells = []
    for layer, pair in enumerate(kv.layers):
        for which, matrix in enumerate(pair):
            for plane in ("quants", "scales", "extra"):
                host = ops.to_host(getattr(matrix, plane))
                if host.shape[0] != matrix.num_rows:
                    continue  # a placeholder of a plane the format lacks
                if kv.is_tiered:
                    host = np.concatenate([host, np.array(getattr(kv.host_layers[layer][which], plane))])
                cells.append(host[:end].copy())
    return cells


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_type", ["q4_0", "f16"])
def test_a_prompt_across_the_resident_cells_equals_the_all_resident_output(tiny_path, backend, kv_type):
    num_prompt, num_generated = SIZES[backend]
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, 500, size=num_prompt)]
    context = CONTEXT if backend == "numpy" else 4 * CONTEXT
    resident, tiered = (_engine(tiny_path, backend, kv_type, cells, context) for cells in (0, RESIDENT))
    assert tiered.context_tokens == resident.context_tokens == context
    assert tiered.placement.kv_bytes * context == resident.placement.kv_bytes * RESIDENT
    assert tiered.placement.host_kv_bytes == resident.placement.kv_bytes - tiered.placement.kv_bytes
    want, want_stats = greedy(resident, prompt, num_generated)
    got, got_stats = greedy(tiered, prompt, num_generated)
    assert got == want and got_stats.num_chunks == want_stats.num_chunks == -(-num_prompt // CHUNK)
    end = num_prompt + num_generated - 1  # the last token's KV is written by the next step
    for got_cells, want_cells in zip(_kv_cells(tiered, end), _kv_cells(resident, end), strict=True):
        assert np.array_equal(got_cells, want_cells)
    # one more decode step past the resident cells: its logits, bit for bit
    logits = [engine.output_logits(engine.runner.forward(np.array([got[-1]]), end, None, StreamStats()))
              for engine in (tiered, resident)]
    assert np.array_equal(logits[0], logits[1])
    # the host tier's traffic: each chunk past the resident cells reads the tier up to its end and writes its
    # cells there, and so does each decode step (the first generated token comes from prefill's logits)
    cell_bytes = tiered.runner.kv.cell_bytes
    chunks = [(start, min(start + CHUNK, num_prompt)) for start in range(0, num_prompt, CHUNK)]
    prefill_cells = sum(max(0, stop - RESIDENT) + max(0, stop - max(start, RESIDENT)) for start, stop in chunks)
    decode_cells = sum(step + 1 - RESIDENT + 1 for step in range(num_prompt, num_prompt + num_generated - 1))
    assert got_stats.kv_host_bytes == (prefill_cells + decode_cells) * cell_bytes
    assert want_stats.kv_host_bytes == 0 and "KV host tier" not in want_stats.timing_line()
    assert f"KV host tier {got_stats.kv_host_bytes / 2**20:.1f} MiB moved" in got_stats.timing_line()


def test_a_host_tier_larger_than_the_host_memory_is_refused_naming_the_fix(tiny_path, monkeypatch):
    monkeypatch.setattr(loading, "available_host_bytes", lambda: 1 << 16)
    with pytest.raises(ConfigError, match=r"the KV cache's host tier \(4,080 cells of runtime.context_tokens = "
                                          r"4,096 past runtime.kv_resident_cells = 16, 0.6 MiB of q4_0\) does not "
                                          r"fit in the 0.1 MiB of host memory available; raise "
                                          r"runtime.kv_resident_cells"):
        _engine(tiny_path, "numpy", "q4_0", RESIDENT, context=4096)
    _engine(tiny_path, "numpy", "q4_0", RESIDENT)  # a tier that fits


def test_fewer_resident_cells_than_a_prefill_chunk_are_refused_naming_both_keys(tiny_path):
    with pytest.raises(ConfigError, match=r"runtime.kv_resident_cells = 8 is smaller than one prefill chunk "
                                          r"\(planner.chunk_tokens = 16\); raise kv_resident_cells to at least 16"):
        _engine(tiny_path, "numpy", "q4_0", 8)
    with pytest.raises(ConfigError, match=r"\(planner.max_chunk_tokens = 16384\)"):
        engine_config(tiny_path, runtime={"context_tokens": 32768, "kv_resident_cells": 8192})
    with pytest.raises(ConfigError, match=r"kv_resident_cells = 70 exceeds runtime.context_tokens = 64"):
        _engine(tiny_path, "numpy", "q4_0", 70)


@pytest.mark.parametrize("backend", [
    pytest.param("cudasim", marks=pytest.mark.skipif(not numba_config.ENABLE_CUDASIM, reason="the simulator is off")),
    pytest.param("cuda", marks=pytest.mark.skipif(not has_cuda_device(), reason="no GPU"))])
def test_close_releases_the_host_tier_and_its_fill_stream(tiny_path, backend):
    engine = _engine(tiny_path, backend, "q4_0", RESIDENT)
    if backend == "cuda":  # chunks past the resident cells: layers are filled ahead on the fill stream
        greedy(engine, list(range(3, 3 + 3 * CHUNK)), 1)
    fills = engine.ops._kv_fills
    assert (fills is not None) == (backend == "cuda")
    planes = [weakref.ref(plane) for pair in engine.kv.host_layers for matrix in pair
              for plane in (matrix.quants, matrix.scales, matrix.extra)
              if plane.shape[0] == CONTEXT - RESIDENT]  # not a placeholder of a plane q4_0 lacks
    assert len(planes) == 2 * 2 * PRESETS["tiny"].num_layers and all(plane() is not None for plane in planes)
    engine.close()
    engine.close()  # a second close finds nothing to release
    assert not engine.kv.is_tiered and engine.ops._kv_fills is None
    assert all(plane() is None for plane in planes)  # no reference is left: the pinned memory is freed
    if fills is not None:
        from numba import cuda

        assert fills.handle is None and not len(cuda.current_context().memory_manager.deallocations)


@pytest.mark.skipif(not has_cuda_device(), reason="no GPU")
def test_a_long_prompt_on_a_gpu_at_the_reference_shape_equals_the_all_resident_output(tmp_path):
    # the reference model's attention (4 KV heads of 128) and experts, two layers: a 10,000-token prompt in
    # chunks of 2,048 crossing 4,096 resident cells, decode past them
    shape = dataclasses.replace(PRESETS["qwen3-30b-a3b"], num_layers=2)
    path = write_synthetic_model(tmp_path / "two-layers.gguf", shape, QType.Q4_0, seed=5)
    prompt = [int(t) for t in np.random.default_rng(13).integers(3, shape.vocab_size - 1, size=10_000)]
    outputs = []
    for cells in (0, 4096):
        runtime = {"backend": "cuda", "vram_budget": "8GiB", "vmm_segment": "64MiB", "context_tokens": 16384,
                   "kv_type": "q4_0", "kv_resident_cells": cells}
        engine = Engine.load(engine_config(path, runtime=runtime, planner={"chunk_tokens": 2048}), show_progress=False)
        tokens, stats = greedy(engine, prompt, 16)
        logits = engine.output_logits(engine.runner.forward(np.array([tokens[-1]]), len(prompt) + 15, None,
                                                            StreamStats()))
        outputs.append((tokens, logits, stats.kv_host_bytes))
        engine.close()
        del engine
    (want, want_logits, no_bytes), (got, got_logits, moved) = outputs
    # a prefill chunk's routed experts add into the residual with atomics (moe.py: any order), so on a GPU
    # two runs of the same prompt differ in the last bits whatever the KV cells: the tokens are equal, the
    # logits within float32 rounding (on the H200 the two runs differed by ~1e-6 of their scale)
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=1e-5 * np.max(np.abs(want_logits)))
    assert no_bytes == 0 and moved > 0
