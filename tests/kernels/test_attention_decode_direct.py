"""The direct decode attention (attention_decode_direct.py) against the NumPy reference: every cache format, keys
around tile (16), split and warp-step boundaries, several splits combined by the last block, decode rows with the
bits of one-row launches, a workspace replayed at any position. Under the simulator its twin at small configs;
on a tensor-core GPU the C++ kernel at Qwen3-30B-A3B's shapes (32 query heads over 4 KV heads of 128)."""

import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize as gguf_quantize
from kernel_data import dev, host, reference_dequant
from numba import cuda

from strata.gpu.kernels import attention_decode_direct as direct
from strata.gpu.kernels import tensor_core
from strata.gpu.kernels.attention import (
    attention,
    decode_config,
    decode_num_splits,
    decode_workspace_specs,
    is_direct_decode,
)
from strata.gpu.kernels.packing import pack, to_device
from strata.model import reference_ops

F16_TOLERANCE = dict(rtol=1e-2, atol=2e-3)  # Q, K, V and P rounded to f16, sums in f32 (as prefill's tests)
SMALL = direct.DirectDecodeConfig(warps=2, min_split_keys=32)  # 2 warps a split of at least 2 tiles
needs_tensor_cores = pytest.mark.skipif(not tensor_core.is_available(), reason="the C++ kernel needs a tensor-core GPU")


