"""The cuda backend's prefill attention over a quantized cache: dequantized into an F16 copy first."""

import numpy as np
import pytest
from kernel_data import dev, host
from numba import config as numba_config

from strata.backend.ops import DECODE_MAX_ROWS
from strata.backend.select import has_cuda_device, make_ops
from strata.gpu.kernels import attention_mma
from strata.gpu.kernels.attention import attention
from strata.gpu.ledger import VramLedger

BACKEND = "cuda" if has_cuda_device() else "cudasim"
pytestmark = pytest.mark.skipif(BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                                reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 64  # a head dim the tensor-core kernel (or its twin) serves


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_prefill_over_a_quantized_cache_reads_a_dequantized_copy_and_frees_it(kv_type, monkeypatch):
    copies = []
    dequantize_kv = attention_mma.dequantize_kv
    monkeypatch.setattr(attention_mma, "dequantize_kv", lambda *args, **kw: copies.append(args[2]) or
                        dequantize_kv(*args, **kw))
    ops = make_ops(BACKEND, VramLedger(1 << 30))
    kv = ops.kv_cache("kv_cache", 1, 24, NUM_KV_HEADS, HEAD_DIM, kv_type)
    rng = np.random.default_rng(3)
    start, num_tokens = 3, DECODE_MAX_ROWS + 1  # more rows than decode's: prefill
    k, v = (dev(rng.standard_normal((start + num_tokens, NUM_KV_HEADS * HEAD_DIM)).astype(np.float32)) for _ in "kv")
    ops.kv_write(kv, 0, 0, k, v, np.arange(start + num_tokens, dtype=np.int32))
    q = dev(rng.standard_normal((num_tokens, NUM_HEADS, HEAD_DIM)).astype(np.float32))
    before = ops.ledger.owner_bytes("activations")
    positions = np.arange(start, start + num_tokens, dtype=np.int32)
    got = host(ops.attention(q, kv, 0, start, positions))
    assert copies == [start + num_tokens]  # rows 0..kv_len-1 of the whole-cache copy
    k_cache, v_cache = kv.layers[0]
    direct = host(attention(q.reshape(num_tokens, -1), k_cache, v_cache, dev(positions), num_q_heads=NUM_HEADS,
                            num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, kv_len=start + num_tokens))
    np.testing.assert_array_equal(got, direct)
    assert ops.ledger.owner_bytes("activations") - before <= got.nbytes  # the copy is not kept
    assert ops.prefill_kv_scratch_bytes_per_cell(HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, kv_type) == 4 * HEAD_DIM
