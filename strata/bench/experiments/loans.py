"""``strata experiment loans``: the write-up's benchmark, loan flags off against on in one install.

The configuration as given (the write-up's is configs/serve.toml: 65,536-token context, Q4_0 KV
with 24,576 resident cells, MTP depth 4, the elastic cache on 64 MiB segments, every loan plugin),
a 31,258-token fresh prompt, 256 generated tokens, 3 fresh processes an arm, interleaved. The off
arm is the same file with ``loan.enabled = false``. Reports each arm's plan, PP and TG medians with
ranges, and the PP and TG change the loan makes; every loan-on run must have taken the loan.
"""

from __future__ import annotations

import argparse

from strata.bench.experiments import two_arms
from strata.bench.experiments.runs import Arm, change, is_loan_taken, percent, run_interleaved
from strata.errors import ExperimentError

NAME = "loans"
HELP = "the write-up's benchmark: loan flags off against on, plan, PP and TG medians with ranges"
DEFAULTS = {"prompt_tokens": "31258", "gen_tokens": 256, "reps": 3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, setup, lengths: list[int]) -> None:
    require_loan(setup)
    config = setup.arm_file("as-given")
    arms = [Arm("off", "Loan flags off", config, loan="off"), Arm("on", "Loan flags on", config, loan="on")]
    setup.results.doc["arms"] = [arm.describe() for arm in arms]
    run_interleaved(arms, lengths, args.reps, args.gen_tokens, args.timeout, setup.results.record)


def require_loan(setup) -> None:
    if not setup.config.loan.enabled:
        raise ExperimentError(f"{setup.config_path} has loan.enabled = false: the loan-on arm needs a [loan] table "
                              "with enabled = true and its plugins (configs/serve.toml has the write-up's)")


def summarize(doc: dict) -> dict:
    rows = {row["arm"]: row for row in two_arms.arm_rows(doc)}
    off, on = rows["off"], rows["on"]
    pp = change(on["pp"]["median"], off["pp"]["median"])
    tg = change(on["tg"]["median"], off["tg"]["median"])
    num_taken = sum(is_loan_taken(run) for run in on["runs"])
    passed = num_taken == len(on["runs"]) and not any(is_loan_taken(run) for run in off["runs"])
    off_plan, on_plan = ", ".join(off["plans"]) or "-", ", ".join(on["plans"]) or "-"
    plan = f"changed the plan from {off_plan} to {on_plan}" if off_plan != on_plan else f"kept the plan {off_plan}"
    verdict = (f"The loan {plan}: PP {percent(pp)}, TG {percent(tg)}; it was taken in {num_taken} of "
               f"{len(on['runs'])} loan-on runs.")
    return {"pp_change": pp, "tg_change": tg, "loans_taken": num_taken, "passed": passed, "verdict": verdict}


def table(doc: dict) -> str:
    return two_arms.table(doc)


def plot(doc: dict, plt):
    return two_arms.plot(doc, plt)
