"""The reference forward: what the model computes, in NumPy, from dequantized GGUF weights.

This is the oracle every kernel and backend is checked against. One decoder layer is
    h = rms_norm(x);  q, k, v = attn_q h, attn_k h, attn_v h  (q, k RMS-normed per head for qwen3moe)
    x = x + attn_output(attention(rope(q), rope(k), v))       (causal, grouped-query, over the cache)
    x = x + ffn(rms_norm(x))    dense SwiGLU (llama) or routed (+ shared) experts (qwen3moe, Mixtral-style llama)
and the logits are output(rms_norm(x)), with `token_embd` as the head when `output` is absent.
The multi-token-prediction block (llama.cpp's `nextn` layer) reads the main model's last hidden
state h_t (before the output norm) and the embedding of token t+1:
    x = eh_proj(concat(enorm(embed(t+1)), hnorm(h_t)));  x = decoder_layer(x);
    logits = shared_head_head(shared_head_norm(x))  (falling back to output_norm / output).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from strata.errors import EngineError
from strata.model import reference_ops as ops
from strata.model.gguf_file import GgufModel
from strata.model.reference_ops import (  # noqa: F401  the reference's vocabulary, importable from here
    attention,
    embed,
    ffn,
    moe,
    output_head,
    rms_norm,
    rope,
    rope_angles,
    route,
    shared_expert,
    softmax,
)
from strata.model.spec import ModelSpec, tensor_shapes

GetWeight = Callable[[str], np.ndarray]


class KVCache:
    """Per layer K and V, each [context_length, num_kv_heads, head_dim] float32.

    Layers 0..num_layers-1 belong to the main model; the MTP blocks follow them. ``kv_type`` (an
    engine's ``runtime.kv_type``: "f16", "q8_0", "q4_0"; None keeps float32) rounds each written
    row as that cache stores it (ggml's reference quantization of each 32-value block), so the
    oracle sees the values an engine with that cache reads.
    """

    def __init__(self, num_layers: int, context_length: int, num_kv_heads: int, head_dim: int,
                 kv_type: str | None = None):
        if kv_type not in _KV_ROUNDING:
            raise ValueError(f"kv_type must be one of {sorted(k for k in _KV_ROUNDING if k)} or None, got {kv_type!r}")
        if kv_type in ("q8_0", "q4_0") and num_kv_heads * head_dim % 32:
            raise ValueError(f"a {kv_type} cache needs num_kv_heads * head_dim a multiple of 32, got "
                             f"{num_kv_heads * head_dim}")
        shape = (context_length, num_kv_heads, head_dim)
        self.context_length = context_length
        self.kv_type = kv_type
        self.k = [np.zeros(shape, dtype=np.float32) for _ in range(num_layers)]
        self.v = [np.zeros(shape, dtype=np.float32) for _ in range(num_layers)]

    @classmethod
    def for_spec(cls, spec: ModelSpec, context_length: int | None = None, kv_type: str | None = None) -> KVCache:
        num_positions = spec.context_length if context_length is None else context_length
        return cls(spec.num_layers + spec.num_nextn_layers, num_positions, spec.num_kv_heads, spec.head_dim, kv_type)

    def write(self, layer: int, start_pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v [T, K, E] at positions start_pos..start_pos+T-1 of one layer."""
        end = start_pos + k.shape[0]
        if start_pos < 0 or end > self.context_length:
            raise EngineError(
                f"positions {start_pos}..{end - 1} do not fit the KV cache of {self.context_length} "
                f"positions; shorten the prompt or max tokens, or raise the context length"
            )
        self.k[layer][start_pos:end] = _round_kv(k, self.kv_type)
        self.v[layer][start_pos:end] = _round_kv(v, self.kv_type)


def _round_kv(x: np.ndarray, kv_type: str | None) -> np.ndarray:
    """[T, K, E] values as a cache of ``kv_type`` holds them (rows of K * E in 32-value blocks)."""
    qtype = _KV_ROUNDING[kv_type]
    if qtype is None:
        return x
    if qtype == GGMLQuantizationType.F16:
        return x.astype(np.float16).astype(np.float32)
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], -1)  # [T, K * E]
    return gguf_dequantize(gguf_quantize(rows, qtype), qtype).reshape(x.shape).astype(np.float32)


