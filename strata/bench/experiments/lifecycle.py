"""``strata experiment lifecycle``: a later long message inside one server.

One ``strata serve`` process over HTTP: a short warm-up request (it takes the startup loan), then
the long prompt (default 31,258 tokens), which must repeat the loan (retrying smaller geometries
if one does not fit), restore, and generate every requested token; then ``--after-requests`` more.
Each request reports its plan, loan, retries, PP and TG (the response's ``strata`` object), and
``/metrics``' ``strata_vram_ledger_idle`` is read after each (before the first, the startup loan
still defers what the first request gives back, so the ledger is not the idle engine's). Then
``--reps`` fresh processes run the long prompt alone, loan on, for the comparison.

Bars: no request fails and each generates all it asked for; the long request took the loan; the
ledger is idle between requests; the long request's TG within 10% of the fresh processes' median
(a regression of at most 10%, as the write-up's limit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from strata.bench.experiments.runs import Arm, change, figures, percent, run_arm
from strata.bench.experiments.serve_process import ServeProcess
from strata.bench.experiments.loans import require_loan
from strata.bench.one_run import prompt_tokens
from strata.errors import ExperimentError

NAME = "lifecycle"
HELP = "one serving process over HTTP: warm-up, the long prompt on a repeat loan, more requests; the ledger idle"
DEFAULTS = {"prompt_tokens": "31258", "gen_tokens": 256, "reps": 3}
DECODE_BAR = 0.10
REPEAT_LOAN = "repeat_loan"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup-tokens", type=int, default=256, help="the warm-up prompt (default 256 tokens)")
    parser.add_argument("--after-requests", type=int, default=3, help="requests after the long one (default 3)")
    parser.add_argument("--after-tokens", type=int, default=2048,
                        help="the prompt of each request after the long one (default 2,048 tokens)")
    parser.add_argument("--repeat-min-tokens", type=int,
                        help="[loan.repeat_loan] min_tokens of the serving process (default: the config's; it must "
                             "not exceed the long prompt, or the long request would not repeat the loan)")


def run(args: argparse.Namespace, setup, lengths: list[int]) -> None:
    from strata.model.gguf_file import open_gguf
    from strata.model.locate import resolve_model_path
    from strata.model.tokenizer import Tokenizer

    require_loan(setup)
    long_tokens = lengths[0]
    overrides = _check_repeat_loan(setup, long_tokens, args.repeat_min_tokens)
    if not setup.config.runtime.serve:
        raise ExperimentError(f"{setup.config_path} has runtime.serve = false; the lifecycle runs a server: set "
                              "runtime.serve = true")
    doc, results = setup.results.doc, setup.results
    config = setup.arm_file("serve", overrides=overrides)
    tokenizer = Tokenizer.from_metadata(open_gguf(resolve_model_path(setup.config.model.path)).metadata)
    plan = [("warm-up", args.warmup_tokens, min(16, args.gen_tokens)), ("long", long_tokens, args.gen_tokens)]
    plan += [(f"after {i + 1}", args.after_tokens, args.gen_tokens) for i in range(args.after_requests)]
    prompts = _prompts(tokenizer, plan)
    doc["requests"] = []
    fresh = Arm("fresh", "Fresh process, loan on", config, loan="on")
    doc["arms"] = [{"name": "serve", "label": "One serving process", "config": str(config)}, fresh.describe()]
    with ServeProcess(config, results.path("-server.log"), args.timeout) as server:
        model = _model_id(server)
        for (label, _, gen_tokens), tokens in zip(plan, prompts):
            doc["requests"].append(_request(server, model, tokenizer, label, tokens, gen_tokens, args.timeout))
            results.save()
    for rep in range(args.reps):
        results.record({**run_arm(fresh, long_tokens, args.gen_tokens, rep, args.timeout), "arm": "fresh",
                        "rep": rep + 1})


def _prompts(tokenizer, plan: list[tuple[str, int, int]]) -> list[list[int]]:
    """Seeded prompts of ordinary tokens: the long one is the fresh processes' first (seed 0); the
    others start with a token no other prompt starts with, so that none reuses another's KV prefix."""
    prompts = [prompt_tokens(tokenizer, n, 0 if label == "long" else 1000 + i) for i, (label, n, _) in enumerate(plan)]
    firsts = {p[0] for p, (label, _, _) in zip(prompts, plan) if label == "long"}
    for tokens, (label, _, _) in zip(prompts, plan):
        if label != "long":
            tokens[0] = next(t for t in [tokens[0], *range(tokenizer.vocab_size)] if t not in firsts
                             and not tokenizer.is_special(t) and not tokenizer.is_eog(t) and tokenizer.token_piece(t))
            firsts.add(tokens[0])
    return prompts


