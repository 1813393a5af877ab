"""The model runner: the forward pass over the ops backend, with experts from cache or the ring.

One layer, T tokens at positions start..start+T-1 (the same sums as ``strata.model.reference``):

    h = rms_norm(x);  q, k, v = h Wq, h Wk, h Wv;  q, k = rope(qk_norm(q, k));  kv[start:] = k, v
    x += attention(q, kv) Wo
    h = rms_norm(x);  ids, w = route(h Wr)             # top-k of a softmax, renormalised
    x += sum_k w * expert_k(h)  (+ shared expert)       # experts from the cache or the ring

Where experts come from:
- a prefill chunk that can touch every expert (T * k >= N) streams every expert of each layer that
  is not cached, in id order, through the staging ring; the ring batches of all layers are planned
  at the start of the chunk, so routing never comes back to the host and the copies of layer l+1
  overlap the kernels of layer l;
- a shorter prefill chunk reads the routed ids back and streams only the routed misses through
  the ring;
- decode reads the routed ids back, inserts its misses into the cache and stages them in one call.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from strata.backend.ops import DECODE_MAX_ROWS, Ops, QTensor, host_tier_bytes
from strata.engine.decode.device_speculation import DeviceSpeculation
from strata.engine.decode.expert_addresses import can_read_in_place
from strata.engine.decode.mtp import MtpDraft
from strata.engine.decode.step import DecodeStep, can_use_segments
from strata.engine.memory.decode_resources import upload_tensor
from strata.engine.memory.expert_cache import ExpertCache
from strata.engine.memory.expert_pack import ExpertPack
from strata.engine.memory.staging_ring import RingBatch, StagingRing
from strata.engine.memory.workspace import PromptWorkspace
from strata.engine.stream_stats import StreamStats
from strata.errors import EngineError, PrefillCancelled
from strata.model.gguf_file import GgufModel
from strata.model.spec import ModelSpec

log = logging.getLogger("strata.engine")

DENSE_OWNER = "dense_weights"
_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate", "ffn_up", "ffn_down",
                   "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
_LAYER_VECTORS = ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "ffn_gate_inp_shexp")


@dataclasses.dataclass
class _LayerPlan:
    cached_table: object | None  # [N] slots of the layer's cached experts (None: none cached)
    batches: list[RingBatch]


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
    """The forward pass of prefill chunks and plain decode; for captured decode, the ``DecodeLayers``
    that its ``DecodeStep`` is built on."""

    def __init__(self, spec: ModelSpec, ops: Ops, weights: DeviceWeights, kv, cache: ExpertCache | None,
                 pack: ExpertPack | None, is_decode_captured: bool = True, is_decode_prefetching: bool = False,
                 is_decode_reading_in_place: bool = False):
        self.spec = spec
        self.ops = ops
        self.w = weights
        self.kv = kv
        self.cache = cache
        self.pack = pack
        is_captured = is_decode_captured and can_use_segments(self)
        if is_captured and is_decode_reading_in_place and not can_read_in_place(self):
            log.warning('runtime.decode_misses = "host": the expert kernels cannot read this model\'s experts in '
                        'place (formats without C++ rows, no expert pack, or no GPU); decode stages them')
            is_decode_reading_in_place = False
        # whether the kernels can read the experts in place does not change while the engine lives: decided once
        self.decode_step = DecodeStep(self, is_decode_prefetching, is_reading_in_place=is_decode_reading_in_place) \
            if is_captured else None
        self._row_steps: dict[int, DecodeStep] = {}  # [R] captured steps of R tokens (speculation's verify)
        # greedy speculation's draft and verify on the device (``attach_speculation``): its segments are
        # kept while decode's are
        self.speculation: DeviceSpeculation | None = None

    def attach_speculation(self, mtp: MtpDraft, max_depth: int, arena) -> None:
        """Speculate on the device with ``mtp``, drafting up to ``max_depth`` tokens, in the ``verifier``
        ``arena`` (captured decode only)."""
        if self.decode_step is not None:
            self.speculation = DeviceSpeculation(self, mtp, max_depth, arena)

    @property
    def token_embedding(self) -> QTensor:
        return self.w.matrices["token_embd"]

    @property
    def can_pick_greedy_on_device(self) -> bool:
        """Whether ``greedy_tokens`` runs: decode is captured (``DecodeStep``)."""
        return self.decode_step is not None

    def greedy_tokens(self, token: int, position: int, num_steps: int, head: tuple, bias: tuple | None,
                      stats: StreamStats, then: Callable[[], None] | None = None):
        """Greedy decode on the device after ``token``; see ``DecodeStep.greedy_tokens``."""
        return self.decode_step.greedy_tokens(token, position, num_steps, head, bias, stats, then)

    def forward(self, tokens: np.ndarray, start: int, workspace: PromptWorkspace | None, stats: StreamStats,
                is_cancelled: Callable[[], bool] | None = None):
        """Hidden states [T, D] of ``tokens`` at positions ``start``.. (before the output norm); fills the KV cache.

        With a workspace (prefill) cache misses stream through its ring; without (decode) they are
        streamed into the cache. is_cancelled: asked before each layer of a prefill chunk (a long chunk
        on a slow backend runs for minutes); true raises ``PrefillCancelled``.
        """
        spec, ops = self.spec, self.ops
        if workspace is None and len(tokens) <= DECODE_MAX_ROWS and self.decode_step is not None:
            return self.step_of(len(tokens)).forward([int(t) for t in tokens], start, stats)
        stats.kv_host_bytes += host_tier_bytes(self.kv, start, start + len(tokens))
        ring = self._ring(workspace)
        plans = None
        if ring is not None and len(tokens) * spec.num_experts_used >= spec.num_experts:
            plans = self._plan_every_layer(ring, stats)
        x = ops.embed(self.token_embedding, tokens)  # [T, D]
        positions = ops.positions(start, len(tokens))  # [T]
        timeline = stats.timeline if workspace is not None else None  # prefill's layers only
        groups = None  # the previous layer's MoE groups: the next layer's grouping takes their buffers
        for layer in range(spec.num_layers):
            if is_cancelled is not None and is_cancelled():
                raise PrefillCancelled(f"cancelled before layer {layer} of a {len(tokens)}-token chunk")
            marks = timeline.begin(layer) if timeline is not None else None
            self.attention_block(layer, x, positions, start)
            if marks is not None:
                timeline.attention_done(marks)
            h = ops.rms_norm(x, self.vector(layer, "ffn_norm"), spec.rms_norm_eps)  # [T, D]
            if not spec.is_moe:
                ops.add(x, self._ffn(layer, h))
            else:
                waits = marks.waits if marks is not None else None
                acc, groups = self._moe(layer, x, h, ring, plans[layer] if plans else None, stats, waits, groups)
                ops.add(x, acc)
                acc = None  # before the next layer's accumulator: a [T, D] buffer (int64 sums) at a time
            if marks is not None:
                timeline.end(marks)
        return x

    def step_of(self, num_rows: int) -> DecodeStep:
        """The captured step of ``num_rows`` tokens (made at its first use)."""
        if num_rows == 1:
            return self.decode_step
        if num_rows not in self._row_steps:
            self._row_steps[num_rows] = DecodeStep(self, self.decode_step.is_prefetching, num_rows,
                                                   self.decode_step.is_reading_in_place)
        return self._row_steps[num_rows]

    def _steps(self) -> list[DecodeStep]:
        return [] if self.decode_step is None else [self.decode_step, *self._row_steps.values()]

    def count_decode_reads(self, stats: StreamStats) -> None:
        """The hits and misses of decode's whole-token steps not yet counted (``DecodeStep.count_reads``)."""
        for step in self._steps():
            step.count_reads(stats)

    def end_request(self) -> None:
        """A request's decode is over: its segments are dropped, unless they are kept (``prepare_decode``)."""
        for step in self._steps():
            step.end_request()
        if self.speculation is not None:
            # the idle engine keeps speculation's segments only beside decode's (a request may have dropped those)
            self.speculation.is_kept = self.speculation.is_kept and self.decode_step.is_kept
            self.speculation.end_request()

    def prepare_decode(self, head: tuple | None, max_rows: int = 1) -> None:
        """Capture decode's segments now and keep them across requests (``DecodeStep.prepare``):
        the one-token step's, and the steps of 2..``max_rows`` tokens (speculation's verify); with a
        head (greedy decode on the device), speculation's drafts where the MTP block and its arena are
        resident (``DeviceSpeculation.prepare``)."""
        if self.decode_step is None:
            return
        self.decode_step.prepare(head)
        for num_rows in range(2, max_rows + 1):
            self.step_of(num_rows).prepare(None)
        speculation = self.speculation
        if head is not None and speculation is not None and speculation.mtp.is_resident \
                and speculation.arena.is_resident:
            speculation.prepare(head)

    def reset_decode(self) -> None:
        """Drop decode's segments and buffers, kept or not."""
        for step in self._steps():
            step.reset()
        if self.speculation is not None:
            self.speculation.reset()

    def _ring(self, workspace: PromptWorkspace | None) -> StagingRing | None:
        if workspace is None or workspace.geometry is None or not workspace.geometry.ring_slots or not self.spec.is_moe:
            return None
        return StagingRing(self.ops, self.cache.storage, self.pack, workspace.first_ring_slot,
                           workspace.geometry.ring_slots)

    def _plan_every_layer(self, ring: StagingRing, stats: StreamStats) -> list[_LayerPlan]:
        """Every layer's cached experts and ring batches of its other experts; the slot tables go to
        the backend in one upload and the ring starts copying."""
        num_experts, cache = self.spec.num_experts, self.cache
        rows, plans = [], []  # rows: [N] host slot tables
        for layer in range(self.spec.num_layers):
            slot_of = np.array([cache.lookup(layer, e) for e in range(num_experts)], dtype=np.int32)  # [N]
            uncached = [int(e) for e in np.flatnonzero(slot_of < 0)]
            stats.hits += num_experts - len(uncached)
            stats.misses += len(uncached)
            stats.streamed_bytes += len(uncached) * cache.layout.slot_bytes
            cached_row = None
            if len(uncached) < num_experts:
                cached_row = len(rows)
                rows.append(slot_of)
            batches = ring.plan(layer, uncached, num_experts)
            for batch in batches:
                rows.append(batch.table)
            plans.append(_LayerPlan(cached_row, batches))
        tables = self.ops.slot_tables(np.stack(rows)) if rows else None  # [M, N]
        row = 0
        for plan in plans:
            if plan.cached_table is not None:
                plan.cached_table, row = tables[row], row + 1
            for batch in plan.batches:
                batch.table, row = tables[row], row + 1
            ring.enqueue(plan.batches)
        return plans

    def attention_block(self, layer: int, x, positions, start: int, split_scratch=None, kv=None,
                        tensor=None) -> None:
        """x += the attention of ``x``'s tokens at ``positions`` (KV written at ``start``..);
        ``split_scratch``: a decode token's attention scratch (``ops.decode_attention_scratch``).
        Another block (the MTP block) passes its own one-layer ``kv`` and ``tensor(name)`` lookup."""
        ops = self.ops
        tensor = tensor or (lambda name: self.tensor(layer, name))
        q = self.write_kv(layer, x, positions, start, kv, tensor)
        kv, kv_layer = (self.kv, layer) if kv is None else (kv, 0)
        out = ops.attention(q, kv, kv_layer, start, positions, split_scratch)  # [T, Hq * E]
        ops.matmul_add(x, out, tensor("attn_output"))

    def write_kv(self, layer: int, x, positions, start: int, kv=None, tensor=None):
        """The first half of ``attention_block``: the queries [T, Hq, E] of ``x``'s tokens at ``positions``, their
        keys and values normed, rotated and written into the cache at ``start``.. (the same arguments)."""
        spec, ops = self.spec, self.ops
        tensor = tensor or (lambda name: self.tensor(layer, name))
        kv, kv_layer = (self.kv, layer) if kv is None else (kv, 0)
        num_tokens = len(positions)
        q, k, v = ops.project_qkv(x, tensor("attn_norm"), spec.rms_norm_eps, tensor("attn_q"), tensor("attn_k"),
                                  tensor("attn_v"))
        q = q.reshape(num_tokens, spec.num_heads, spec.head_dim)
        k = k.reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
        ops.qk_norm_rope_kv_write(q, k, v, tensor("attn_q_norm"), tensor("attn_k_norm"), positions,
                                  spec.num_rope_dims, spec.rope_theta, spec.is_rope_neox, spec.rms_norm_eps, kv,
                                  kv_layer, start, self.w.rope_freqs_host)
        return q

    def _ffn(self, layer: int, h):
        return self.ops.ffn(h, self.matrix(layer, "ffn_gate"), self.matrix(layer, "ffn_up"),
                            self.matrix(layer, "ffn_down"))

    def _moe(self, layer: int, x, h, ring: StagingRing | None, plan: _LayerPlan | None, stats: StreamStats,
             waits: list | None = None, previous_groups=None):
        """The layer's MoE output and its groups (None where it grouped none). waits: where the ring marks its
        waits for copies (``PrefillTimeline``); previous_groups: the previous layer's (``Ops.moe_groups``)."""
        spec, ops, cache = self.spec, self.ops, self.cache
        ids, weights = ops.route(h, self.matrix(layer, "ffn_gate_inp"), spec.num_experts_used,
                                 spec.is_expert_weights_normalized)  # [T, k] on the backend
        acc = ops.moe_accumulator(x, is_batched=ring is not None)  # [T, D]: zeroed, x itself, or a backend's sums
        layout = cache.layout.at_layer(layer)  # the types of this layer's experts
        groups = None
        if plan is not None:  # every uncached expert streams; the routing stays on the backend
            groups = ops.moe_groups(ids, weights, spec.num_experts, layout, previous_groups)  # once for the batches
            if plan.cached_table is not None:
                ops.moe(acc, h, ids, weights, cache.storage, plan.cached_table, layout, groups)
            for batch in ring.take(layer, waits):
                ops.moe(acc, h, ids, weights, cache.storage, batch.table, layout, groups)
        else:
            self._routed_experts(layer, h, ids, weights, acc, ring, stats, waits)
        if spec.shared_expert_ffn_size:
            shared = ops.ffn(h, self.matrix(layer, "ffn_gate_shexp"), self.matrix(layer, "ffn_up_shexp"),
                             self.matrix(layer, "ffn_down_shexp"))
            ops.shared_expert_add(acc, shared, h, self.w.vectors.get(f"blk.{layer}.ffn_gate_inp_shexp"))
        return acc, groups

    def _routed_experts(self, layer: int, h, ids, weights, acc, ring: StagingRing | None, stats: StreamStats,
                        waits: list | None = None):
        """The routed experts, found on the host: cached ones in place, misses through the ring
        (prefill) or into the cache (decode)."""
        ops, cache, num_experts = self.ops, self.cache, self.spec.num_experts
        layout = cache.layout.at_layer(layer)
        host_ids = ops.to_host(ids)  # [T, k]: the host picks the experts to stage
        if ring is None:
            ops.moe(acc, h, host_ids, weights, cache.storage, self.decode_slots(layer, host_ids, stats), layout)
            return
        slot_of, misses, hit_slots = self._lookup(layer, host_ids, stats)
        if hit_slots:
            ops.moe(acc, h, ids, weights, cache.storage, slot_of, layout)  # cached experts in place
        ring.enqueue(ring.plan(layer, misses, num_experts))
        for batch in ring.take(layer, waits):
            ops.moe(acc, h, ids, weights, cache.storage, batch.table, layout)

    def _lookup(self, layer: int, host_ids: np.ndarray,
                stats: StreamStats) -> tuple[np.ndarray, list[int], list[int]]:
        """[N] slots of the routed experts found in the cache (-1 elsewhere), the routed misses, and
        the slots of the hits."""
        cache = self.cache
        slot_of = np.full(self.spec.num_experts, -1, dtype=np.int32)  # [N]
        misses, hit_slots = [], []
        for expert in _distinct(host_ids):
            slot = cache.lookup(layer, expert)
            if slot < 0:
                misses.append(expert)
            else:
                slot_of[expert] = slot
                hit_slots.append(slot)
        stats.hits += len(hit_slots)
        stats.misses += len(misses)
        stats.streamed_bytes += len(misses) * cache.layout.slot_bytes
        return slot_of, misses, hit_slots

    def decode_slots(self, layer: int, host_ids: np.ndarray, stats: StreamStats,
                     is_after_compute: bool = True) -> np.ndarray:
        """[N] slots of the routed experts of a decode token: misses are inserted into the cache
        (evicting by its policy) and staged, and the kernels issued next read them.
        is_after_compute: as ``Ops.stage_experts`` takes it."""
        slot_of, misses, hit_slots = self._lookup(layer, host_ids, stats)
        slots, ticket = self._stage_into_cache(layer, misses, set(hit_slots), is_after_compute)
        if len(slots) < len(misses):
            self.cache.forget(slots)
            raise EngineError(f"no expert-cache slot is free for a decode miss (layer {layer}); raise "
                              "runtime.vram_budget so the cache holds at least one token's experts")
        slot_of[misses] = slots
        self.ops.wait_staged(ticket)
        return slot_of

    def prefetch(self, layer: int, host_ids: np.ndarray, in_use: set[int], stats: StreamStats,
                 is_after_compute: bool = True) -> tuple:
        """Insert and stage the experts ``host_ids`` of ``layer`` that are not cached, evicting by
        the cache's policy outside ``in_use``; returns the copies' ticket (None: nothing staged)
        and the experts staged. is_after_compute: as ``Ops.stage_experts`` takes it."""
        uncached = [e for e in _distinct(host_ids) if self.cache.lookup(layer, e) < 0]
        slots, ticket = self._stage_into_cache(layer, uncached, in_use, is_after_compute)
        stats.prefetched += len(slots)
        stats.streamed_bytes += len(slots) * self.cache.layout.slot_bytes
        return ticket, uncached[:len(slots)]

    def _stage_into_cache(self, layer: int, experts: list[int], protected: set[int],
                          is_after_compute: bool = True) -> tuple[list[int], object]:
        """Insert ``experts`` of ``layer`` into the cache (evicting outside ``protected``) as long as
        slots can be had, and stage them; returns their slots and the copies' ticket (None: none).
        On an error nothing inserted stays: a later request must not compute with unfilled slots."""
        cache, protected, slots = self.cache, set(protected), []
        try:
            for expert in experts:
                slot = cache.insert(layer, expert, protected)
                if slot < 0:
                    break
                protected.add(slot)
                slots.append(slot)
            if not slots:
                return slots, None
            hosts = [self.pack.slot(layer, e) for e in experts[:len(slots)]]
            return slots, self.ops.stage_experts(cache.storage, slots, hosts, is_after_compute)
        except BaseException:
            cache.forget(slots)
            raise

    def tensor(self, layer: int, name: str):
        """A main layer's matrix or vector by its short name (``attn_q``, ``attn_q_norm``); None when absent."""
        key = f"blk.{layer}.{name}"
        found = self.w.matrices.get(key)
        return found if found is not None else self.w.vectors.get(key)

    def matrix(self, layer: int, name: str) -> QTensor:
        return self.w.matrices[f"blk.{layer}.{name}"]

    def vector(self, layer: int, name: str):
        return self.w.vectors[f"blk.{layer}.{name}"]


def _distinct(ids: np.ndarray) -> list[int]:
    """The distinct expert ids of ``ids``; a decode token's few without numpy's sort (48 times a token)."""
    if ids.size <= 64:
        return list(dict.fromkeys(ids.ravel().tolist()))
    return np.unique(ids).tolist()
