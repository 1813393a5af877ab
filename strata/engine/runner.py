"""The model runner: the forward pass over the ops backend, with experts from cache or the ring.

One layer, T tokens at positions start..start+T-1 (the same sums as ``strata.model.reference``):

    h = rms_norm(x);  q, k, v = h Wq, h Wk, h Wv;  q, k = rope(qk_norm(q, k));  kv[start:] = k, v
    x += attention(q, kv) Wo
    h = rms_norm(x);  ids, w = route(h Wr)             # top-k of a softmax, renormalised
    x += sum_k w * expert_k(h)  (+ shared expert)       # experts from the cache or the ring
"""

from __future__ import annotations

import dataclasses

import numpy as np

from strata.engine.decode_resources import upload_tensor
from strata.engine.expert_cache import ExpertCache
from strata.engine.expert_pack import ExpertPack
from strata.engine.ops import Ops, QTensor
from strata.engine.workspace import PromptWorkspace
from strata.model.gguf_file import GgufModel
from strata.model.spec import ModelSpec

DENSE_OWNER = "dense_weights"
_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate", "ffn_up", "ffn_down",
                   "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
_LAYER_VECTORS = ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "ffn_gate_inp_shexp")


@dataclasses.dataclass
class StreamStats:
    streamed_bytes: int = 0
    num_chunks: int = 0
    hits: int = 0
    misses: int = 0


class DeviceWeights:
    """The dense weights of the main layers on the backend: matrices stay quantized, norms as float32."""

    def __init__(self, ops: Ops, model: GgufModel):
        spec = model.spec
        self.matrices: dict[str, QTensor] = {}
        self.vectors: dict[str, object] = {}
        names = ["token_embd"] + [f"blk.{i}.{n}" for i in range(spec.num_layers) for n in _LAYER_MATRICES]
        for name in names:
            if f"{name}.weight" in model.tensors:
                self.matrices[name] = upload_tensor(ops, DENSE_OWNER, model.tensors[f"{name}.weight"])
        vectors = ["output_norm", "rope_freqs"] + [f"blk.{i}.{n}" for i in range(spec.num_layers)
                                                   for n in _LAYER_VECTORS]
        for name in vectors:
            if f"{name}.weight" in model.tensors:
                host = model.dequantize(f"{name}.weight").astype(np.float32).reshape(-1)
                self.vectors[name] = ops.upload(DENSE_OWNER, host)
        freqs = model.tensors.get("rope_freqs.weight")
        self.rope_freqs_host = model.dequantize("rope_freqs.weight") if freqs is not None else None
        ops.prepare_rope(spec.num_rope_dims, spec.rope_theta, self.rope_freqs_host)