def _check_repeat_loan(setup, long_tokens: int, min_tokens: int | None) -> dict:
    from strata.plugins import load_plugins

    if REPEAT_LOAN not in setup.config.loan.plugins:
        raise ExperimentError(f"{setup.config_path}: loan.plugins has no {REPEAT_LOAN!r}; the long request repeats "
                              f"the loan through it: add {REPEAT_LOAN!r} to loan.plugins")
    overrides = {f"loan.{REPEAT_LOAN}.min_tokens": min_tokens} if min_tokens is not None else {}
    threshold = min_tokens or load_plugins(setup.config)[1].plugin_options(REPEAT_LOAN).min_tokens
    if threshold > long_tokens:
        raise ExperimentError(f"[loan.{REPEAT_LOAN}] min_tokens = {threshold:,} exceeds --prompt-tokens "
                              f"{long_tokens:,}: the long request would not repeat the loan; pass "
                              f"--repeat-min-tokens {long_tokens:,} or less, or a longer --prompt-tokens")
    return overrides


def _model_id(server: ServeProcess) -> str:
    status, text = server.get("/v1/models")
    if status != 200:
        raise ExperimentError(f"GET /v1/models answered {status}: {text[:300]}")
    return json.loads(text)["data"][0]["id"]


def _request(server: ServeProcess, model: str, tokenizer, label: str, tokens: list[int], gen_tokens: int,
             timeout: float) -> dict:
    body = {"model": model, "prompt": tokens, "max_tokens": gen_tokens, "temperature": 0,
            "logit_bias": {str(t): -100 for t in sorted(tokenizer.eog_ids)}}
    started = time.perf_counter()
    status, answer = server.post_json("/v1/completions", body, timeout)
    row = {"request": label, "prompt_tokens": len(tokens), "gen_tokens": gen_tokens, "status": status,
           "seconds": round(time.perf_counter() - started, 3)}
    if status == 200:
        report = answer["strata"]
        row |= {"generated_tokens": answer["usage"]["completion_tokens"], "timings": answer["timings"],
                "strata": report, "prefill_tokens_per_s": report["prefill_tokens_per_s"],
                "decode_tokens_per_s": report["decode_tokens_per_s"]}
    else:
        row["error"] = answer.get("error", {}).get("message", str(answer))[:1000]
    if status:  # a server that answered can say whether the request left its memory as it found it
        row["ledger_idle_after"] = server.metrics().get("strata_vram_ledger_idle") == 1
    print(f"[{label}] {status} " + (f"plan {_plan(row)} PP {row['prefill_tokens_per_s']:,.1f} TG "
                                     f"{row['decode_tokens_per_s']:,.1f}" if status == 200 else row["error"][:200]),
          file=sys.stderr, flush=True)
    return row


def summarize(doc: dict) -> dict:
    requests = doc.get("requests", [])
    failed = [r["request"] for r in requests if r["status"] != 200 or r.get("generated_tokens") != r["gen_tokens"]]
    long = next((r for r in requests if r["request"] == "long" and r["status"] == 200), None)
    is_long_loan = bool(long and long["strata"]["loan"] and long["strata"]["loan"]["is_taken"])
    not_idle = [r["request"] for r in requests if not r.get("ledger_idle_after")]
    is_idle = bool(requests) and not not_idle
    fresh = figures([r for r in doc["runs"] if r["arm"] == "fresh"], "decode_tokens_per_s")
    decode = change(long["decode_tokens_per_s"], fresh["median"]) if long and fresh["median"] else None
    is_decode_within = decode is not None and decode >= -DECODE_BAR
    passed = not failed and is_long_loan and is_idle and is_decode_within
    parts = ["no request failed" if not failed else f"failed or cut short: {', '.join(failed)}",
             "the long request took the loan" if is_long_loan else "the long request did not take the loan",
             "the ledger was idle between requests" if is_idle else
             f"the ledger was not idle after: {', '.join(not_idle) or 'no request'}",
             f"decode of the long request {long['decode_tokens_per_s']:,.1f} against {fresh['median']:,.1f} for a "
             f"fresh process ({percent(decode)}; bar: at most {DECODE_BAR:.0%} slower)" if decode is not None
             else "no decode comparison (the long request or the fresh runs are missing)"]
    return {"failed_requests": failed, "is_long_loan": is_long_loan, "is_ledger_idle": is_idle,
            "decode_change": decode, "fresh_decode": fresh, "passed": passed,
            "verdict": "; ".join(parts)[:1].upper() + "; ".join(parts)[1:]
            + f". {'All bars met' if passed else 'Not every bar met'}."}


