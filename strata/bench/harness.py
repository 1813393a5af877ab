"""``strata --config FILE bench``: prefill and decode in fresh processes, medians and ranges.

Each repetition is a new process (``strata.bench.one_run``) so no cache, allocator or compiled
state carries over, as in the reference write-up's protocol. Arms: loan off (the config with
``loan.enabled = false``) and loan on (the config as written). The table reports the plan, PP and
TG medians with ranges, bytes streamed per chunk, the expert-cache hit rate, the ratio of the
prefill floor to the prefill time, the bytes decode streams and reads from VRAM a decoded token (under
speculation: a verify step's bytes over the tokens it took, against a plain row's per token), the ratio
of the decode floor to the decode time, the host's own work a decode step (decode time less its waits on
the device, the timing line's "busy": median, range, and the process furthest from the median), and every
PP and TG median as a ratio to the rival's
figures, both with its experts in host RAM and with the whole model in VRAM (``rival.py``: llama-bench's
table from the same machine and run with ``--rival FILE``, else an earlier run's, named under the table;
a length the rival has no figure for says so).

Floors (rates measured on the reference H200: docs/PERFORMANCE.md, "The machine and its ceilings"):

- prefill: ``max(prefill streamed bytes / 55 GB/s, FLOPs / 730 TFLOP/s)``, FLOPs being
  ``2 * active params * n + 2 * n**2 * attention width`` (causal attention).
- decode, over its ``S = generated - 1`` steps (the first token comes from prefill's logits):
  ``max(PCIe, HBM)`` with ``PCIe = decode streamed bytes / 55 GB/s`` and
  ``HBM = (S * (dense + head + experts) + kv_cell * (S * P + S * (S + 1) / 2)) / 3.9 TB/s``:
  a decode step reads the dense weights without the embedding table (``dense``), the output head
  (``head``), the top-k routed experts of every layer (``experts``, missed or cached: a miss
  lands in VRAM and is read there) and the KV cache of every token so far (step ``i`` of a
  ``P``-token prompt attends to ``P + i`` cells of ``kv_cell`` bytes). The terms are a max, not a
  sum: the staging of one layer's misses can overlap the reads of others, so only the larger of
  the two is a lower bound. A run recorded without the read sizes has an HBM term of 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from strata.bench.host_cpu import choice as host_cpu_choice
from strata.bench.host_cpu import summary as host_cpu_summary
from strata.bench.host_numa import summary as host_numa_summary
from strata.bench.one_run import DECODE_MISSES, DETERMINISTIC
from strata.bench.provenance import code_identity
from strata.bench.rival import EARLIER_RUN, Rival, read_rival
from strata.config import Config
from strata.engine.request import host_ms_per_step

PCIE_BYTES_PER_S = 55e9  # pinned host-to-device, measured on the reference H200
TENSOR_FLOPS_PER_S = 730e12  # cuBLAS fp16 tensor cores, measured on the reference H200
HBM_BYTES_PER_S = 3.9e12  # HBM copy (Numba kernel, read + write), measured on the reference H200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", default="2048,8192,32768", help="comma-separated prompt lengths")
    parser.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per run (default 128)")
    parser.add_argument("--reps", type=int, default=3, help="fresh processes per arm and length (default 3)")
    parser.add_argument("--arms", default="off,on", help="loan arms to run: off, on or off,on")
    parser.add_argument("--out", type=Path, help="write every run's figures here as JSON (after each run, so a "
                                                 "later failure keeps the runs before it)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    parser.add_argument("--spec", default="config",
                        help="speculative decode arms, comma-separated: config (as configured), auto, fixed "
                             "(depth runtime.spec_depth), off (plain decode with the same memory)")
    parser.add_argument("--decode-misses", default="config",
                        help="decode-miss arms, comma-separated: config (runtime.decode_misses as configured), "
                             "stage, host (each arm's rows say which it ran)")
    parser.add_argument("--deterministic", default="config",
                        help="arms of prefill's MoE sums, comma-separated: config (runtime.deterministic as "
                             "configured), off (float atomics), on (fixed point; each arm's rows say which)")
    parser.add_argument("--draft-oracle", type=float, default=None, metavar="P",
                        help="measurement mode: each draft is the target's own greedy continuation with "
                             "probability P, else a wrong token (labelled in every row)")
    parser.add_argument("--profile-dir", type=Path, help="write each run's host-side profile here "
                                                         "(cProfile stats, <arm>-<prompt>-<rep>.prof)")
    parser.add_argument("--rival", type=Path, metavar="FILE",
                        help="llama-bench's table from this machine and run (peer-llamacpp bench's output): the "
                             "ratios' divisors (default: an earlier run's figures, named under the table)")
    parser.add_argument("--host-cpu", default="any", type=host_cpu_choice,
                        help="the CPU each run's request thread runs on: any (default), fastest (by a probe on "
                             "each CPU after load) or a CPU number (threads it starts later share it); every run "
                             "records the per-CPU probes")
    parser.add_argument("--layer-timeline", action="store_true",
                        help="time every prefill layer on the device (attention, MoE, waits for copies) and the "
                             "host's issuing of it; the marks slow the run a little, so compare shares, not speeds")


def run(args: argparse.Namespace, config: Config) -> int:
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    rival = read_rival(args.rival, config.model.path)  # before any run: a file not llama-bench's stops here
    arms = [(loan.strip(), spec.strip(), misses.strip(), sums.strip()) for loan in args.arms.split(",")
            for spec in args.spec.split(",") for misses in args.decode_misses.split(",")
            for sums in args.deterministic.split(",")]
    for option, allowed, index in (("--decode-misses", DECODE_MISSES, 2), ("--deterministic", DETERMINISTIC, 3)):
        unknown = sorted({arm[index] for arm in arms} - set(allowed))
        if unknown:  # before any run, not in the middle of the bench
            raise SystemExit(f"{option} {', '.join(unknown)}: each arm must be one of {', '.join(allowed)}")
    code = code_identity()
    print(f"# {code}", file=sys.stderr, flush=True)
    runs = []
    for length in lengths:
        # arms interleaved per repetition: the first process after the GPU has idled runs slower
        # (measured on the H200), and it must not always be the same arm's
        for rep in range(args.reps):
            for arm, spec, misses, sums in arms:
                profile = None
                if args.profile_dir:
                    args.profile_dir.mkdir(parents=True, exist_ok=True)
                    misses_part = "" if misses == "config" else f"-{misses}"
                    sums_part = "" if sums == "config" else f"-deterministic-{sums}"
                    profile = args.profile_dir / f"{arm}-{spec}{misses_part}{sums_part}-{length}-{rep + 1}.prof"
                extra = ["--spec", spec, "--decode-misses", misses, "--deterministic", sums] + (
                    [] if args.draft_oracle is None or spec == "off" else ["--draft-oracle", str(args.draft_oracle)])
                extra += ["--host-cpu", args.host_cpu] + (["--layer-timeline"] if args.layer_timeline else [])
                result = run_fresh(args.config, length, args.gen_tokens, arm, rep, args.timeout, profile, extra)
                runs.append(result)
                print(f"[{arm} {length} #{rep + 1}] {result['timing_line']}", file=sys.stderr, flush=True)
                if "pcie_bytes_per_s" in result:
                    print(f"[{arm} {length} #{rep + 1}] rates: PCIe {result['pcie_bytes_per_s'] / 1e9:.1f} GB/s "
                          f"({result['pcie_source']}); compute {result['compute_flops_per_s'] / 1e12:.1f} TFLOP/s "
                          f"({result['compute_source']})", file=sys.stderr, flush=True)
                if result.get("is_output_equal") is False:  # speculation must not change greedy output
                    print(f"[{arm} {length} #{rep + 1}] OUTPUT DIFFERS from the plain run's from token "
                          f"{result.get('first_difference')}", file=sys.stderr, flush=True)
                if result.get("depth_policy") and spec != "off":
                    print(f"[{arm} {length} #{rep + 1}] depth policy: {result['depth_policy']}", file=sys.stderr,
                          flush=True)
                if result.get("backend") == "cuda":
                    print(f"[{arm} {length} #{rep + 1}] load {result['load_seconds']:.1f} s "
                          f"({result.get('kernels_loaded', 0)} kernels from the kernel cache)", file=sys.stderr,
                          flush=True)
                if result.get("tensor_cores_off"):
                    print(f"[{arm} {length} #{rep + 1}] tensor-core kernels off: {result['tensor_cores_off']}",
                          file=sys.stderr, flush=True)
                if result.get("host_cpu"):
                    print(f"[{arm} {length} #{rep + 1}] {host_cpu_summary(result['host_cpu'])}", file=sys.stderr,
                          flush=True)
                if result.get("host_numa"):
                    print(f"[{arm} {length} #{rep + 1}] {host_numa_summary(result['host_numa'])}", file=sys.stderr,
                          flush=True)
                if result.get("code", code) != code:  # the run imported another tree than this process
                    print(f"[{arm} {length} #{rep + 1}] ran {result['code']}", file=sys.stderr, flush=True)
                for line in result.get("stderr_lines", ()):  # its warnings (the warm-up's ledger check...)
                    print(f"[{arm} {length} #{rep + 1}] said: {line}", file=sys.stderr, flush=True)
                if args.out:
                    args.out.write_text(json.dumps(runs, indent=1))
    print(format_table(runs, rival))
    return 0


ONE_RUN = ("-m", "strata.bench.one_run")
MAX_STDERR_LINES = 20  # of a successful run's stderr kept in its figures (a run's warnings; more are counted)


def run_fresh(config_path: str, length: int, gen_tokens: int, arm: str, rep: int, timeout: float,
              profile: Path | None = None, extra: Sequence[str] = (), python: str = sys.executable,
              launcher: Sequence[str] = ONE_RUN) -> dict:
    """One ``strata.bench.one_run`` in a new process of ``python``, started through ``launcher``
    (the experiments start some arms through a wrapper module); its figures."""
    command = [python, *launcher, "--config", str(config_path), "--prompt-tokens", str(length),
               "--gen-tokens", str(gen_tokens), "--loan", arm, "--seed", str(rep), *extra]
    if profile:
        command += ["--profile", str(profile)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("STRATA-BENCH ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark run failed ({' '.join(command)}):\n{done.stderr[-4000:]}")
    return {**json.loads(lines[-1][len("STRATA-BENCH "):]), "stderr_lines": stderr_lines(done.stderr)}


def stderr_lines(text: str, limit: int = MAX_STDERR_LINES) -> list[str]:
    """A successful run's non-blank stderr lines, the first ``limit`` of them and a count of the rest: what
    it warned of would otherwise be lost with the process."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return lines[:limit] + ([f"... and {len(lines) - limit} more line(s)"] if len(lines) > limit else [])


