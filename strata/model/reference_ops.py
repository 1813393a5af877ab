"""The operations of the reference forward, as small pure NumPy functions.

Activations are float32. Reductions whose rounding would move results (norms, softmax, attention
scores and their weighted sums, the router) accumulate in float64 and round once at the end; the
weight matmuls stay float32 (BLAS), which is what every backend is compared against. Names follow
llama.cpp's graph code so that a reader can check one against the other.

Shapes: T tokens, D hidden size, H query heads, K key/value heads, E head dim, S cached positions,
N experts, F ffn size, V vocabulary.
"""

from __future__ import annotations

import numpy as np

_WEIGHT_SUM_FLOOR = 6.103515625e-5  # llama.cpp clamps the top-k weight sum to the smallest f16 normal


def embed(token_embd: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Rows of the embedding table. token_embd [V, D], tokens [T] -> [T, D]."""
    return np.ascontiguousarray(token_embd[np.asarray(tokens, dtype=np.int64)], dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis. x [..., D], weight [D] -> [..., D]."""
    x64 = x.astype(np.float64)
    mean_square = np.mean(x64 * x64, axis=-1, keepdims=True)  # [..., 1]
    return (x64 / np.sqrt(mean_square + eps)).astype(np.float32) * weight


def rope_angles(positions: np.ndarray, num_rot_dims: int, theta_base: float,
                freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of pos * base^(-2i/num_rot_dims) (divided by freq_factors[i] where given).

    positions [T] -> cos, sin [T, num_rot_dims // 2], float64.
    """
    i = np.arange(num_rot_dims // 2, dtype=np.float64)
    inv_freq = theta_base ** (-2.0 * i / num_rot_dims)  # [R/2]
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, R/2]
    return np.cos(angles), np.sin(angles)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, is_neox: bool) -> np.ndarray:
    """Rotate the first 2 * cos.shape[1] dims of each head; the rest pass through.

    Normal (llama): pairs are neighbours (x[2i], x[2i+1]). NeoX (qwen3moe): pairs are a half
    apart (x[i], x[i + R/2]). x [T, H, E], cos/sin [T, R/2] -> [T, H, E].
    """
    half = cos.shape[1]
    num_rot_dims = 2 * half
    x64 = x.astype(np.float64)
    rot = x64[..., :num_rot_dims]  # [T, H, R]
    if is_neox:
        a, b = rot[..., :half], rot[..., half:]
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
    ra, rb = a * c - b * s, a * s + b * c  # [T, H, R/2]
    out = x64.copy()
    if is_neox:
        out[..., :half], out[..., half:num_rot_dims] = ra, rb
    else:
        out[..., 0:num_rot_dims:2], out[..., 1:num_rot_dims:2] = ra, rb
    return out.astype(np.float32)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start_pos: int) -> np.ndarray:
    """Causal grouped-query attention of T new queries over the cache.

    Query t sits at position start_pos + t and sees cached positions 0..start_pos + t. Query head
    h reads key/value head h // (H / K). q [T, H, E], k_cache/v_cache [S >= start_pos + T, K, E]
    -> [T, H, E].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_seen = start_pos + num_tokens
    k = k_cache[:num_seen].astype(np.float64)  # [S, K, E]
    v = v_cache[:num_seen].astype(np.float64)  # [S, K, E]
    qg = q.astype(np.float64).reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [K, G, T, E]
    scores = qg @ k.transpose(1, 2, 0)[:, None] / np.sqrt(head_dim)  # [K, G, T, S]
    query_pos = start_pos + np.arange(num_tokens)
    is_future = np.arange(num_seen)[None, :] > query_pos[:, None]  # [T, S]
    scores[..., is_future] = -np.inf
    out = softmax(scores) @ v.transpose(1, 0, 2)[:, None]  # [K, G, T, E]
    return out.transpose(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float64. [..., N] -> [..., N]."""
    x64 = x.astype(np.float64)
    e = np.exp(x64 - np.max(x64, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp overflows to inf for x << 0, and 1 / inf is the right 0
        return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def ffn(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """SwiGLU feed-forward: down(silu(gate x) * up x). x [T, D], gate/up [F, D], down [D, F] -> [T, D]."""
    hidden = silu(x @ gate.T) * (x @ up.T)  # [T, F]
    return hidden @ down.T


def route(router_logits: np.ndarray, num_experts_used: int, is_norm_weights: bool = True,
          weights_scale: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Softmax routing as llama.cpp's build_moe_ffn with softmax gating.

    Probabilities are the softmax over all experts; the top-k by probability are selected (ties
    to the lower expert id); their probabilities are renormalised to sum 1 when is_norm_weights,
    then scaled by weights_scale unless it is 0 or 1. router_logits [T, N] -> ids [T, k] int64,
    weights [T, k] float32.
    """
    probs = softmax(router_logits)  # [T, N]
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :num_experts_used]  # [T, k]
    weights = np.take_along_axis(probs, ids, axis=-1)  # [T, k]
    if is_norm_weights:
        weights = weights / np.maximum(np.sum(weights, axis=-1, keepdims=True), _WEIGHT_SUM_FLOOR)
    if weights_scale not in (0.0, 1.0):
        weights = weights * weights_scale
    return ids.astype(np.int64), weights.astype(np.float32)


def moe(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate_exps: np.ndarray,
        up_exps: np.ndarray, down_exps: np.ndarray) -> np.ndarray:
    """Weighted sum of the selected SwiGLU experts per token.

    x [T, D], ids/weights [T, k], gate_exps/up_exps [N, F, D], down_exps [N, D, F] -> [T, D].
    Each expert runs once over the tokens that selected it.
    """
    out = np.zeros(x.shape, dtype=np.float64)  # [T, D]
    for expert in np.unique(ids):
        rows, slots = np.nonzero(ids == expert)  # token index, slot in its top-k
        y = ffn(x[rows], gate_exps[expert], up_exps[expert], down_exps[expert])  # [t, D]
        out[rows] += y.astype(np.float64) * weights[rows, slots, None]  # a token picks an expert once
    return out.astype(np.float32)


def shared_expert(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                  gate_inp: np.ndarray | None) -> np.ndarray:
    """The always-on expert; scaled by sigmoid(gate_inp x) where the model has that gate (qwen2moe).

    x [T, D], gate/up [F, D], down [D, F], gate_inp [1, D] or [D] -> [T, D].
    """
    y = ffn(x, gate, up, down)  # [T, D]
    if gate_inp is None:
        return y
    return y * sigmoid(x @ gate_inp.reshape(-1, 1))  # [T, 1] broadcast


def output_head(hidden: np.ndarray, norm_weight: np.ndarray, head: np.ndarray, eps: float) -> np.ndarray:
    """Logits from the last hidden states. hidden [T, D], head [V, D] -> [T, V]."""
    return rms_norm(hidden, norm_weight, eps) @ head.T