@pytest.fixture(autouse=True, scope="module")
def _quick_thread_switches():
    """The simulator's twin of this kernel passes many barriers and an atomic with few threads, each
    barrier a hand-over of the interpreter lock: at Python's 5 ms switch interval a test took 67-361 s,
    at 0.2 ms 5 s (the engine's wider launches run slower at 0.2 ms, so only here)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    yield
    sys.setswitchinterval(interval)


def _case(fmt, num_q_heads, num_kv_heads, head_dim, num_cells, num_rows, seed):
    """(q [R, Hq * d], K and V caches on the device, their float values [P, Hkv, d])."""
    rng = np.random.default_rng(seed)
    caches, values = [], []
    for _ in range(2):
        x = rng.standard_normal((num_cells, num_kv_heads * head_dim)).astype(np.float32)
        raw = gguf_quantize(x, QType[fmt]).view(np.uint8).reshape(num_cells, -1)
        caches.append(to_device(pack(raw, fmt)))
        values.append(reference_dequant(raw, fmt).reshape(num_cells, num_kv_heads, head_dim))
    return rng.standard_normal((num_rows, num_q_heads * head_dim)).astype(np.float32), caches, values


def _workspace(num_splits, num_rows, num_q_heads, num_kv_heads, head_dim):
    """As the decode step holds it: partials full of NaN (never read before written), counters zero."""
    return tuple(dev(np.full(shape, np.nan, dtype) if np.dtype(dtype).kind == "f" else np.zeros(shape, dtype))
                 for shape, dtype in direct.workspace_specs(num_splits, num_rows, num_q_heads, num_kv_heads, head_dim))


def _attend(q, caches, positions, num_q_heads, num_kv_heads, head_dim, num_splits, workspace=None, config=SMALL):
    out = cuda.device_array(q.shape, np.float32)
    direct.attention_decode(dev(q), *caches, dev(np.asarray(positions, np.int32)), out, num_q_heads=num_q_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, kv_len=caches[0].num_rows,
                            num_splits=num_splits, scale=1.0 / np.sqrt(head_dim), workspace=workspace, config=config)
    return host(out)


def _check_rows(out, q, values, positions, num_q_heads, head_dim):
    for t, position in enumerate(positions):
        ref = reference_ops.attention(q[t].reshape(1, num_q_heads, head_dim), *values, int(position)).reshape(-1)
        np.testing.assert_allclose(out[t], ref, **F16_TOLERANCE, err_msg=f"row {t} at position {position}")


@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
def test_rows_around_tile_and_split_edges_match_the_reference(fmt):
    # 8 query heads over 1 KV head of 64, 3 splits of at least 32 keys, 2 warps: one key; a tile and a key;
    # two splits, the second of one key; the last cell (splits of 48, 48 and 4 keys, the warps' steps uneven)
    num_q_heads, num_kv_heads, head_dim, num_cells = 8, 1, 64, 100
    positions = [0, 16, 32, num_cells - 1]
    q, caches, values = _case(fmt, num_q_heads, num_kv_heads, head_dim, num_cells, len(positions), seed=100)
    out = _attend(q, caches, positions, num_q_heads, num_kv_heads, head_dim, 3,
                  _workspace(3, len(positions), num_q_heads, num_kv_heads, head_dim))
    _check_rows(out, q, values, positions, num_q_heads, head_dim)


def test_rows_have_the_bits_of_one_row_launches():
    # two KV heads of a group of 4: the counters and the partials of each row and head are their own
    num_q_heads, num_kv_heads, head_dim, num_cells = 8, 2, 64, 70
    positions = [69, 3, 40]
    q, caches, _ = _case("Q4_0", num_q_heads, num_kv_heads, head_dim, num_cells, len(positions), seed=101)
    rows = _attend(q, caches, positions, num_q_heads, num_kv_heads, head_dim, 4)  # workspace allocated and zeroed
    for t, position in enumerate(positions):
        one = _attend(q[t:t + 1], caches, [position], num_q_heads, num_kv_heads, head_dim, 4)
        assert np.array_equal(rows[t], one[0]), f"row {t} differs from its one-row launch"


def test_a_workspace_replays_at_any_position_and_keeps_its_counters_zero():
    # one workspace and one launch shape, the position only in device memory (as a captured decode step)
    num_q_heads, num_kv_heads, head_dim, num_cells = 4, 1, 128, 120
    q, caches, values = _case("Q8_0", num_q_heads, num_kv_heads, head_dim, num_cells, 1, seed=102)
    workspace = _workspace(4, 1, num_q_heads, num_kv_heads, head_dim)
    for position in (119, 0, 48):
        out = _attend(q, caches, [position], num_q_heads, num_kv_heads, head_dim, 4, workspace)
        _check_rows(out, q, values, [position], num_q_heads, head_dim)
        assert not host(workspace[2]).any()


def test_splits_follow_the_position_and_the_config():
    config = direct.DEFAULT_CONFIG
    splits = direct.default_num_splits(34816, 4, 132, config)  # the bench's cache on the H200
    assert splits == 33  # one block an SM over the 4 KV heads
    assert direct.default_num_splits(300, 4, 132, config) == 2  # a short cache: splits of at least 256 keys
    for span in (1, 255, 256, 257, 2048, 32768):
        keys = direct.split_keys(span, splits, config.min_split_keys)
        active = direct.active_splits(span, keys)
        assert keys >= config.min_split_keys and keys % direct.TILE_KEYS == 0
        assert active <= splits and (active - 1) * keys < span <= active * keys
    assert direct.active_splits(2048, direct.split_keys(2048, splits, 256)) == 8


def test_attention_serves_the_shapes_it_takes_and_asks_the_matching_workspace():
    assert direct.is_supported(128, 8) and direct.is_supported(64, 1)
    assert not direct.is_supported(128, 16)  # more heads than one warp's A rows: the tile kernels
    assert not direct.is_supported(96, 8)
    direct_specs = decode_workspace_specs(33, 2, 32, 4, 128)
    assert [shape for shape, _ in direct_specs] == [(33, 2, 32, 128), (33, 2, 4, direct.ML_STRIDE), (2, 4)]
    assert direct_specs[2][1] == np.int32
    assert [shape for shape, _ in decode_workspace_specs(66, 1, 32, 4, 128, is_direct=False)] == \
        [(66, 1, 32, 128), (66, 1, 32), (66, 1, 32)]
    assert decode_num_splits(34816, 4, 128, 8, 132) == 33
    assert decode_num_splits(34816, 4, 128, 8, 132, is_direct=False) == 66


class _Plane:
    """A device plane as is_supported sees it: an address, and the device array's copy_to_host."""

    def __init__(self, address):
        self.device_ctypes_pointer = type("Pointer", (), {"value": address})()

    def copy_to_host(self):
        raise AssertionError("not read")


def test_on_a_gpu_only_the_quants_plane_must_be_16_byte_aligned(monkeypatch):
    # the quants are read 16 bytes at a time, the scales 2 (an F16 cache's placeholder scales never): a 2-byte
    # allocation that the allocator placed off a 16-byte boundary must not send decode to the tile kernels (the
    # rule is the same for every format)
    monkeypatch.setattr(direct, "IS_SIMULATOR", False)
    monkeypatch.setattr(direct.tensor_core, "is_available", lambda: True)

    def cache(quants_address, scales_address):
        planes = pack(np.zeros((16, 512), np.float16), "F16")
        return planes._replace(quants=_Plane(quants_address), scales=_Plane(scales_address))

    assert direct.is_supported(128, 8, cache(0x1000, 0x2002))
    assert not direct.is_supported(128, 8, cache(0x1004, 0x2000))


def test_config_errors_name_the_field():
    for field, value in (("warps", 16), ("min_split_keys", 24), ("tiles_per_step", 3), ("blocks_per_sm", 0)):
        with pytest.raises(ValueError, match=field):
            direct.DirectDecodeConfig(**{field: value}).validate()
    q, caches, _ = _case("F16", 4, 1, 64, 16, 1, seed=103)
    with pytest.raises(ValueError, match="num_splits"):
        _attend(q, caches, [3], 4, 1, 64, direct.MAX_SPLITS + 1)