def prefill_floor_seconds(run: dict) -> float:
    """max(streamed bytes / PCIe, FLOPs / tensor-core rate); attention is causal."""
    n = run["prompt_tokens"]
    flops = 2.0 * run["active_params"] * n + 2.0 * n * n * run.get("attention_width", 0)
    return max(_prefill_bytes(run) / PCIE_BYTES_PER_S, flops / TENSOR_FLOPS_PER_S)


def decode_floor_seconds(run: dict) -> float:
    """max(decode streamed bytes / PCIe, decode VRAM reads / HBM): see the module's docstring."""
    return max(_decode_bytes(run) / PCIE_BYTES_PER_S, decode_vram_bytes(run) / HBM_BYTES_PER_S)


def decode_vram_bytes(run: dict) -> float:
    """Bytes all decode steps read from VRAM: weights a token reads, times the steps, plus the KV
    cache at each step's context (0 for a run recorded without the read sizes)."""
    steps, prompt = _decode_steps(run), run["prompt_tokens"]
    weights = run.get("dense_read_bytes", 0) + run.get("head_read_bytes", 0) + run.get("expert_read_bytes", 0)
    cells = steps * prompt + steps * (steps + 1) / 2
    return steps * weights + run.get("kv_bytes_per_cell", 0) * cells


