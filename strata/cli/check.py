"""``strata --config FILE check``: admission, placement by owner, and the plan with and without the loan.

A dry run: the ledger is charged exactly as a load would charge it, but nothing is uploaded or
packed, so it answers in seconds even for a model far larger than the machine's GPU.

Each placement table is the budget during a prefill of one plan: the owners, the plan's prefill
workspace (activations and attention scratch from free memory, the staging ring in slots the
expert cache lends), and what stays free; its rows add up to the budget.
"""

from __future__ import annotations

import argparse
from typing import Mapping

from strata.backend.select import select_backend
from strata.config import Config
from strata.engine.loading import cache_after_load
from strata.engine.planning.placement import Placement
from strata.engine.planning.planner import CacheState, WorkspaceCosts
from strata.hooktypes import Geometry, LoanRequest

EXPERT_CACHE_OWNER = "expert_cache"
WORKSPACE_ROW = "prefill_workspace"
_ROW = "  {:<38}{:>16}{:>11}{:>9}{}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, config: Config) -> int:
    from strata.engine.facade import Engine

    engine = Engine.load(config, show_progress=False, is_dry_run=True)
    spec = engine.spec
    print(f"model: {engine.model.path.name} ({spec.arch}, {spec.num_layers} layers, "
          f"{spec.num_experts} experts of which {spec.num_experts_used} per token)")
    print(f"backend: {select_backend(config)}")
    print(format_context(config, engine.placement))
    deferred = [n for n, r in engine.resources.items() if not r.is_resident]
    if config.loan.enabled:
        print(f"loan: admitted with plugins {', '.join(engine.plugins.names) or '(none)'}; "
              f"startup loan defers {', '.join(deferred) or 'nothing'}")
    else:
        print("loan: off (loan.enabled is false)")
    costs, budget_bytes, planner = engine.planner.costs, engine.ledger.budget_bytes, engine.planner
    if planner.rates is not None:
        print(f"rates: {planner.rates.describe()}")
    longest_prompt_tokens = engine.context_tokens - 1
    cache = CacheState(engine.cache.num_slots, cached_after_load(engine, config)) if engine.cache else None
    idle_budget = engine.loan.preview_budget(is_loan=False)
    without, weighed = planner.weigh(idle_budget, longest_prompt_tokens, cache)
    with_loan, startup_budget = engine.loan.startup_geometry, engine.loan.budget()
    if config.loan.enabled:
        print(f"placement after startup (deferred resources not resident) with the workspace of the plan with "
              f"the loan ({with_loan}):")
        owners = {**engine.ledger.snapshot().by_owner, **{name: 0 for name in deferred}}
        print(format_placement(owners, budget_bytes, costs, with_loan))
    aliased = engine.loan.aliased_names()
    print(f"idle placement (every resource resident{', the output head lent to prefill' if aliased else ''}) "
          f"with the workspace of the plan without the loan ({without}):")
    print(format_placement({**engine.idle_ledger.by_owner, **{name: 0 for name in aliased}}, budget_bytes, costs,
                           without, zero_note="lent to the prompt workspace (runtime.prefill_head_alias)" if aliased
                           else "deferred by the startup loan"))
    print(f"plan without the loan for the longest prompt, {longest_prompt_tokens:,} tokens (chunk / ring): {without}")
    print("  planner: " + planner.explain(idle_budget, without, longest_prompt_tokens, cache))
    print("  cost model: " + planner.describe_candidates(weighed, without))
    if config.loan.enabled:
        print(f"plan with the loan (chunk / ring): {with_loan}")
        print("  planner: " + planner.explain(startup_budget, with_loan, cache=cache,
                                              predicted_tokens=longest_prompt_tokens))
        # the startup loan's plan: the startup budget, the longest prompt, the cache after the load
        print("  cost model: " + planner.describe_candidates(planner.weigh(startup_budget, None, cache)[1], with_loan))
        print(loan_gains(engine, longest_prompt_tokens, cache))
    return 0


def loan_gains(engine, longest_prompt_tokens: int, cache: CacheState | None) -> str:
    """The prefill time a repeat loan is predicted to save at a few prompt lengths (the cost_gate
    plugin takes the loan where it saves time)."""
    lengths = sorted({n for n in (2048, 8192, 32768) if n < longest_prompt_tokens} | {longest_prompt_tokens})
    gains = []
    for num_tokens in lengths:
        prediction = engine.loan.predict(LoanRequest(1, num_tokens, num_tokens, is_startup_loan=False), cache)
        if prediction is None:
            return ("loan's predicted gain: none (no cost model: a dense model or a fixed geometry; or no plan "
                    "fits even with the loan)")
        if prediction.off_geometry is None:
            gains.append(f"{num_tokens:,} tokens: only the loan fits a plan ({prediction.on_geometry})")
            continue
        gains.append(f"{num_tokens:,} tokens {1e3 * prediction.gain_seconds:+,.0f} ms "
                     f"({prediction.on_geometry} against {prediction.off_geometry})")
    reload = engine.loan.overhead_seconds()
    return (f"loan's predicted gain for a repeat loan (cost model; its own work {1e3 * reload:.0f} ms and the upload "
            f"of what it releases counted): " + "; ".join(gains))


