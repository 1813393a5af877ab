"""One qwen3moe decoder layer composed from the kernels, against the project's reference forward:
a 4-token prefill (GEMM, grouped experts) then one decode token (GEMV with fused norms) that
reads the prefill's KV cache."""

import numpy as np
from kernel_data import (
    assert_close_to_scale,
    dev,
    host,
    random_gguf_bytes,
    reference_dequant,
)

from strata.gpu.kernels.attention import AttentionConfig, attention
from strata.gpu.kernels.gemm import gemm
from strata.gpu.kernels.gemm_config import GemmConfig
from strata.gpu.kernels.gemv import GemvConfig, gemv
from strata.gpu.kernels.gemv_multi import gemv_multi
from strata.gpu.kernels.kvcache import append_kv, empty_kv_layer
from strata.gpu.kernels.moe import moe_experts_decode, moe_experts_prefill
from strata.gpu.kernels.moe_route import moe_group, moe_route
from strata.gpu.kernels.norm import rms_norm
from strata.gpu.kernels.packing import pack, to_device
from strata.gpu.kernels.rope import head_norm_rope
from strata.model.reference import KVCache, ReferenceModel
from strata.model.spec import ModelSpec, tensor_shapes

SPEC = ModelSpec(arch="qwen3moe", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=16,
                 num_rope_dims=16, vocab_size=8, context_length=16, rope_theta=1e6, is_rope_neox=True,
                 rms_norm_eps=1e-6, dense_ffn_size=0, num_experts=4, num_experts_used=2, expert_ffn_size=32,
                 shared_expert_ffn_size=0, has_shared_expert_gate=False, is_expert_weights_normalized=True,
                 has_qk_norm=True, is_output_tied=True, num_nextn_layers=0)
FORMATS = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate_inp": "F32",
           "ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_0"}
GEMM = GemmConfig(block_m=8, block_n=8, thread_m=2, thread_n=2)
GEMV = GemvConfig(threads=32, lanes_per_row=8, rows_per_group=4)
ATTENTION = AttentionConfig(tokens_per_block=2, threads_per_row=4, kv_tile=8)


def _layer_weights(rng):
    """Device weights of layer 0 (packed matrices, float32 norms) and their float values by name."""
    required, _ = tensor_shapes(SPEC)
    device, values = {}, {}
    for name, shape in required.items():
        if not name.startswith("blk.0."):
            continue
        short = name.split(".")[2]
        if len(shape) == 1:  # norm weights stay float32
            values[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            device[short] = dev(values[name])
            continue
        fmt = FORMATS[short]
        raw = random_gguf_bytes(fmt, int(np.prod(shape[:-1])), shape[-1], rng)
        values[name] = reference_dequant(raw, fmt).reshape(shape)
        device[short] = to_device(pack(raw, fmt))
    return device, values


def _attention_part(w, h_normed, x, k_cache, v_cache, positions, num_tokens, is_decode):
    d, hq, hk = SPEC.head_dim, SPEC.num_heads, SPEC.num_kv_heads
    q, k, v = (dev(np.zeros((num_tokens, n * d), np.float32)) for n in (hq, hk, hk))
    if is_decode:  # one launch for q, k and v, the attention norm fused in
        gemv_multi((w["attn_q"], w["attn_k"], w["attn_v"]), x.reshape(SPEC.hidden_size),
                   (q.reshape(hq * d), k.reshape(hk * d), v.reshape(hk * d)), norm_weight=w["attn_norm"],
                   eps=SPEC.rms_norm_eps, config=GEMV)
    else:
        for name, out in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
            gemm(h_normed, w[name], out, config=GEMM)
    head_norm_rope(q, k, positions, head_dim=d, q_norm_weight=w["attn_q_norm"], k_norm_weight=w["attn_k_norm"],
                   eps=SPEC.rms_norm_eps, rope_mode="neox", freq_base=SPEC.rope_theta)
    append_kv(k_cache, v_cache, k, v, positions, threads=2)
    kv_len = int(host(positions).max()) + 1
    att = attention(q, k_cache, v_cache, positions, num_q_heads=hq, num_kv_heads=hk, head_dim=d, kv_len=kv_len,
                    config=ATTENTION)
    if is_decode:
        gemv(w["attn_output"], att.reshape(hq * d), x.reshape(SPEC.hidden_size), accumulate=True, config=GEMV)
    else:
        gemm(att, w["attn_output"], x, accumulate=True, config=GEMM)


def _kernel_layer(w, x_host, k_cache, v_cache, start_pos):
    num_tokens, is_decode = x_host.shape[0], x_host.shape[0] == 1
    x = dev(x_host)
    positions = dev(np.arange(start_pos, start_pos + num_tokens, dtype=np.int32))
    h = None if is_decode else rms_norm(x, w["attn_norm"], SPEC.rms_norm_eps, threads=32)
    _attention_part(w, h, x, k_cache, v_cache, positions, num_tokens, is_decode)
    experts = (w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"])
    if is_decode:
        logits = gemv(w["ffn_gate_inp"], x.reshape(SPEC.hidden_size), norm_weight=w["ffn_norm"],
                      eps=SPEC.rms_norm_eps, config=GEMV).reshape(1, SPEC.num_experts)
        ids, weights = moe_route(logits, SPEC.num_experts_used, threads=8)
        moe_experts_decode(x, ids, weights, *experts, x, num_experts=SPEC.num_experts, norm_weight=w["ffn_norm"],
                           eps=SPEC.rms_norm_eps, config=GEMV)
    else:
        f = rms_norm(x, w["ffn_norm"], SPEC.rms_norm_eps, threads=32)
        ids, weights = moe_route(gemm(f, w["ffn_gate_inp"], config=GEMM), SPEC.num_experts_used, threads=8)
        groups = moe_group(ids, weights, SPEC.num_experts, GEMM.block_m, threads=8)
        moe_experts_prefill(f, groups, *experts, x, num_experts=SPEC.num_experts, config=GEMM)
    return host(x)


def test_prefill_then_decode_layer_matches_the_reference_forward():
    rng = np.random.default_rng(110)
    w, values = _layer_weights(rng)
    reference = ReferenceModel(SPEC, lambda name: values[name])
    ref_kv = KVCache(1, SPEC.context_length, SPEC.num_kv_heads, SPEC.head_dim)
    k_cache, v_cache = empty_kv_layer("F16", SPEC.context_length, SPEC.num_kv_heads * SPEC.head_dim)
    x = rng.standard_normal((5, SPEC.hidden_size)).astype(np.float32)
    got = _kernel_layer(w, x[:4], k_cache, v_cache, start_pos=0)
    assert_close_to_scale(got, reference.decoder_layer(0, x[:4], 0, ref_kv), 2e-3)  # K/V rounded to fp16 in the cache
    got = _kernel_layer(w, x[4:], k_cache, v_cache, start_pos=4)
    assert_close_to_scale(got, reference.decoder_layer(0, x[4:], 4, ref_kv), 2e-3)