def table(doc: dict) -> str:
    lines = ["| Request | Prompt tokens | Generated | Loan | Prompt chunk / ring | Retries | PP | TG "
             "| Ledger idle after |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in doc.get("requests", []):
        if r["status"] != 200:
            lines.append(f"| {r['request']} | {r['prompt_tokens']:,} | failed ({r['status']}): {r['error'][:80]} "
                         f"| | | | | | {_yes(r.get('ledger_idle_after'))} |")
            continue
        loan = r["strata"]["loan"] or {}
        cells = [r["request"], f"{r['prompt_tokens']:,}", f"{r['generated_tokens']:,}",
                 "on" if loan.get("is_taken") else "off", _plan(r), str(loan.get("retries", 0)),
                 f"{r['prefill_tokens_per_s']:,.1f}", f"{r['decode_tokens_per_s']:,.1f}",
                 _yes(r.get("ledger_idle_after"))]
        lines.append("| " + " | ".join(cells) + " |")
    fresh = [r for r in doc["runs"] if r["arm"] == "fresh"]
    if fresh:
        f = figures(fresh, "decode_tokens_per_s")
        p = figures(fresh, "prefill_tokens_per_s")
        lines.append(f"| fresh process (median of {len(fresh)}) | {fresh[0]['prompt_tokens']:,} | "
                     f"{fresh[0]['generated_tokens']:,} | on | {', '.join(sorted({_run_plan(r) for r in fresh}))} | "
                     f"| {p['median']:,.1f} | {f['median']:,.1f} | |")
    return "\n".join(lines)


def plot(doc: dict, plt):
    served = [r for r in doc.get("requests", []) if r["status"] == 200]
    fresh = figures([r for r in doc["runs"] if r["arm"] == "fresh"], "decode_tokens_per_s")
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r["request"] for r in served]
    for ax, key, title in ((axes[0], "prefill_tokens_per_s", "prefill (PP), tokens/s"),
                           (axes[1], "decode_tokens_per_s", "decode (TG), tokens/s")):
        colors = ["#1f77b4" if (r["strata"]["loan"] or {}).get("is_taken") else "#8c8c8c" for r in served]
        bars = ax.bar(range(len(served)), [r[key] for r in served], color=colors)
        for bar, r in zip(bars, served):
            ax.annotate(f"{bar.get_height():,.1f}\n{_plan(r)}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 3), textcoords="offset points")
        ax.set_xticks(range(len(served)), labels, fontsize=8)
        ax.set_title(title + " (blue: loan taken)", fontsize=10)
        top = max([r[key] for r in served] + [fresh["median"] if key == "decode_tokens_per_s" else 0, 1e-9])
        ax.set_ylim(0, top * 1.3)
    if fresh["median"]:
        axes[1].axhline(fresh["median"], color="#2ca02c", linestyle="--", label="fresh process, long prompt")
        axes[1].axhline(fresh["median"] * (1 - DECODE_BAR), color="#d62728", linestyle=":",
                        label=f"{DECODE_BAR:.0%} below it")
        axes[1].legend(fontsize=8)
    return figure


def _plan(row: dict) -> str:
    plan = row.get("strata", {}).get("plan")
    return f"{plan['chunk_tokens']:,} / {plan['ring_slots']}" if plan else "-"


def _run_plan(run: dict) -> str:
    return f"{run['chunk_tokens']:,} / {run['ring_slots']}"


def _yes(value) -> str:
    return "yes" if value else "no"