_KV_ROUNDING = MappingProxyType({None: None, "f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0,
                                 "q4_0": GGMLQuantizationType.Q4_0})


class ReferenceModel:
    """The model over weights supplied by `get_weight(name) -> float32 array`, row-major
    ([out, in] matrices, [num_experts, out, in] expert tensors), raising KeyError for a tensor the
    file does not have. Weights are fetched on first use and kept.
    """

    def __init__(self, spec: ModelSpec, get_weight: GetWeight):
        self.spec = spec
        self._get_weight = get_weight
        self._weights: dict[str, np.ndarray | None] = {}

    @classmethod
    def from_gguf(cls, model: GgufModel) -> ReferenceModel:
        """Over an opened GGUF: tensors are dequantized on first use."""

        def get_weight(name: str) -> np.ndarray:
            if name not in model.tensors:
                raise KeyError(name)
            return model.dequantize(name)

        return cls(model.spec, get_weight)

    def weight(self, name: str) -> np.ndarray:
        found = self.optional_weight(name)
        if found is None:
            raise KeyError(f"the model has no tensor {name}")
        return found

    def optional_weight(self, name: str) -> np.ndarray | None:
        if name not in self._weights:
            try:
                self._weights[name] = np.asarray(self._get_weight(name), dtype=np.float32)
            except KeyError:
                self._weights[name] = None
        return self._weights[name]

    def preload(self, is_mtp_included: bool = False) -> None:
        """Fetch every weight the forward uses now, so that later timing excludes dequantization."""
        required, optional = tensor_shapes(self.spec)
        for name in [*required, *optional]:
            is_mtp = name.startswith("blk.") and int(name.split(".")[1]) >= self.spec.num_layers
            if is_mtp_included or not is_mtp:
                self.optional_weight(name)

    def forward(self, tokens: np.ndarray, start_pos: int, kv: KVCache) -> np.ndarray:
        """Logits of every token of the batch. tokens [T] at positions start_pos.. -> [T, V]."""
        return self.logits(self.forward_hidden(tokens, start_pos, kv))

    def forward_hidden(self, tokens: np.ndarray, start_pos: int, kv: KVCache) -> np.ndarray:
        """The last layer's output before the output norm. tokens [T] -> [T, D]; fills kv."""
        x = ops.embed(self.weight("token_embd.weight"), tokens)  # [T, D]
        for layer in range(self.spec.num_layers):
            x = self.decoder_layer(layer, x, start_pos, kv)
        return x

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [T, D] (before the output norm) -> logits [T, V]."""
        return ops.output_head(hidden, self.weight("output_norm.weight"), self._output_weight(),
                               self.spec.rms_norm_eps)

    def mtp_hidden(self, hidden: np.ndarray, next_tokens: np.ndarray, start_pos: int, kv: KVCache,
                   depth: int = 0) -> np.ndarray:
        """The MTP block's output before its head norm.

        hidden [T, D]: the main model's forward_hidden at positions start_pos..; next_tokens [T]:
        the token that follows each of those positions. The block's own KV entries go to the same
        positions in its layer of kv. -> [T, D]
        """
        spec, layer = self.spec, self._mtp_layer(depth)
        prefix = f"blk.{layer}.nextn."
        embd = self.optional_weight(prefix + "embed_tokens.weight")
        e = ops.embed(self.weight("token_embd.weight") if embd is None else embd, next_tokens)  # [T, D]
        e_norm = ops.rms_norm(e, self.weight(prefix + "enorm.weight"), spec.rms_norm_eps)
        h_norm = ops.rms_norm(hidden, self.weight(prefix + "hnorm.weight"), spec.rms_norm_eps)
        x = np.concatenate([e_norm, h_norm], axis=-1) @ self.weight(prefix + "eh_proj.weight").T  # [T, D]
        return self.decoder_layer(layer, x, start_pos, kv)

    def mtp_forward(self, hidden: np.ndarray, next_tokens: np.ndarray, start_pos: int, kv: KVCache,
                    depth: int = 0) -> np.ndarray:
        """Draft logits for the token two after each position. -> [T, V]"""
        layer = self._mtp_layer(depth)
        x = self.mtp_hidden(hidden, next_tokens, start_pos, kv, depth)
        norm = self.optional_weight(f"blk.{layer}.nextn.shared_head_norm.weight")
        head = self.optional_weight(f"blk.{layer}.nextn.shared_head_head.weight")
        return ops.output_head(x, self.weight("output_norm.weight") if norm is None else norm,
                               self._output_weight() if head is None else head, self.spec.rms_norm_eps)

    def decoder_layer(self, layer: int, x: np.ndarray, start_pos: int, kv: KVCache) -> np.ndarray:
        """One pre-norm block with residuals. x [T, D] -> [T, D]; writes this layer's kv."""
        eps = self.spec.rms_norm_eps
        x = x + self.attention_block(layer, ops.rms_norm(x, self._w(layer, "attn_norm"), eps), start_pos, kv)
        return x + self.ffn_block(layer, ops.rms_norm(x, self._w(layer, "ffn_norm"), eps))

    def attention_block(self, layer: int, h: np.ndarray, start_pos: int, kv: KVCache) -> np.ndarray:
        """Self-attention of the normed input h [T, D] over the cache -> [T, D]."""
        spec = self.spec
        num_tokens = h.shape[0]
        q = (h @ self._w(layer, "attn_q").T).reshape(num_tokens, spec.num_heads, spec.head_dim)  # [T, H, E]
        k = (h @ self._w(layer, "attn_k").T).reshape(num_tokens, spec.num_kv_heads, spec.head_dim)  # [T, K, E]
        v = (h @ self._w(layer, "attn_v").T).reshape(num_tokens, spec.num_kv_heads, spec.head_dim)  # [T, K, E]
        if spec.has_qk_norm:
            q = ops.rms_norm(q, self._w(layer, "attn_q_norm"), spec.rms_norm_eps)
            k = ops.rms_norm(k, self._w(layer, "attn_k_norm"), spec.rms_norm_eps)
        positions = start_pos + np.arange(num_tokens)
        cos, sin = ops.rope_angles(positions, spec.num_rope_dims, spec.rope_theta,
                                   self.optional_weight("rope_freqs.weight"))
        q = ops.rope(q, cos, sin, spec.is_rope_neox)
        k = ops.rope(k, cos, sin, spec.is_rope_neox)
        kv.write(layer, start_pos, k, v)
        out = ops.attention(q, kv.k[layer], kv.v[layer], start_pos)  # [T, H, E]
        return out.reshape(num_tokens, spec.q_size) @ self._w(layer, "attn_output").T

    def ffn_block(self, layer: int, h: np.ndarray) -> np.ndarray:
        """Dense SwiGLU, or routed experts plus the shared expert. h [T, D] -> [T, D]."""
        spec = self.spec
        if not spec.is_moe:
            return ops.ffn(h, self._w(layer, "ffn_gate"), self._w(layer, "ffn_up"), self._w(layer, "ffn_down"))
        router_logits = h.astype(np.float64) @ self._w(layer, "ffn_gate_inp").T.astype(np.float64)  # [T, N]
        ids, weights = ops.route(router_logits, spec.num_experts_used, spec.is_expert_weights_normalized)
        out = ops.moe(h, ids, weights, self._w(layer, "ffn_gate_exps"), self._w(layer, "ffn_up_exps"),
                      self._w(layer, "ffn_down_exps"))
        if spec.shared_expert_ffn_size:
            gate_inp = self.optional_weight(f"blk.{layer}.ffn_gate_inp_shexp.weight")
            out = out + ops.shared_expert(h, self._w(layer, "ffn_gate_shexp"), self._w(layer, "ffn_up_shexp"),
                                          self._w(layer, "ffn_down_shexp"), gate_inp)
        return out

    def _w(self, layer: int, name: str) -> np.ndarray:
        return self.weight(f"blk.{layer}.{name}.weight")

    def _output_weight(self) -> np.ndarray:
        head = self.optional_weight("output.weight")
        return self.weight("token_embd.weight") if head is None else head

    def _mtp_layer(self, depth: int) -> int:
        if not 0 <= depth < self.spec.num_nextn_layers:
            raise EngineError(f"MTP depth {depth} requested, but the model has "
                              f"{self.spec.num_nextn_layers} nextn layers")
        return self.spec.num_layers + depth
