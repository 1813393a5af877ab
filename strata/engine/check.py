"""``strata --config FILE check``: admission, placement by owner, and the plan with and without the loan.

A dry run: the ledger is charged exactly as a load would charge it, but nothing is uploaded or
packed, so it answers in seconds even for a model far larger than the machine's GPU.
"""

from __future__ import annotations

import argparse

from strata.config import Config
from strata.engine.ops import select_backend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, config: Config) -> int:
    from strata.engine.facade import Engine

    engine = Engine.load(config, show_progress=False, is_dry_run=True)
    spec = engine.spec
    print(f"model: {engine.model.path.name} ({spec.arch}, {spec.num_layers} layers, "
          f"{spec.num_experts} experts of which {spec.num_experts_used} per token)")
    print(f"backend: {select_backend(config)}")
    if config.loan.enabled:
        deferred = [n for n, r in engine.resources.items() if not r.is_resident]
        print(f"loan: admitted with plugins {', '.join(engine.plugins.names) or '(none)'}; "
              f"startup loan defers {', '.join(deferred) or 'nothing'}")
    else:
        print("loan: off (loan.enabled is false)")
    print("placement after startup (deferred resources not resident):")
    print(engine.ledger.format())
    print("idle placement (every resource resident):")
    for owner, num_bytes in engine.idle_ledger.by_owner.items():
        print(f"  {owner:<24}{num_bytes / 2**20:>12.1f}{num_bytes / engine.ledger.budget_bytes:>9.1%}")
    without = engine.loan.plan_preview(is_loan=False)
    print(f"plan without the loan (chunk / ring): {without}")
    if config.loan.enabled:
        print(f"plan with the loan (chunk / ring): {engine.loan.startup_geometry}")
    cached = engine.cache.num_cached if engine.cache else 0
    print("planner: " + engine.planner.explain(engine.loan.budget(), engine.loan.startup_geometry,
                                               unread_tokens=engine.context_tokens - 1, cached_slots=cached))
    return 0