def _decode_bytes(run: dict) -> int:
    """Bytes decode streamed: the request's, less prefill's and the residency restaged between them."""
    return run["streamed_bytes"] - _prefill_bytes(run) - run.get("restaged_bytes", 0)


def _decode_steps(run: dict) -> int:
    """Tokens decoded (the first comes from prefill's logits): plain decode's forward passes; under
    speculation, the tokens its verify steps took, so that a speculative row's bytes per token (a
    verify step's bytes over the tokens it took) read against a plain row's."""
    return max(0, run["generated_tokens"] - 1)


def _decode_seconds(run: dict) -> float:
    if "decode_seconds" in run:
        return run["decode_seconds"]
    rate = run["decode_tokens_per_s"]
    return _decode_steps(run) / rate if rate > 0 else 0.0


def _decode_floor_share(run: dict) -> float:
    """decode_floor_seconds over the decode time (0 without a decode step)."""
    seconds = _decode_seconds(run)
    return decode_floor_seconds(run) / seconds if seconds > 0 else 0.0


def _prefill_bytes(run: dict) -> int:
    """Bytes prefill streamed (runs recorded before the split counted decode's misses too)."""
    return run.get("prefill_streamed_bytes", run["streamed_bytes"])


def format_table(runs: list[dict], rival: Rival = EARLIER_RUN) -> str:
    """The table, then a line naming the rival's figures the ratios divide by."""
    header = ("| Prompt | Loan | Spec | Prompt chunk / ring | PP median (range) | TG median (range) "
              "| MiB streamed / chunk | cache hit rate | floor / PP time | MiB streamed / decoded token "
              "| MiB read from VRAM / decoded token | decode floor / TG time "
              "| decode host busy ms / token (range, widest from median) | PP vs rival, experts in RAM "
              "| PP vs rival, all in VRAM | TG vs rival, experts in RAM | TG vs rival, all in VRAM "
              "| drafted / accepted (rate) | tokens / verify step | depth chosen |")
    rows = [header, "| " + " | ".join(["---:"] * 20) + " |"]
    groups: dict[tuple[int, str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["prompt_tokens"], run["loan"], _spec_label(run)), []).append(run)
    for (length, arm, spec), group in sorted(groups.items()):
        pp = [r["prefill_tokens_per_s"] for r in group]
        tg = [r["decode_tokens_per_s"] for r in group]
        plans = sorted({f"{r['chunk_tokens']:,} / {r['ring_slots']}" for r in group})
        per_chunk = statistics.median(_prefill_bytes(r) / max(1, r["num_chunks"]) for r in group) / 2**20
        floor = statistics.median(prefill_floor_seconds(r) / r["prefill_seconds"] for r in group)
        per_token = statistics.median(_decode_bytes(r) / max(1, _decode_steps(r)) for r in group) / 2**20
        vram_per_token = statistics.median(decode_vram_bytes(r) / max(1, _decode_steps(r)) for r in group) / 2**20
        decode_floor = statistics.median(_decode_floor_share(r) for r in group)
        pp_median, tg_median = statistics.median(pp), statistics.median(tg)
        cells = [f"{length:,}", arm, spec, ", ".join(plans), _median_range(pp), _median_range(tg), f"{per_chunk:,.0f}",
                 f"{statistics.median(r['cache_hit_rate'] for r in group):.1%}", f"{floor:.2f}",
                 f"{per_token:,.0f}", f"{vram_per_token:,.0f}", f"{decode_floor:.2f}", _host_busy_cell(group),
                 _prefill_ratio(pp_median, length, rival.prefill),
                 _prefill_ratio(pp_median, length, rival.vram_prefill),
                 _ratio(tg_median, rival.decode), _ratio(tg_median, rival.vram_decode), *_spec_cells(group)]
        rows.append("| " + " | ".join(cells) + " |")
    off = sorted({run["tensor_cores_off"] for run in runs if run.get("tensor_cores_off")})
    warning = "".join(f"\nTensor-core kernels off in this table's runs ({reason}): prefill ran the pure-Numba "
                      f"kernels." for reason in off)
    return "\n".join(rows) + f"\n\nRival: {rival.source}." + warning