class ModelRunner:
    def __init__(self, spec: ModelSpec, ops: Ops, weights: DeviceWeights, kv, cache: ExpertCache | None,
                 pack: ExpertPack | None):
        self.spec = spec
        self.ops = ops
        self.w = weights
        self.kv = kv
        self.cache = cache
        self.pack = pack

    def forward(self, tokens: np.ndarray, start: int, workspace: PromptWorkspace | None, stats: StreamStats):
        """Hidden states [T, D] of ``tokens`` at positions ``start``.. (before the output norm); fills the KV cache.

        With a workspace (prefill) cache misses stream through its ring; without (decode) they are
        streamed into the cache.
        """
        spec, ops = self.spec, self.ops
        x = ops.embed(self.w.matrices["token_embd"], tokens)  # [T, D]
        positions = np.arange(start, start + len(tokens), dtype=np.int64)
        for layer in range(spec.num_layers):
            self._attention(layer, x, positions, start)
            h = ops.rms_norm(x, self._vec(layer, "ffn_norm"), spec.rms_norm_eps)  # [T, D]
            ops.add(x, self._moe(layer, h, workspace, stats) if spec.is_moe else self._ffn(layer, h))
        return x

    def _attention(self, layer: int, x, positions: np.ndarray, start: int) -> None:
        spec, ops = self.spec, self.ops
        num_tokens = len(positions)
        h = ops.rms_norm(x, self._vec(layer, "attn_norm"), spec.rms_norm_eps)
        q = ops.matmul(h, self._mat(layer, "attn_q")).reshape(num_tokens, spec.num_heads, spec.head_dim)
        k = ops.matmul(h, self._mat(layer, "attn_k")).reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = ops.matmul(h, self._mat(layer, "attn_v")).reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
        ops.qk_norm_rope(q, k, self.w.vectors.get(f"blk.{layer}.attn_q_norm"),
                         self.w.vectors.get(f"blk.{layer}.attn_k_norm"), positions, spec.num_rope_dims,
                         spec.rope_theta, spec.is_rope_neox, spec.rms_norm_eps, self.w.rope_freqs_host)
        ops.kv_write(self.kv, layer, start, k, v)
        out = ops.attention(q, self.kv, layer, start)  # [T, Hq * E]
        ops.add(x, ops.matmul(out, self._mat(layer, "attn_output")))

    def _ffn(self, layer: int, h):
        return self.ops.ffn(h, self._mat(layer, "ffn_gate"), self._mat(layer, "ffn_up"), self._mat(layer, "ffn_down"))

    def _moe(self, layer: int, h, workspace: PromptWorkspace | None, stats: StreamStats):
        spec, ops, cache = self.spec, self.ops, self.cache
        ids, weights = ops.route(h, self._mat(layer, "ffn_gate_inp"), spec.num_experts_used,
                                 spec.is_expert_weights_normalized)  # ids [T, k] on the host
        acc = ops.moe_accumulator(h.shape[0], spec.hidden_size)  # [T, D]
        slot_of = np.full(spec.num_experts, -1, dtype=np.int32)
        misses = []
        for expert in np.unique(ids):
            slot = cache.lookup(layer, int(expert))
            slot_of[expert] = slot
            if slot < 0:
                misses.append(int(expert))
        stats.hits += int(np.count_nonzero(slot_of >= 0))
        stats.misses += len(misses)
        if workspace is not None and workspace.geometry is not None and workspace.geometry.ring_slots:
            ops.moe(acc, h, ids, weights, cache.storage, slot_of, cache.layout)  # cached experts in place
            self._through_ring(layer, h, ids, weights, acc, misses, workspace, stats)
        else:
            protected = {int(s) for s in slot_of if s >= 0}
            for expert in misses:
                slot = cache.insert(layer, expert, protected)
                self._stage(layer, expert, slot, stats)
                slot_of[expert] = slot
                protected.add(slot)
            ops.moe(acc, h, ids, weights, cache.storage, slot_of, cache.layout)
        if spec.shared_expert_ffn_size:
            shared = ops.ffn(h, self._mat(layer, "ffn_gate_shexp"), self._mat(layer, "ffn_up_shexp"),
                             self._mat(layer, "ffn_down_shexp"))
            ops.shared_expert_add(acc, shared, h, self.w.vectors.get(f"blk.{layer}.ffn_gate_inp_shexp"))
        return acc

    def _through_ring(self, layer, h, ids, weights, acc, misses, workspace: PromptWorkspace, stats) -> None:
        num_ring = workspace.geometry.ring_slots
        for first in range(0, len(misses), num_ring):
            batch = misses[first:first + num_ring]
            table = np.full(self.spec.num_experts, -1, dtype=np.int32)
            for index, expert in enumerate(batch):
                table[expert] = workspace.ring_slot(index)
                self._stage(layer, expert, int(table[expert]), stats)
            self.ops.moe(acc, h, ids, weights, self.cache.storage, table, self.cache.layout)

    def _stage(self, layer: int, expert: int, slot: int, stats: StreamStats) -> None:
        if slot < 0:
            raise RuntimeError("no expert-cache slot is free for a decode miss")
        self.ops.stage_expert(self.cache.storage, slot, self.cache.layout.slot_bytes, self.pack.slot(layer, expert))
        stats.streamed_bytes += self.cache.layout.slot_bytes

    def _mat(self, layer: int, name: str) -> QTensor:
        return self.w.matrices[f"blk.{layer}.{name}"]

    def _vec(self, layer: int, name: str):
        return self.w.vectors[f"blk.{layer}.{name}"]
