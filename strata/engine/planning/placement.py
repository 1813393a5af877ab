"""Placement under the VRAM budget: what each owner holds, in bytes, before anything is allocated.

Owners: ``dense_weights`` (embeddings, attention, norms, routers, shared experts), ``output_head``
(the native head; absent when tied to the embeddings), ``kv_cache`` (the resident cells:
``runtime.kv_resident_cells`` of every main layer), ``kv_staging`` (with a host tier for the other
cells, on a GPU: two layers of every cell that attention reads them through, alternating by layer),
the decode-only ``verifier`` / ``mtp_draft_head`` / ``mtp_experts`` (with MTP),
and the elastic ``expert_cache``, which takes what is left after a reserve for the smallest prefill
geometry (the cache maps no more than every expert and the largest staging ring:
``ExpertCache(max_slots=...)``).
Routed experts of the main layers always live in the host expert pack; the cache holds copies.
"""

from __future__ import annotations

import dataclasses

from strata.backend.ops import KV_STAGING_LAYERS, ExpertLayout
from strata.config import Config
from strata.engine.memory.verifier_arena import VerifierLayout
from strata.engine.planning.planner import WorkspaceCosts
from strata.errors import ConfigError
from strata.model.gguf_file import GgufModel, layer_of
from strata.model.spec import ModelSpec

_KV_BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclasses.dataclass(frozen=True)
class Placement:
    budget_bytes: int
    dense_bytes: int
    output_head_bytes: int  # 0: tied to token_embd, no separate head
    kv_bytes: int
    kv_cells: int  # resident: the first kv_cells of the context's cells, in VRAM
    context_cells: int  # every cell attention may read; those past kv_cells are the host tier
    host_kv_bytes: int  # the host tier, in pinned host memory (not in the budget)
    kv_staging_bytes: int
    verifier_bytes: int
    mtp_head_bytes: int
    mtp_expert_bytes: int
    mtp_kv_bytes: int
    cache_base_bytes: int
    cache_reserved_bytes: int
    costs: WorkspaceCosts


