"""``strata experiment crossover``: loan off and on across prompt lengths, to find where the loan
stops paying.

At each length (default 2k, 8k, 16k, 32k, 48k, 64k) the arms run in fresh processes, interleaved:
loan off, loan on, and the engine's own choice (``auto``: the configuration's plugins with the
``cost_gate`` plugin in place of ``repeat_loan``, so the cost model decides the loan). A fresh
process serves one request, whose loan is the startup loan, so ``auto`` measures the cost model's
startup decision; a repeat loan's decision shows in ``lifecycle``'s serving process. The table has
PP and TG per length and arm with the PP change against loan off, and the plot draws PP and TG of
each arm and the loan's PP change against the prompt length. The loan pays where its prefill is
faster than the loan-off one; the reload it costs is fixed, so a short prompt can lose, and the
engine's choice should then be loan off's figure.

The context is the configuration's, raised for the arms (``runtime.context_tokens``) to hold the
longest prompt and its generated tokens when it is shorter (``--context-tokens`` sets it).
"""

from __future__ import annotations

import argparse

from strata.bench.experiments.runs import (Arm, change, figures, median_range, percent, plans, run_interleaved,
                                           select)
from strata.bench.experiments.loans import require_loan
from strata.bench.experiments.context import check_fits

NAME = "crossover"
HELP = "loan off and on at each prompt length: PP and TG per length, where the loan stops paying"
DEFAULTS = {"prompt_tokens": "2k,8k,16k,32k,48k,64k", "gen_tokens": 256, "reps": 3}
REPEAT, GATE = "repeat_loan", "cost_gate"
ARMS = (("off", "Off"), ("on", "On"), ("auto", "Engine's choice"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context-tokens", type=int,
                        help="runtime.context_tokens of both arms (default: the config's, raised to the longest "
                             "prompt plus --gen-tokens)")


def run(args: argparse.Namespace, setup, lengths: list[int]) -> None:
    require_loan(setup)
    needed = max(lengths) + args.gen_tokens
    context = args.context_tokens or max(setup.config.runtime.context_tokens, needed)
    check_fits(lengths, args.gen_tokens, context, "--context-tokens" if args.context_tokens else "the arms")
    overrides = {"runtime.context_tokens": context} if context != setup.config.runtime.context_tokens else {}
    config = setup.arm_file("crossover", overrides=overrides)
    plugins = [name for name in setup.raw.get("loan", {}).get("plugins", []) if name not in (REPEAT, GATE)]
    auto = setup.arm_file("crossover-auto", without=(f"loan.{REPEAT}",),
                          overrides={**overrides, "loan.plugins": [*plugins, GATE]})
    arms = [Arm("off", "Loan flags off", config, loan="off"), Arm("on", "Loan flags on", config, loan="on"),
            Arm("auto", "Engine's choice (cost_gate)", auto, loan="on")]
    setup.results.doc["arms"] = [arm.describe() for arm in arms]
    setup.results.doc["context_tokens"] = context
    run_interleaved(arms, lengths, args.reps, args.gen_tokens, args.timeout, setup.results.record)


def length_rows(doc: dict) -> list[dict]:
    """Per prompt length that has runs of both arms: each arm's plans, PP and TG, and the PP change."""
    rows = []
    for length in sorted({run["prompt_tokens"] for run in doc["runs"]}):
        arms = {name: select(doc["runs"], arm=name, prompt_tokens=length) for name, _ in ARMS}
        if not (arms["off"] and arms["on"]):
            continue
        row = {"prompt_tokens": length}
        for name, runs in arms.items():
            if runs:  # results written before the engine's-choice arm have none of it
                row[name] = {"plans": plans(runs), "pp": figures(runs, "prefill_tokens_per_s"),
                             "tg": figures(runs, "decode_tokens_per_s"),
                             "loans_taken": sum(run.get("loan_summary", "").startswith("loan on") for run in runs),
                             "num_runs": len(runs)}
        row["pp_change"] = change(row["on"]["pp"]["median"], row["off"]["pp"]["median"])
        if "auto" in row:
            row["auto_pp_change"] = change(row["auto"]["pp"]["median"], row["off"]["pp"]["median"])
        rows.append(row)
    return rows


def summarize(doc: dict) -> dict:
    rows = length_rows(doc)
    pays = [row["prompt_tokens"] for row in rows if row["pp_change"] > 0]
    loses = [row["prompt_tokens"] for row in rows if row["pp_change"] <= 0]
    changes = ", ".join(f"{row['prompt_tokens']:,}: {percent(row['pp_change'])}" for row in rows)
    if pays and loses:
        where = f"faster at {_lengths(pays)} prompt tokens, not at {_lengths(loses)}"
    else:
        where = "faster at every length" if pays else "faster at no length"
    verdict = f"The loan's prefill is {where} (PP with the loan: {changes})."
    auto = [row for row in rows if "auto" in row]
    if auto:
        # the engine's choice against the better of the two fixed arms at each length
        shortfalls = [change(row["auto"]["pp"]["median"], max(row["on"]["pp"]["median"], row["off"]["pp"]["median"]))
                      for row in auto]
        taken = ", ".join(f"{row['prompt_tokens']:,}: {row['auto']['loans_taken']}/{row['auto']['num_runs']}"
                          for row in auto)
        verdict += (f" The engine's own choice took the loan in {taken} runs; its PP against the better arm: "
                    + ", ".join(f"{row['prompt_tokens']:,}: {percent(s)}" for row, s in zip(auto, shortfalls)) + ".")
    return {"lengths_paying": pays, "lengths_not_paying": loses, "passed": bool(rows), "verdict": verdict}


def table(doc: dict) -> str:
    lines = ["| Prompt | Loan | Prompt chunk / ring | PP median (range) | TG median (range) | PP with the loan |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for row in length_rows(doc):
        for name, label in ARMS:
            if name not in row:
                continue
            arm = row[name]
            pp_change = {"on": row["pp_change"], "auto": row.get("auto_pp_change")}.get(name)
            cells = [f"{row['prompt_tokens']:,}", label, ", ".join(arm["plans"]), median_range(arm["pp"]),
                     median_range(arm["tg"]), "-" if pp_change is None else percent(pp_change)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(doc: dict, plt):
    rows = length_rows(doc)
    lengths = [row["prompt_tokens"] for row in rows]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in ((axes[0], "pp", "prefill (PP), tokens/s"), (axes[1], "tg", "decode (TG), tokens/s")):
        for name, color, label in (("off", "#8c8c8c", "loan off"), ("on", "#1f77b4", "loan on"),
                                   ("auto", "#2ca02c", "engine's choice")):
            present = [row for row in rows if name in row]
            if not present:
                continue
            xs = [row["prompt_tokens"] for row in present]
            ax.plot(xs, [row[name][key]["median"] for row in present], "o-" if name != "auto" else "s--",
                    color=color, label=label)
            ax.fill_between(xs, [row[name][key]["min"] for row in present],
                            [row[name][key]["max"] for row in present], color=color, alpha=0.2)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    axes[2].axhline(0, color="black", linewidth=0.8)
    axes[2].bar(range(len(rows)), [100 * row["pp_change"] for row in rows],
                color=["#2ca02c" if row["pp_change"] > 0 else "#d62728" for row in rows])
    axes[2].set_xticks(range(len(rows)), [f"{n:,}" for n in lengths], fontsize=8, rotation=30)
    axes[2].set_title("PP change with the loan, % (below 0: it does not pay)", fontsize=10)
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths], fontsize=8, rotation=30)
        ax.minorticks_off()
    for ax in axes:
        ax.set_xlabel("prompt tokens", fontsize=9)
    return figure


def _lengths(values: list[int]) -> str:
    return ", ".join(f"{n:,}" for n in values)
