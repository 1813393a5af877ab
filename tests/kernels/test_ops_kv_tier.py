"""The cuda backend's host tier of KV cells: writes and attention over a cache whose cells past
``resident_cells`` live in host memory equal those over an all-resident cache bit for bit, for
prefill chunks that cross the resident cells and decode rows past them (positions on the device,
as a captured step reads them); the cells land where they belong, device or host."""

import numpy as np
import pytest
from kernel_data import dev, host
from numba import config as numba_config

from strata.backend.ops import host_tier_bytes
from strata.backend.select import has_cuda_device, make_ops
from strata.gpu.ledger import VramLedger

BACKEND = "cuda" if has_cuda_device() else "cudasim"
pytestmark = pytest.mark.skipif(BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                                reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")
NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 1, 64
# real-ish on a GPU (a long context, chunks of hundreds of tokens); a few cells in the simulator
CELLS, RESIDENT, STEPS = (4096, 1536, [(0, 1024), (1024, 1024), (2048, 9), (2057, 1)]) if BACKEND == "cuda" else \
    (24, 6, [(0, 10), (10, 2)])
KV_TYPES = ["f16", "q8_0", "q4_0"] if BACKEND == "cuda" else ["q4_0"]


def _cells(ops, kv, layer: int) -> list[np.ndarray]:
    """Every plane of a layer's K and V over all its cells (resident, then host), as host arrays."""
    planes = []
    for which, matrix in enumerate(kv.layers[layer]):
        for name in ("quants", "scales"):
            rows = ops.to_host(getattr(matrix, name))
            if kv.is_tiered and len(rows) == kv.resident_cells:  # not a format's one-element placeholder plane
                # the host planes are host memory (mapped into the device's address space)
                rows = np.concatenate([rows, np.array(getattr(kv.host_layers[layer][which], name))])
            planes.append(rows)
    return planes


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_a_tiered_cache_attends_as_a_resident_one_bit_for_bit(kv_type):
    ops = make_ops(BACKEND, VramLedger(4 << 30))
    resident = ops.kv_cache("kv_cache", NUM_LAYERS, CELLS, NUM_KV_HEADS, HEAD_DIM, kv_type)
    before = ops.ledger.snapshot().by_owner
    tiered = ops.kv_cache("kv_cache", NUM_LAYERS, CELLS, NUM_KV_HEADS, HEAD_DIM, kv_type, resident_cells=RESIDENT,
                          staging_owner="kv_staging")
    after = ops.ledger.snapshot().by_owner
    assert tiered.is_tiered and not resident.is_tiered and tiered.resident_cells == RESIDENT
    charged = {owner: after.get(owner, 0) - before.get(owner, 0) for owner in ("kv_cache", "kv_staging")}
    planes = {"kv_cache": RESIDENT * resident.cell_bytes,  # the host cells are not in VRAM
              "kv_staging": 2 * CELLS * resident.cell_bytes // NUM_LAYERS}
    for owner, num_bytes in planes.items():  # on a GPU a format's absent planes are one-element placeholders
        assert 0 <= charged[owner] - num_bytes <= 4 * 2 * max(NUM_LAYERS, 2), owner
    rng = np.random.default_rng(9)
    for start, num_tokens in STEPS:
        positions = dev(np.arange(start, start + num_tokens, dtype=np.int32))
        is_decode = num_tokens <= 9
        for layer in range(NUM_LAYERS):
            q = dev(rng.standard_normal((num_tokens, NUM_HEADS, HEAD_DIM)).astype(np.float32))
            k, v = (dev(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)) for _ in "kv")
            outs = []
            for kv in (resident, tiered):
                # decode rows read their positions on the device (start 0), as a captured step does
                scratch = ops.decode_attention_scratch("activations", kv, NUM_HEADS, num_tokens) if is_decode else None
                ops.kv_write(kv, layer, 0 if is_decode else start, k, v, positions)
                outs.append(host(ops.attention(q, kv, layer, 0 if is_decode else start, positions, scratch)))
            np.testing.assert_array_equal(outs[1], outs[0])
    end = STEPS[-1][0] + STEPS[-1][1]
    for layer in range(NUM_LAYERS):
        for got, want in zip(_cells(ops, tiered, layer), _cells(ops, resident, layer), strict=True):
            np.testing.assert_array_equal(got[:end], want[:end])
    # what one step past the resident cells moves: the tier's cells before its end read, its own written
    assert host_tier_bytes(tiered, RESIDENT + 4, RESIDENT + 6) == (6 + 2) * tiered.cell_bytes
    assert host_tier_bytes(tiered, 0, RESIDENT) == host_tier_bytes(resident, 0, CELLS) == 0