def plan_placement(config: Config, model: GgufModel, layout: ExpertLayout | None, budget_bytes: int,
                   kv_scratch_bytes_per_cell: int = 0, is_kv_staged: bool = False,
                   mtp_layout: ExpertLayout | None = None, weight_scratch_bytes: int = 0) -> Placement:
    """is_kv_staged: the backend reads a host tier through a staging layer in VRAM (``Ops.kv_cache``);
    mtp_layout: the slots of the MTP experts' own arena; weight_scratch_bytes: what prefill's dense products
    stage besides the weights (``Ops.prefill_weight_scratch_bytes``)."""
    spec, rt = model.spec, config.runtime
    mtp_layers = range(spec.num_layers, spec.num_layers + spec.num_nextn_layers) if rt.mtp else range(0)
    dense = mtp_head = mtp_experts = 0
    for name, ref in model.tensors.items():
        layer = layer_of(name)
        if name == "output.weight" or (layer is not None and layer >= spec.num_layers and layer not in mtp_layers):
            continue
        if layer in mtp_layers:
            if any(t in name for t in _EXPERT_TENSORS):
                mtp_experts += ref.nbytes
            else:
                mtp_head += ref.nbytes
        elif not any(t in name for t in _EXPERT_TENSORS):
            dense += ref.nbytes
    if mtp_experts and mtp_layout is not None:  # the MTP experts' own arena holds them in slots of their own
        mtp_experts = spec.num_experts * mtp_layout.slot_bytes
    head = model.tensors["output.weight"].nbytes if "output.weight" in model.tensors else 0
    context_cells = rt.context_tokens
    kv_cells = rt.kv_resident_cells or context_cells
    layer_cell_bytes = 2 * spec.kv_size * _KV_BYTES_PER_VALUE[rt.kv_type]  # K and V of one cell of one layer
    kv_bytes = int(kv_cells * layer_cell_bytes * spec.num_layers)
    host_kv_bytes = int((context_cells - kv_cells) * layer_cell_bytes * spec.num_layers)
    is_tiered = is_kv_staged and kv_cells < context_cells
    kv_staging = int(KV_STAGING_LAYERS * context_cells * layer_cell_bytes) if is_tiered else 0
    # the draft's own cache: one layer, every cell, resident (it attends over the prompt as the main layers do)
    mtp_kv = int(context_cells * layer_cell_bytes) if mtp_layers else 0
    verifier = (VerifierLayout(spec.hidden_size, spec.vocab_size, 1 + rt.spec_depth).num_bytes
                if rt.mtp and rt.spec_depth else 0)
    # e.g. a quantized cache layer's F16 copy, which prefill attention reads on the GPU, and the float16 copy
    # of a dense matrix that prefill's GEMM stages
    costs = workspace_costs(spec, layout, config, kv_scratch_bytes_per_cell * context_cells + weight_scratch_bytes)
    fixed = dense + head + kv_bytes + kv_staging + verifier + mtp_head + mtp_experts + mtp_kv
    min_ring = config.planner.min_ring_slots if layout else 0
    smallest = costs.workspace_bytes_for(config.planner.chunk_quantum_tokens, min_ring)
    cache_base = budget_bytes - fixed - smallest
    if cache_base < 0 or (layout and cache_base < rt.vmm_segment_bytes):
        raise ConfigError(
            f"runtime.vram_budget = {budget_bytes / 2**30:.2f} GiB cannot hold this model: dense weights "
            f"{dense / 2**20:.0f} MiB, output head {head / 2**20:.0f} MiB, KV cache {kv_bytes / 2**20:.0f} MiB "
            f"({kv_cells} cells of {rt.kv_type}{_staging_note(kv_staging)}), "
            f"MTP {(mtp_head + mtp_experts + mtp_kv) / 2**20:.0f} MiB, smallest prefill "
            f"workspace {smallest / 2**20:.0f} MiB"
            f"{f', one {rt.vmm_segment_bytes >> 20} MiB cache segment' if layout else ''}; raise "
            "runtime.vram_budget, lower runtime.kv_resident_cells or use a smaller runtime.kv_type"
        )
    cache_base = cache_base // rt.vmm_segment_bytes * rt.vmm_segment_bytes if layout else 0
    reserved = budget_bytes if layout else 0  # address space only: room to grow into all a loan frees
    return Placement(budget_bytes=budget_bytes, dense_bytes=dense, output_head_bytes=head, kv_bytes=kv_bytes,
                     kv_cells=kv_cells, context_cells=context_cells, host_kv_bytes=host_kv_bytes,
                     kv_staging_bytes=kv_staging, verifier_bytes=verifier,
                     mtp_head_bytes=mtp_head, mtp_expert_bytes=mtp_experts, mtp_kv_bytes=mtp_kv,
                     cache_base_bytes=cache_base, cache_reserved_bytes=reserved, costs=costs)


def workspace_costs(spec: ModelSpec, layout: ExpertLayout | None, config: Config,
                    attention_scratch_bytes: int = 0) -> WorkspaceCosts:
    slot = layout.slot_bytes if layout else 0
    is_fixed_sums = config.runtime.deterministic and config.runtime.backend != "numpy"  # numpy sums in float64
    return WorkspaceCosts(bytes_per_chunk_token=_bytes_per_token(spec, is_fixed_sums),
                          bytes_per_ring_slot=slot,
                          fixed_bytes=attention_scratch_bytes, target_ring_slots=spec.num_experts if layout else 0,
                          is_ring_in_cache=layout is not None,
                          segment_bytes=config.runtime.vmm_segment_bytes)


def _bytes_per_token(spec: ModelSpec, is_fixed_sums: bool = False) -> int:
    """Activations of one prompt token through one layer at a time, float32.

    x and the normed h [D]; q, k, v and the attention output; the MoE accumulator [D] (int64 fixed-point
    sums, two words an element, with ``is_fixed_sums``); router logits [N]; routing ids and weights
    [k]; the k experts' gate and up products [k, F] (or the dense FFN's [F]); plus the output of the shared
    expert.
    """
    ffn = spec.num_experts_used * spec.expert_ffn_size * 2 if spec.is_moe else spec.dense_ffn_size * 2
    accumulator = spec.hidden_size * (2 if is_fixed_sums and spec.is_moe else 1)
    values = (2 * spec.hidden_size + accumulator + 2 * spec.q_size + 2 * spec.kv_size + spec.num_experts
              + 2 * spec.num_experts_used + ffn + 2 * spec.shared_expert_ffn_size)
    return 4 * values


def _staging_note(kv_staging_bytes: int) -> str:
    return f", and {kv_staging_bytes / 2**20:.0f} MiB of staging layers for the host tier" if kv_staging_bytes else ""