def host_busy_ms(run: dict) -> float | None:
    """The host's own work a decode step in ms, the timing line's "busy"; None for uncaptured decode."""
    share = host_ms_per_step(_decode_seconds(run), run.get("decode_wait_seconds", 0.0), _decode_steps(run))
    return None if share is None else share[1]


def _host_busy_cell(group: list[dict]) -> str:
    """Median busy ms a step, its range, and the process furthest from the median as a share of it (issue
    33's bar: within ±10% across fresh processes)."""
    values = [v for v in (host_busy_ms(r) for r in group) if v is not None]
    if not values:
        return "-"
    median = statistics.median(values)
    widest = max(abs(v - median) for v in values) / median if median > 0 else 0.0
    return f"{median:.1f} ({min(values):.1f}–{max(values):.1f}, ±{widest:.0%})"


def _spec_label(run: dict) -> str:
    """The run's decode: plain, or speculation's policy; the draft oracle named (it is not the model's speed),
    and where the run set runtime.decode_misses (``--decode-misses``) or runtime.deterministic
    (``--deterministic``), the value."""
    label = run.get("spec", "none")
    oracle = run.get("draft_oracle")
    if oracle is not None and label not in ("off", "none"):
        label = f"{label}, draft oracle {oracle:g}"
    if run.get("decode_misses_arm", "config") != "config":  # the arms of --decode-misses
        label = f"{label}, misses {run['decode_misses']}"
    if run.get("deterministic_arm", "config") != "config":  # the arms of --deterministic
        label = f"{label}, {'fixed-point' if run['deterministic'] else 'float'} sums"
    return label