def cached_after_load(engine, config: Config) -> int:
    """Experts cached once a real load is done: the dry run loads no pack, and the preload would
    fill every slot of the cache (``runtime.expert_preload``), up to the model's experts."""
    cache = cache_after_load(config, engine.cache, engine.spec)
    return cache.num_cached if cache else 0


def format_context(config: Config, placement: Placement) -> str:
    """The context's KV cells by tier: resident in VRAM, and past ``runtime.kv_resident_cells`` in
    pinned host memory, read through the staging layers (``kv_staging``) where the backend has them."""
    context = placement.context_cells
    line = (f"context: {context:,} tokens (runtime.context_tokens) in {placement.kv_cells:,} resident KV cells "
            f"({config.runtime.kv_type})")
    if placement.kv_cells == context:
        return line
    staging = f", read through the {placement.kv_staging_bytes / 2**20:.1f} MiB of kv_staging layers" \
        if placement.kv_staging_bytes else ", read where they lie"
    return (f"{line}\n"
            f"  KV tiers: VRAM {placement.kv_cells:,} cells ({placement.kv_bytes / 2**20:.1f} MiB, kv_cache), "
            f"host {context - placement.kv_cells:,} cells ({placement.host_kv_bytes / 2**20:.1f} MiB of pinned "
            f"host memory, outside the budget){staging}")


def format_placement(owners: Mapping[str, int], budget_bytes: int, costs: WorkspaceCosts, geometry: Geometry | None,
                     zero_note: str = "deferred by the startup loan") -> str:
    """Owners, the prefill workspace of ``geometry`` and free memory in bytes, MiB and share of
    the budget; the indented rows are the parts of the workspace. ``zero_note``: why an owner
    holds nothing."""
    owners = dict(sorted(owners.items()))
    rows = [_ROW.format("owner", "bytes", "MiB", "share", "")]
    lent_bytes, from_free_bytes = _workspace_sources(costs, geometry, budget_bytes - sum(owners.values()),
                                                     EXPERT_CACHE_OWNER in owners)
    if lent_bytes:
        owners[EXPERT_CACHE_OWNER] -= lent_bytes
    for owner, num_bytes in owners.items():
        note = f"  ({lent_bytes:,} bytes lent to {WORKSPACE_ROW})" if owner == EXPERT_CACHE_OWNER and lent_bytes \
            else f"  ({zero_note})" if not num_bytes else ""
        rows.append(_row(owner, num_bytes, budget_bytes, note))
    if geometry is not None:
        rows.extend(_workspace_rows(costs, geometry, lent_bytes, from_free_bytes, budget_bytes))
    free_bytes = budget_bytes - sum(owners.values()) - lent_bytes - from_free_bytes
    rows.append(_row("free", free_bytes, budget_bytes))
    rows.append(_row("budget", budget_bytes, budget_bytes))
    return "\n".join(rows)


def _workspace_sources(costs: WorkspaceCosts, geometry: Geometry | None, free_bytes: int,
                       has_cache: bool) -> tuple[int, int]:
    """(bytes of cache slots lent to the workspace, bytes it takes from free memory)."""
    if geometry is None:
        return 0, 0
    borrowed = costs.borrowed_bytes(geometry, free_bytes) if has_cache else 0
    slot_bytes = max(1, costs.bytes_per_ring_slot)
    lent = -(-borrowed // slot_bytes) * slot_bytes  # the cache lends whole slots
    return lent, costs.workspace_bytes(geometry) - borrowed


def _workspace_rows(costs: WorkspaceCosts, geometry: Geometry, lent_bytes: int, from_free_bytes: int,
                    budget_bytes: int) -> list[str]:
    activation_bytes = costs.workspace_bytes(Geometry(geometry.chunk_tokens, 0))
    ring_bytes = geometry.ring_slots * costs.bytes_per_ring_slot
    note = f"  ({lent_bytes:,} lent by {EXPERT_CACHE_OWNER}, {from_free_bytes:,} from free memory)"
    rows = [_row(WORKSPACE_ROW, lent_bytes + from_free_bytes, budget_bytes, note),
            _row(f"  chunk {geometry.chunk_tokens:,}: activations, scratch", activation_bytes, budget_bytes),
            _row(f"  ring {geometry.ring_slots:,} slots", ring_bytes, budget_bytes)]
    rounding_bytes = lent_bytes + from_free_bytes - activation_bytes - ring_bytes
    if rounding_bytes:
        rows.append(_row("  rounded up to whole cache slots", rounding_bytes, budget_bytes))
    return rows


def _row(label: str, num_bytes: int, budget_bytes: int, note: str = "") -> str:
    return _ROW.format(label, f"{num_bytes:,}", f"{num_bytes / 2**20:.1f}", f"{num_bytes / budget_bytes:.2%}", note)