@needs_tensor_cores
@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_0"])
def test_cpp_kernel_at_the_served_shape(fmt):
    # Qwen3-30B-A3B's attention as the decode step runs it (attention(), the engine's split count, a row a
    # position): around tiles, the 256-key split minimum and the warps' steps; every row against the reference,
    # against its one-row launch bit for bit, and against the tile kernels (the previous path)
    num_q_heads, num_kv_heads, head_dim, num_cells = 32, 4, 128, 34816
    positions = [0, 15, 16, 255, 256, 257, 2047, 8191, 32767]
    q, caches, values = _case(fmt, num_q_heads, num_kv_heads, head_dim, num_cells, len(positions), seed=104)
    num_sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    num_splits = decode_num_splits(num_cells, num_kv_heads, head_dim, 8, num_sms)
    args = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, kv_len=num_cells,
                is_len_from_positions=True, is_decode_rows=True, config=decode_config(head_dim, 8))

    def run(rows, is_direct=True):
        splits = num_splits if is_direct else decode_num_splits(num_cells, num_kv_heads, head_dim, 8, num_sms, False)
        workspace = tuple(dev(np.zeros(shape, dtype)) for shape, dtype in
                          decode_workspace_specs(splits, len(rows), num_q_heads, num_kv_heads, head_dim, is_direct))
        return host(attention(dev(q[rows]), *caches, dev(np.asarray(positions, np.int32)[rows]), num_splits=splits,
                              workspace=workspace, use_direct_decode=is_direct, **args))

    every = list(range(len(positions)))
    out = run(every)
    _check_rows(out, q, values, positions, num_q_heads, head_dim)
    for t in every:
        assert np.array_equal(out[t], run([t])[0]), f"row {t} differs from its one-row launch"
    np.testing.assert_allclose(out, run(every, is_direct=False), **F16_TOLERANCE)


@needs_tensor_cores
def test_a_cache_whose_planes_the_direct_kernel_cannot_load_gets_the_tile_kernels_splits_and_workspace():
    # K's planes 4 bytes past a 16-byte boundary: attention() would send decode to the tile kernels, so the splits
    # and the workspace asked for that cache are theirs (the direct kernel's would not fit them). Nothing runs over
    # it: the tile kernels load planes 16 bytes wide too (on the GPU such a cache faults whichever reads it; the
    # engine allocates every plane aligned)
    num_q_heads, num_kv_heads, head_dim, num_cells = 32, 4, 128, 3000
    _, (k_cache, _), _ = _case("Q8_0", num_q_heads, num_kv_heads, head_dim, num_cells, 2, seed=106)
    k_cache = k_cache._replace(quants=_unaligned(k_cache.quants), scales=_unaligned(k_cache.scales))
    assert is_direct_decode(head_dim, 8) and not is_direct_decode(head_dim, 8, k_cache)
    num_sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    splits = decode_num_splits(num_cells, num_kv_heads, head_dim, 8, num_sms, k_cache=k_cache)
    assert splits == decode_num_splits(num_cells, num_kv_heads, head_dim, 8, num_sms, is_direct=False)
    specs = decode_workspace_specs(splits, 2, num_q_heads, num_kv_heads, head_dim, k_cache=k_cache)
    assert specs == decode_workspace_specs(splits, 2, num_q_heads, num_kv_heads, head_dim, is_direct=False)


def _unaligned(plane):
    """``plane``'s values on the device 4 bytes past the start of an allocation (not 16-byte aligned)."""
    flat = host(plane).reshape(-1)
    buffer = cuda.device_array(flat.nbytes + 4, np.uint8)
    view = buffer[4:].view(flat.dtype)
    view.copy_to_device(flat)
    return view.reshape(plane.shape)


@needs_tensor_cores
@pytest.mark.parametrize("fmt", ["F16", "Q4_0"])
def test_cpp_kernel_at_head_dim_64_and_small_groups(fmt):
    # the other exported head dim, a group of 2 and of 5 (padding rows of the A fragments), several warps' steps
    for num_q_heads, num_kv_heads in ((4, 2), (10, 2)):
        num_cells, positions = 3000, [0, 17, 511, 2999]
        q, caches, values = _case(fmt, num_q_heads, num_kv_heads, 64, num_cells, len(positions), seed=105)
        out = _attend(q, caches, positions, num_q_heads, num_kv_heads, 64, 7, config=direct.DEFAULT_CONFIG)
        _check_rows(out, q, values, positions, num_q_heads, 64)