def _spec_cells(group: list[dict]) -> list[str]:
    """Medians of drafted / accepted, tokens per verify step and the depth the policy chose last."""
    is_speculating = group[0].get("spec") not in (None, "off", "none")
    depths = ", ".join(sorted({str(r.get("spec_depth", 0)) for r in group})) if is_speculating else "-"
    if not any(r.get("spec_rounds") for r in group):  # plain decode, or a policy that never drafted
        return ["-", "-", depths]
    drafted = statistics.median(r["spec_drafted"] for r in group)
    accepted = statistics.median(r["spec_accepted"] for r in group)
    per_step = statistics.median((r["spec_accepted"] + r["spec_rounds"]) / r["spec_rounds"]
                                 for r in group if r["spec_rounds"])
    return [f"{drafted:,.0f} / {accepted:,.0f} ({accepted / max(1, drafted):.0%})", f"{per_step:.2f}", depths]


def _prefill_ratio(median: float, length: int, rival: dict[int, float]) -> str:
    if length not in rival:
        name = f"{length // 1024}k" if length % 1024 == 0 else f"{length:,}-token"
        return f"rival has no {name} figure"
    return _ratio(median, rival[length])


def _ratio(median: float, rival: float | None) -> str:
    if rival is None:
        return "rival has no figure"
    return f"{median / rival:.2f}× of {rival:,.0f}" if rival >= 100 else f"{median / rival:.2f}× of {rival:,.1f}"


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}–{max(values):,.1f})"
