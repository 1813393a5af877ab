"""The planner's cost model: how long a prefill takes for a chunk size and an expert-cache size.

Per chunk of c tokens starting at position p, with s of the model's S = layers x experts expert
slots resident in the cache:

    copy_s    = (S - s) * slot_bytes / pcie_bytes_per_s      every uncached expert streams once
    compute_s = c * (weight_flops + attention_flops(p, c)) / compute_flops_per_s
    chunk_s   = max(copy_s, compute_s) when copies overlap compute, else copy_s + compute_s;
                plus chunk_overhead_s (launches, routing, synchronization of one chunk)

A chunk of a few hundred tokens routed top-k touches nearly every expert of a layer, so a chunk
streams every uncached expert whatever its size: bigger chunks divide those bytes over more
tokens, and a bigger cache shrinks them. The rates are measured (``rates.py``: a PCIe probe at
load, the compute rate calibrated from the engine's own chunks) unless configured.

Only experts cached before the prefill count: prefill streams its misses through the ring without
inserting them (expert_cache.py's policy). Experts the prompt workspace evicts from the cache
(``planner.py``: it borrows cache memory) stream in every chunk, and are staged back once after
the prefill (``restage_seconds``).
"""

from __future__ import annotations

import dataclasses
import math

from strata.model.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class ChunkCost:
    num_chunks: int
    copy_seconds: float  # per chunk
    compute_seconds: float  # all chunks
    total_seconds: float


@dataclasses.dataclass(frozen=True)
class PrefillCostModel:
    weight_flops_per_token: float  # 2 x the weights one token multiplies through
    attention_flops_per_pair: float  # per (query token, visible key) pair, all layers: 4 x q width
    num_expert_slots: int  # layers x experts: what one chunk streams with an empty cache
    slot_bytes: int
    pcie_bytes_per_s: float
    compute_flops_per_s: float
    chunk_overhead_s: float
    is_overlapped: bool = True

    @classmethod
    def from_spec(cls, spec: ModelSpec, slot_bytes: int, *, pcie_bytes_per_s: float, compute_flops_per_s: float,
                  chunk_overhead_s: float, is_overlapped: bool = True) -> PrefillCostModel:
        attention = spec.hidden_size * (2 * spec.q_size + 2 * spec.kv_size)
        ffn = 3 * spec.hidden_size * (spec.num_experts_used * spec.expert_ffn_size + spec.shared_expert_ffn_size
                                      if spec.is_moe else spec.dense_ffn_size)
        router = spec.hidden_size * spec.num_experts
        return cls(weight_flops_per_token=2.0 * spec.num_layers * (attention + ffn + router),
                   attention_flops_per_pair=4.0 * spec.q_size * spec.num_layers,
                   num_expert_slots=spec.num_layers * spec.num_experts if spec.is_moe else 0,
                   slot_bytes=slot_bytes, pcie_bytes_per_s=pcie_bytes_per_s,
                   compute_flops_per_s=compute_flops_per_s, chunk_overhead_s=chunk_overhead_s,
                   is_overlapped=is_overlapped)

    def cost(self, unread_tokens: int, chunk_tokens: int, cached_slots: int, start: int = 0) -> ChunkCost:
        """Predicted prefill of ``unread_tokens`` after ``start`` cached positions, in chunks of ``chunk_tokens``."""
        num_chunks = max(1, math.ceil(unread_tokens / max(1, chunk_tokens)))
        uncached = max(0, self.num_expert_slots - max(0, cached_slots))
        copy_s = uncached * self.slot_bytes / self.pcie_bytes_per_s
        total = compute_total = 0.0
        for index in range(num_chunks):
            first = start + index * chunk_tokens
            compute_s = self.chunk_flops(min(chunk_tokens, start + unread_tokens - first), first) \
                / self.compute_flops_per_s
            compute_total += compute_s
            total += (max(copy_s, compute_s) if self.is_overlapped else copy_s + compute_s) + self.chunk_overhead_s
        return ChunkCost(num_chunks, copy_s, compute_total, total)

    def chunk_flops(self, num_tokens: int, first: int) -> float:
        """FLOPs of a chunk of ``num_tokens`` whose first token is at position ``first``."""
        pairs = num_tokens * first + num_tokens * (num_tokens + 1) / 2  # causal: token i sees first + i + 1 keys
        return num_tokens * self.weight_flops_per_token + pairs * self.attention_flops_per_pair

    def mtp_share(self, spec: ModelSpec) -> float:
        """The compute the MTP block adds to a prefill (it writes its cache over every chunk so that
        drafts attend over the prompt), as a fraction of the main model's weight FLOPs a token: its
        projection of the joined [embedding; hidden] rows (2D x D) and its attention's Q, K and V
        projections (``MtpDraft.cache_prompt``: nothing after them, no attention over the prompt)."""
        projections = 2 * spec.hidden_size * spec.hidden_size + spec.hidden_size * (spec.q_size + 2 * spec.kv_size)
        return 2.0 * projections / self.weight_flops_per_token

    def restage_seconds(self, num_slots: int) -> float:
        """Staging ``num_slots`` evicted experts back into the cache after the prefill."""
        return num_slots * self.slot_bytes / self.pcie_bytes_per_s

    def describe(self, cost: ChunkCost) -> str:
        return (f"{cost.num_chunks} chunk(s) x (copy {cost.copy_seconds:.2f} s at "
                f"{self.pcie_bytes_per_s / 1e9:.1f} GB/s {'overlapped with' if self.is_overlapped else '+'} compute) + "
                f"compute {cost.compute_seconds:.2f} s at {self.compute_flops_per_s / 1e12:.1f} TFLOP/s "
                f"→ predicted {cost.total_seconds:.2f} s")
