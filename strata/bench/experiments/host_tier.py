"""``strata experiment host-tier``: KV cells past the resident ones in pinned host memory change nothing in the
output: the same greedy tokens as with every cell resident.

Two arms on the configuration as given, both with ``runtime.deterministic = true`` (prefill's routed-expert sums
in fixed point: otherwise two runs of one arm may already differ in a near tie, docs/EXPERIMENTS.md): the
configuration's ``kv_resident_cells`` (the host tier holds the rest of the context) and every cell resident
(``kv_resident_cells`` = the context). Each repetition gives both arms one seeded prompt. Bar: both arms ran one
plan (the resident cells take VRAM the planner might give a chunk: set ``planner.chunk_tokens`` and
``ring_slots`` where they differ), every repetition's tokens equal, token for token, and the tiered runs moved KV
bytes over PCIe and the resident ones none.
"""

from __future__ import annotations

import argparse

from strata.bench.experiments import two_arms
from strata.bench.experiments.runs import Arm, plans, run_interleaved, select
from strata.errors import ExperimentError

NAME = "host-tier"
HELP = "the host KV tier against every cell resident: the same greedy tokens (runtime.deterministic), PP and TG"
DEFAULTS = {"prompt_tokens": "31258", "gen_tokens": 64, "reps": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, setup, lengths: list[int]) -> None:
    runtime = setup.config.runtime
    if not runtime.kv_resident_cells or runtime.kv_resident_cells >= runtime.context_tokens:
        raise ExperimentError(f"{setup.config_path} keeps every KV cell resident (runtime.kv_resident_cells = "
                              f"{runtime.kv_resident_cells}, context_tokens = {runtime.context_tokens}): nothing "
                              "lives in the host tier; set kv_resident_cells below the context (configs/serve.toml "
                              "keeps 24,576 of 65,536)")
    if max(lengths) + args.gen_tokens - 1 <= runtime.kv_resident_cells:  # the last token's cell is not written
        raise ExperimentError(f"--prompt-tokens {max(lengths):,} plus --gen-tokens {args.gen_tokens} fit in the "
                              f"{runtime.kv_resident_cells:,} resident cells: the host tier would hold nothing; "
                              "give a longer prompt")
    loan = "on" if setup.config.loan.enabled else "off"
    deterministic = {"runtime.deterministic": True}
    arms = [Arm("tier", f"{runtime.kv_resident_cells:,} cells resident, the rest in host memory",
                setup.arm_file("host-tier", overrides=deterministic), loan=loan),
            Arm("resident", f"all {runtime.context_tokens:,} cells resident",
                setup.arm_file("all-resident", overrides={**deterministic,
                                                          "runtime.kv_resident_cells": runtime.context_tokens}),
                loan=loan)]
    setup.results.doc["arms"] = [arm.describe() for arm in arms]
    run_interleaved(arms, lengths, args.reps, args.gen_tokens, args.timeout, setup.results.record)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first generated token where a and b differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(doc: dict) -> dict:
    pairs = []
    for tier_run in select(doc["runs"], arm="tier"):
        resident = select(doc["runs"], arm="resident", rep=tier_run["rep"], prompt_tokens=tier_run["prompt_tokens"])
        if resident:
            pairs.append((tier_run, resident[0]))
    differences = [_first_difference(t["output_ids"], r["output_ids"]) for t, r in pairs]
    num_equal = sum(d is None for d in differences)
    is_tier_used = all(t["kv_host_bytes"] > 0 for t, _ in pairs) and not any(r["kv_host_bytes"] for _, r in pairs)
    tier_plans, resident_plans = plans(t for t, _ in pairs), plans(r for _, r in pairs)
    is_same_plan = tier_plans == resident_plans
    passed = bool(pairs) and num_equal == len(pairs) and is_tier_used and is_same_plan
    verdict = (f"The same greedy tokens in {num_equal} of {len(pairs)} prompt(s)"
               + ("" if num_equal == len(pairs) else
                  " (first differences at generated token " + ", ".join(str(d) for d in differences if d is not None)
                  + ")")
               + f"; the host tier moved {_moved([t for t, _ in pairs])} a run"
               + ("" if is_tier_used else ", but an arm did not use the tiers as configured")
               + ("" if is_same_plan else f"; the arms ran different plans ({', '.join(tier_plans)} against "
                  f"{', '.join(resident_plans)}): set planner.chunk_tokens and ring_slots to compare one computation")
               + ".")
    return {"num_prompts": len(pairs), "num_equal": num_equal, "is_tier_used": is_tier_used,
            "is_same_plan": is_same_plan, "passed": passed, "verdict": verdict}


def _moved(runs: list[dict]) -> str:
    return f"{sum(r['kv_host_bytes'] for r in runs) / max(1, len(runs)) / 2**20:,.1f} MiB"


def table(doc: dict) -> str:
    return two_arms.table(doc, [("KV host tier moved", _moved)])


def plot(doc: dict, plt):
    return two_arms.plot(doc, plt)
