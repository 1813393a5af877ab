"""The reference forward: each operation against a plain loop, and the whole model's invariants."""

import dataclasses
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from strata.errors import EngineError
from strata.model import reference_ops as ops
from strata.model.reference import KVCache, ReferenceModel
from strata.model.spec import ModelSpec, tensor_shapes

RNG = np.random.default_rng(1234)


def _randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ---- operations -------------------------------------------------------------------------------


def test_embed_takes_rows():
    table = _randn(10, 4)
    assert np.array_equal(ops.embed(table, np.array([3, 0, 3])), table[[3, 0, 3]])


def test_rms_norm_matches_a_loop():
    x, w, eps = _randn(3, 8), _randn(8), 1e-5
    out = ops.rms_norm(x, w, eps)
    for t in range(3):
        inv = 1.0 / math.sqrt(sum(float(v) ** 2 for v in x[t]) / 8 + eps)
        assert np.allclose(out[t], [float(x[t, i]) * inv * float(w[i]) for i in range(8)], rtol=1e-6)


def _rope_loop(vec, pos, theta, num_rot, is_neox):
    out = [float(v) for v in vec]
    for i in range(num_rot // 2):
        angle = pos * theta ** (-2.0 * i / num_rot)
        a, b = (i, i + num_rot // 2) if is_neox else (2 * i, 2 * i + 1)
        x0, x1 = float(vec[a]), float(vec[b])
        out[a] = x0 * math.cos(angle) - x1 * math.sin(angle)
        out[b] = x0 * math.sin(angle) + x1 * math.cos(angle)
    return out


@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("num_rot", [8, 4])
def test_rope_matches_a_loop_for_both_orderings_and_partial_rotation(is_neox, num_rot):
    x, positions = _randn(3, 2, 8), np.array([0, 5, 1000])
    cos, sin = ops.rope_angles(positions, num_rot, 10000.0)
    out = ops.rope(x, cos, sin, is_neox)
    for t, pos in enumerate(positions):
        for h in range(2):
            assert np.allclose(out[t, h], _rope_loop(x[t, h], int(pos), 10000.0, num_rot, is_neox), atol=1e-5)
    assert np.array_equal(out[0], x[0])  # position 0 is the identity


def test_rope_orderings_differ_by_a_permutation_of_dims():
    x = _randn(2, 1, 8)
    cos, sin = ops.rope_angles(np.array([3, 7]), 8, 500.0)
    interleaved_to_halves = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    normal = ops.rope(x, cos, sin, is_neox=False)
    neox = ops.rope(x[..., interleaved_to_halves], cos, sin, is_neox=True)
    assert np.allclose(neox, normal[..., interleaved_to_halves], atol=1e-6)
    assert not np.allclose(ops.rope(x, cos, sin, is_neox=True), normal, atol=1e-3)


def test_rope_freq_factors_divide_the_frequencies():
    factors = np.array([1.0, 2.0, 4.0, 8.0], dtype=np.float32)
    cos, _ = ops.rope_angles(np.array([6]), 8, 100.0, factors)
    expected = [math.cos(6 * 100.0 ** (-2 * i / 8) / factors[i]) for i in range(4)]
    assert np.allclose(cos[0], expected)


def test_attention_matches_a_loop_with_gqa_and_a_causal_mask():
    num_heads, num_kv_heads, head_dim, start_pos, num_tokens = 4, 2, 8, 3, 4
    q = _randn(num_tokens, num_heads, head_dim)
    k_cache, v_cache = _randn(10, num_kv_heads, head_dim), _randn(10, num_kv_heads, head_dim)
    out = ops.attention(q, k_cache, v_cache, start_pos)
    for t in range(num_tokens):
        for h in range(num_heads):
            kv_head = h // (num_heads // num_kv_heads)
            seen = range(start_pos + t + 1)
            scores = [float(np.dot(q[t, h].astype(np.float64), k_cache[s, kv_head])) / math.sqrt(head_dim)
                      for s in seen]
            peak = max(scores)
            w = [math.exp(sc - peak) for sc in scores]
            expected = sum(w[s] * v_cache[s, kv_head].astype(np.float64) for s in seen) / sum(w)
            assert np.allclose(out[t, h], expected, atol=1e-5)


def test_route_selects_top_k_by_probability_and_renormalises():
    logits = np.array([[0.0, 3.0, 1.0, 2.0, -1.0]])
    ids, weights = ops.route(logits, 2)
    assert ids.tolist() == [[1, 3]]
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert np.allclose(weights[0], [p[1] / (p[1] + p[3]), p[3] / (p[1] + p[3])])
    assert math.isclose(float(weights.sum()), 1.0, rel_tol=1e-6)
    _, raw = ops.route(logits, 2, is_norm_weights=False)
    assert np.allclose(raw[0], [p[1], p[3]])
    _, scaled = ops.route(logits, 2, weights_scale=2.5)
    assert np.allclose(scaled, weights * 2.5)


def test_moe_matches_a_per_token_loop():
    num_experts, dim, ffn_size = 6, 8, 5
    x = _randn(4, dim)
    gate, up = _randn(num_experts, ffn_size, dim), _randn(num_experts, ffn_size, dim)
    down = _randn(num_experts, dim, ffn_size)
    ids, weights = ops.route(_randn(4, num_experts), 3)
    out = ops.moe(x, ids, weights, gate, up, down)
    for t in range(4):
        expected = np.zeros(dim)
        for slot in range(3):
            e = ids[t, slot]
            g, u = gate[e] @ x[t], up[e] @ x[t]
            expected += weights[t, slot] * (down[e] @ (g / (1 + np.exp(-g)) * u))
        assert np.allclose(out[t], expected, rtol=1e-5, atol=1e-5)


def test_shared_expert_gate_scales_by_a_sigmoid():
    x, gate, up, down, gate_inp = _randn(2, 8), _randn(5, 8), _randn(5, 8), _randn(8, 5), _randn(8)
    plain = ops.shared_expert(x, gate, up, down, None)
    assert np.allclose(plain, ops.ffn(x, gate, up, down))
    gated = ops.shared_expert(x, gate, up, down, gate_inp)
    assert np.allclose(gated, plain / (1 + np.exp(-(x @ gate_inp)))[:, None], rtol=1e-5)


# ---- whole model ------------------------------------------------------------------------------

QWEN = ModelSpec(
    arch="qwen3moe", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=16, num_rope_dims=16,
    vocab_size=64, context_length=64, rope_theta=10000.0, is_rope_neox=True, rms_norm_eps=1e-6,
    dense_ffn_size=0, num_experts=8, num_experts_used=3, expert_ffn_size=12, shared_expert_ffn_size=0,
    has_shared_expert_gate=False, is_expert_weights_normalized=True, has_qk_norm=True, is_output_tied=False,
    num_nextn_layers=1,
)
LLAMA = dataclasses.replace(
    QWEN, arch="llama", is_rope_neox=False, dense_ffn_size=24, num_experts=0, num_experts_used=0,
    expert_ffn_size=0, is_expert_weights_normalized=False, has_qk_norm=False, is_output_tied=True, num_nextn_layers=0,
)
QWEN_SHARED = dataclasses.replace(QWEN, shared_expert_ffn_size=10, has_shared_expert_gate=True)


def _weights(spec, seed=0, with_optional=()):
    rng = np.random.default_rng(seed)
    required, optional = tensor_shapes(spec)
    shapes = dict(required, **{n: s for n, s in optional.items() if any(n.endswith(o) for o in with_optional)})
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # norm weights near 1, the shared-expert gate near 0
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
    return out


def _model(spec, weights):
    return ReferenceModel(spec, weights.__getitem__)


SPECS = {"llama": (LLAMA, ()), "qwen3moe": (QWEN, ("output.weight",)),
         "qwen3moe+shexp": (QWEN_SHARED, ("output.weight", "ffn_gate_inp_shexp.weight"))}


@pytest.mark.parametrize("name", SPECS)
def test_chunked_prefill_one_shot_and_token_by_token_decode_agree(name):
    spec, optional = SPECS[name]
    model = _model(spec, _weights(spec, with_optional=optional))
    tokens = np.random.default_rng(5).integers(0, spec.vocab_size, size=13)
    one_shot = model.forward(tokens, 0, KVCache.for_spec(spec, 32))

    kv = KVCache.for_spec(spec, 32)
    chunked = np.concatenate([model.forward(tokens[i:i + 5], i, kv) for i in range(0, 13, 5)])

    kv = KVCache.for_spec(spec, 32)
    prefix = model.forward(tokens[:6], 0, kv)
    decoded = np.concatenate([prefix] + [model.forward(tokens[i:i + 1], i, kv) for i in range(6, 13)])

    assert one_shot.shape == (13, spec.vocab_size)
    assert _rel_err(chunked, one_shot) <= 1e-5
    assert _rel_err(decoded, one_shot) <= 1e-5
    assert np.std(one_shot[-1]) > 0.1  # not a degenerate model


def test_logits_depend_on_earlier_tokens_only_through_the_past():
    model = _model(QWEN, _weights(QWEN, with_optional=("output.weight",)))
    a = model.forward(np.array([1, 2, 3, 4]), 0, KVCache.for_spec(QWEN, 8))
    b = model.forward(np.array([1, 2, 9, 4]), 0, KVCache.for_spec(QWEN, 8))
    assert _rel_err(a[:2], b[:2]) <= 1e-5  # equal up to BLAS blocking
    assert not np.allclose(a[2:], b[2:])


def test_tied_head_uses_token_embd_and_untied_uses_output():
    weights = _weights(LLAMA)
    model = _model(LLAMA, weights)
    hidden = _randn(2, LLAMA.hidden_size)
    normed = ops.rms_norm(hidden, weights["output_norm.weight"], LLAMA.rms_norm_eps)
    assert np.allclose(model.logits(hidden), normed @ weights["token_embd.weight"].T, rtol=1e-5)
    weights["output.weight"] = _randn(LLAMA.vocab_size, LLAMA.hidden_size)
    untied = _model(LLAMA, weights)
    assert np.allclose(untied.logits(hidden), normed @ weights["output.weight"].T, rtol=1e-5)


def _naive_qwen_layer(w, layer, x, spec):
    """One qwen3moe decoder layer over a whole prompt from position 0, written as loops."""
    def norm(v, g):
        return v / np.sqrt(np.mean(v.astype(np.float64) ** 2) + spec.rms_norm_eps) * g

    def rot(v, pos):
        half = spec.head_dim // 2
        out = v.copy()
        for i in range(half):
            a = pos * spec.rope_theta ** (-2 * i / spec.head_dim)
            out[i] = v[i] * math.cos(a) - v[i + half] * math.sin(a)
            out[i + half] = v[i] * math.sin(a) + v[i + half] * math.cos(a)
        return out

    p = f"blk.{layer}."
    T, E = x.shape[0], spec.head_dim
    qs, ks, vs = [], [], []
    for t in range(T):
        h = norm(x[t], w[p + "attn_norm.weight"])
        q = (w[p + "attn_q.weight"] @ h).reshape(spec.num_heads, E)
        k = (w[p + "attn_k.weight"] @ h).reshape(spec.num_kv_heads, E)
        qs.append([rot(norm(q[i], w[p + "attn_q_norm.weight"]), t) for i in range(spec.num_heads)])
        ks.append([rot(norm(k[i], w[p + "attn_k_norm.weight"]), t) for i in range(spec.num_kv_heads)])
        vs.append((w[p + "attn_v.weight"] @ h).reshape(spec.num_kv_heads, E))
    out = []
    for t in range(T):
        heads = []
        for i in range(spec.num_heads):
            j = i // (spec.num_heads // spec.num_kv_heads)
            s = np.array([qs[t][i] @ ks[u][j] / math.sqrt(E) for u in range(t + 1)])
            pr = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            heads.append(sum(pr[u] * vs[u][j] for u in range(t + 1)))
        y = x[t] + w[p + "attn_output.weight"] @ np.concatenate(heads)
        h = norm(y, w[p + "ffn_norm.weight"])
        logits = w[p + "ffn_gate_inp.weight"] @ h
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        top = sorted(range(spec.num_experts), key=lambda e: -probs[e])[: spec.num_experts_used]
        total = sum(probs[e] for e in top)
        for e in top:
            g, u = w[p + "ffn_gate_exps.weight"][e] @ h, w[p + "ffn_up_exps.weight"][e] @ h
            y = y + probs[e] / total * (w[p + "ffn_down_exps.weight"][e] @ (g / (1 + np.exp(-g)) * u))
        out.append(y)
    return np.array(out)


def test_qwen3moe_model_matches_a_loop_written_layer_by_layer():
    w = _weights(QWEN, with_optional=("output.weight",))
    tokens = np.array([5, 17, 3, 60, 22])
    x = w["token_embd.weight"][tokens].astype(np.float64)
    for layer in range(QWEN.num_layers):
        x = _naive_qwen_layer(w, layer, x, QWEN)
    model = _model(QWEN, w)
    hidden = model.forward_hidden(tokens, 0, KVCache.for_spec(QWEN, 8))
    assert _rel_err(hidden, x) <= 1e-5


def test_mtp_block_shapes_cache_and_heads():
    weights = _weights(QWEN, with_optional=("output.weight",))
    model = _model(QWEN, weights)
    kv = KVCache.for_spec(QWEN, 16)
    tokens = np.array([3, 9, 27, 41, 2])
    hidden = model.forward_hidden(tokens[:4], 0, kv)
    mtp_layer = QWEN.num_layers
    assert not kv.k[mtp_layer].any()  # the main forward leaves the MTP layer's cache alone
    drafts = model.mtp_forward(hidden, tokens[1:5], 0, kv)
    assert drafts.shape == (4, QWEN.vocab_size)
    assert kv.k[mtp_layer][:4].any() and not kv.k[mtp_layer][4:].any()

    # the block is eh_proj(concat(enorm(embed(next)), hnorm(h))) then a decoder layer
    p = f"blk.{mtp_layer}.nextn."
    eps = QWEN.rms_norm_eps
    x = np.concatenate([ops.rms_norm(weights["token_embd.weight"][tokens[1:5]], weights[p + "enorm.weight"], eps),
                        ops.rms_norm(hidden, weights[p + "hnorm.weight"], eps)],
                       axis=-1) @ weights[p + "eh_proj.weight"].T
    expected = model.decoder_layer(mtp_layer, x, 0, KVCache.for_spec(QWEN, 16))
    assert _rel_err(model.mtp_hidden(hidden, tokens[1:5], 0, KVCache.for_spec(QWEN, 16)), expected) <= 1e-6
    assert np.allclose(drafts, model.logits(expected), rtol=1e-4, atol=1e-5)  # no shared head: main head

    weights[p + "shared_head_head.weight"] = _randn(QWEN.vocab_size, QWEN.hidden_size)
    weights[p + "shared_head_norm.weight"] = _randn(QWEN.hidden_size)
    with_head = _model(QWEN, weights).mtp_forward(hidden, tokens[1:5], 0, KVCache.for_spec(QWEN, 16))
    own = ops.rms_norm(expected, weights[p + "shared_head_norm.weight"], eps) @ weights[p + "shared_head_head.weight"].T
    assert np.allclose(with_head, own, rtol=1e-4, atol=1e-5)


def test_mtp_needs_a_nextn_layer():
    model = _model(LLAMA, _weights(LLAMA))
    with pytest.raises(EngineError, match="0 nextn layers"):
        model.mtp_forward(_randn(1, LLAMA.hidden_size), np.array([1]), 0, KVCache.for_spec(LLAMA, 4))


def test_kv_cache_overflow_names_the_positions():
    model = _model(LLAMA, _weights(LLAMA))
    with pytest.raises(EngineError, match="positions 2..5 do not fit the KV cache of 4"):
        model.forward(np.array([1, 2, 3, 4]), 2, KVCache.for_spec(LLAMA, 4))


def test_weights_are_fetched_once():
    weights = _weights(LLAMA)
    calls = []

    def get(name):
        calls.append(name)
        return weights[name]

    model = ReferenceModel(LLAMA, get)
    model.forward(np.array([1, 2]), 0, KVCache.for_spec(LLAMA, 8))
    model.forward(np.array([3]), 2, KVCache.for_spec(LLAMA, 8))
    assert len(calls) == len(set(calls))


def test_tiny_synthetic_gguf_with_mtp_runs_through_the_loader(tmp_path):
    from gguf import GGMLQuantizationType

    from strata.model.gguf_file import open_gguf
    from strata.model.synth import PRESETS, write_synthetic_model

    path = write_synthetic_model(tmp_path / "tiny.gguf", PRESETS["tiny"], GGMLQuantizationType.Q4_0, seed=3,
                                 with_mtp=True)
    gguf = open_gguf(path)
    spec = gguf.spec
    model = ReferenceModel.from_gguf(gguf)
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, size=9)

    kv = KVCache.for_spec(spec, 16)
    hidden = np.concatenate([model.forward_hidden(tokens[:4], 0, kv), model.forward_hidden(tokens[4:8], 4, kv)])
    one_shot = model.forward_hidden(tokens[:8], 0, KVCache.for_spec(spec, 16))
    assert _rel_err(hidden, one_shot) <= 1e-5

    drafts = model.mtp_forward(hidden, tokens[1:9], 0, kv)
    assert drafts.shape == (8, spec.vocab_size) and np.all(np.isfinite(drafts))
    stepwise = np.concatenate([model.mtp_forward(hidden[i:i + 1], tokens[i + 1:i + 2], i, kv) for i in range(8)])
    assert _rel_err(stepwise, drafts) <= 1e-5


def test_preload_fetches_the_main_model_and_optionally_the_mtp_block():
    weights = _weights(QWEN, with_optional=("output.weight",))
    fetched = []

    def get(name):
        fetched.append(name)
        if name not in weights:
            raise KeyError(name)
        return weights[name]

    model = ReferenceModel(QWEN, get)
    model.preload()
    main = {n for n in weights if not n.startswith(f"blk.{QWEN.num_layers}.")}
    assert set(fetched) & set(weights) == main
    model.forward(np.array([1, 2]), 0, KVCache.for_spec(QWEN, 4))
    assert set(fetched) & set(weights) == main  # nothing left to fetch
    model.preload(is_mtp_included=True)
    assert set(fetched) & set(weights) == set(weights)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_kv_cache_rounds_written_rows_as_the_engine_cache_stores_them(kv_type):
    rng = np.random.default_rng(7)
    k, v = rng.standard_normal((2, 3, 2, 32)).astype(np.float32)  # [T, K, E] each
    kv = KVCache(1, 4, 2, 32, kv_type)
    kv.write(0, 1, k, v)
    qtype = {"f16": QType.F16, "q8_0": QType.Q8_0, "q4_0": QType.Q4_0}[kv_type]
    expected = gguf_dequantize(gguf_quantize(k.reshape(3, 64), qtype), qtype).reshape(3, 2, 32)
    np.testing.assert_array_equal(kv.k[0][1:4], expected)
    assert not np.array_equal(kv.k[0][1:4], k) and not kv.k[0][0].any()
    with pytest.raises(ValueError, match="kv_type must be one of"):
        KVCache(1, 4, 2, 32, "q4_k")
