"""``strata experiment default-off``: installed and off, the loan plugins change nothing.

Two arms on the same prompt, fresh processes, interleaved:

- ``uninstalled``: the configuration without its ``[loan]`` table, with the four loan plugins
  uninstalled: the build the feature was added to. By default this process leaves their
  distributions out of ``importlib.metadata`` and refuses to import their modules
  (``strata.bench.experiments.uninstalled`` says how); ``--uninstalled-python`` runs the arm with
  the interpreter of an environment where they are not installed at all.
- ``installed``: the same file on this install, every plugin installed.

Each run reports the plugins it could discover, so the table shows what each arm had. Bar: PP and
TG medians of ``installed`` within ±1% of ``uninstalled``'s, and the same plan.
"""

from __future__ import annotations

import argparse

from strata.bench.experiments import two_arms
from strata.bench.experiments.runs import Arm, change, percent, run_interleaved
from strata.bench.harness import ONE_RUN

NAME = "default-off"
HELP = "no [loan] table against the loan plugins uninstalled: PP and TG within ±1%, the same plan"
DEFAULTS = {"prompt_tokens": "31258", "gen_tokens": 256, "reps": 3}
BAR = 0.01
HIDING_LAUNCHER = ("-m", "strata.bench.experiments.uninstalled", "strata.bench.one_run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uninstalled-python", metavar="PYTHON",
                        help="run the uninstalled arm with this interpreter, of an environment where Strata is "
                             "installed without the loan plugins (default: this one, with the plugins hidden)")


def run(args: argparse.Namespace, setup, lengths: list[int]) -> None:
    config = setup.arm_file("no-loan-table", without=("loan",))
    if args.uninstalled_python:
        uninstalled = Arm("uninstalled", "Loan plugins uninstalled", config, python=args.uninstalled_python,
                          launcher=ONE_RUN)
    else:
        uninstalled = Arm("uninstalled", "Loan plugins uninstalled", config, launcher=HIDING_LAUNCHER)
    arms = [uninstalled, Arm("installed", "Loan plugins installed, no [loan] table", config)]
    setup.results.doc["arms"] = [arm.describe() for arm in arms]
    run_interleaved(arms, lengths, args.reps, args.gen_tokens, args.timeout, setup.results.record)


def summarize(doc: dict) -> dict:
    rows = {row["arm"]: row for row in two_arms.arm_rows(doc)}
    base, installed = rows["uninstalled"], rows["installed"]
    pp = change(installed["pp"]["median"], base["pp"]["median"])
    tg = change(installed["tg"]["median"], base["tg"]["median"])
    is_same_plan = installed["plans"] == base["plans"]
    # an uninstalled arm that found plugins did not measure what it names
    is_uninstalled = all(not run.get("plugins") for run in base["runs"])
    passed = abs(pp) <= BAR and abs(tg) <= BAR and is_same_plan and is_uninstalled
    verdict = (f"Installed, no [loan] table, against uninstalled: PP {percent(pp)}, TG {percent(tg)} (bar: within "
               f"±{BAR:.0%}); the plan {'is the same' if is_same_plan else 'differs'}"
               + ("" if is_uninstalled else "; the uninstalled arm found loan plugins installed")
               + f". {'Within the bar' if passed else 'Not within the bar'}.")
    return {"pp_change": pp, "tg_change": tg, "is_same_plan": is_same_plan, "is_uninstalled": is_uninstalled,
            "passed": passed, "verdict": verdict}


def table(doc: dict) -> str:
    return two_arms.table(doc, [("Loan plugins found", _plugins)])


def plot(doc: dict, plt):
    return two_arms.plot(doc, plt)


def _plugins(runs: list[dict]) -> str:
    found = sorted({", ".join(run.get("plugins", [])) or "none" for run in runs})
    return "; ".join(found) or "-"
