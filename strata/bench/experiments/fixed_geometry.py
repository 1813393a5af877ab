"""``strata experiment fixed-geometry``: loan off and on forced to one plan, to tell the
transaction's cost from the planner's gain.

Both arms run the configuration with ``planner.chunk_tokens`` and ``planner.ring_slots`` set, so
that every request of both prefills in the same geometry; the loan then only releases, grows the
cache and restores. The geometry is ``--chunk-tokens`` / ``--ring-slots``, or by default the plan
a loan-off process picks for the prompt (one probe run first, recorded apart from the arms). Bar:
both arms ran that plan and their PP medians differ by no more than the noise, the larger of
either arm's range over its median and 1%: the loan is not a faster kernel.
"""

from __future__ import annotations

import argparse

from strata.bench.experiments import two_arms
from strata.bench.experiments.loans import require_loan
from strata.bench.experiments.runs import Arm, change, figures, percent, run_arm, run_interleaved, spread
from strata.errors import ExperimentError

NAME = "fixed-geometry"
HELP = "loan off and on forced to one plan (planner.chunk_tokens / ring_slots): PP equal within noise"
DEFAULTS = {"prompt_tokens": "31258", "gen_tokens": 256, "reps": 3}
NOISE_FLOOR = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-tokens", type=int, help="the plan's prompt chunk (default: the loan-off plan)")
    parser.add_argument("--ring-slots", type=int, help="the plan's staging ring (default: the loan-off plan)")


def run(args: argparse.Namespace, setup, lengths: list[int]) -> None:
    require_loan(setup)
    doc = setup.results.doc
    if (args.chunk_tokens is None) != (args.ring_slots is None):
        raise ExperimentError("--chunk-tokens and --ring-slots go together (one plan); give both, or neither to "
                              "force the plan a loan-off process picks")
    if args.chunk_tokens is None:
        probe = run_arm(Arm("probe", "Loan off, planner free", setup.arm_file("as-given")), lengths[0],
                        args.gen_tokens, 0, args.timeout)
        doc["probe"] = {**probe, "arm": "probe", "rep": 1}
        chunk_tokens, ring_slots = probe["chunk_tokens"], probe["ring_slots"]
    else:
        chunk_tokens, ring_slots = args.chunk_tokens, args.ring_slots
    doc["geometry"] = {"chunk_tokens": chunk_tokens, "ring_slots": ring_slots,
                       "source": "options" if args.chunk_tokens is not None else "the loan-off plan of a probe run"}
    config = setup.arm_file("fixed-geometry", overrides={"planner.chunk_tokens": chunk_tokens,
                                                         "planner.ring_slots": ring_slots})
    arms = [Arm("off", "Loan flags off", config, loan="off"), Arm("on", "Loan flags on, same plan", config, loan="on")]
    doc["arms"] = [arm.describe() for arm in arms]
    run_interleaved(arms, lengths, args.reps, args.gen_tokens, args.timeout, setup.results.record)


def summarize(doc: dict) -> dict:
    rows = {row["arm"]: row for row in two_arms.arm_rows(doc)}
    off, on = rows["off"], rows["on"]
    geometry = doc["geometry"]
    forced = f"{geometry['chunk_tokens']:,} / {geometry['ring_slots']}"
    is_forced = off["plans"] == on["plans"] == [forced]
    pp = change(on["pp"]["median"], off["pp"]["median"])
    noise = max(spread(off["pp"]), spread(on["pp"]), NOISE_FLOOR)
    passed = is_forced and abs(pp) <= noise
    # the main layers' device time alone: apart from the work the arms may do differently (the MTP block's pass
    # over the prompt, which a loan skips where it holds what the pass reads; the experts restreamed)
    forward = {name: figures(row["runs"], "prefill_forward_seconds") for name, row in rows.items()}
    mtp = {name: figures(row["runs"], "prefill_mtp_seconds") for name, row in rows.items()}
    forward_change = change(forward["on"]["median"], forward["off"]["median"])
    verdict = (f"Both arms forced to {forced} ({geometry['source']}): "
               + ("both ran it" if is_forced else f"they ran {', '.join(off['plans'])} and {', '.join(on['plans'])}")
               + f"; PP {percent(pp)} with the loan, noise {noise:.1%}: "
               + ("within the noise, the loan is not a faster kernel." if passed else "not within the noise.")
               + f" The main layers' prefill on the device: {1e3 * forward['off']['median']:,.1f} ms off, "
               + f"{1e3 * forward['on']['median']:,.1f} ms on ({percent(forward_change)}); the MTP block's pass over "
               + f"the prompt: {1e3 * mtp['off']['median']:,.1f} ms off, {1e3 * mtp['on']['median']:,.1f} ms on.")
    return {"forced_plan": forced, "is_forced": is_forced, "pp_change": pp, "noise": noise, "passed": passed,
            "forward_change": forward_change, "verdict": verdict}


def table(doc: dict) -> str:
    return two_arms.table(doc)


def plot(doc: dict, plt):
    return two_arms.plot(doc, plt)
