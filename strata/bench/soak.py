"""``strata --config FILE soak``: many requests with random prompt lengths in one process, device
memory and RSS recorded after each, and their slope: a loan that leaks shows as a slope above zero.

Every request is checked as it ends: the ledger must be back at the idle engine's, to the byte. The
figures go to stdout as a table and, with ``--out``, as JSON lines (one per request, then a summary).
The slope is a least-squares fit over the requests after ``--settle`` (allocator caches and the first
restores grow memory at the start), and after the ``--python-growth`` window when there is one; the
command fails (status 1) when a slope exceeds ``--max-slope-kib`` per request or the ledger is not idle
after a request. SIGTERM ends the soak after the request in flight, Ctrl-C at once; either way the
summary covers the requests done (and the Python heap's report, when a traced window had begun).
Each row also has RSS by kind, the interpreter's allocated blocks and (with glibc) the C heap's bytes
(``process_memory``), and the summary their slopes: which of them an RSS slope follows says where it grows.
``--census`` counts live objects by type before the slope's first request and after the last, names
the types that grew (``python_growth.ObjectCensus``), and, for the two that grew most past the
interpreter's own types, what holds a few of the objects born since (a chain of referrers each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time

import numpy as np

from strata.bench.process_memory import RSS_KIND_LABELS, heap_meter, heap_trimmer, memory_kinds, rss_bytes
from strata.bench.python_growth import ObjectCensus, PythonGrowth, format_census, format_holders, format_report
from strata.config import Config


def at_least(minimum: int):
    """An argparse type: an integer of at least ``minimum`` (argparse names the flag in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}; give at least {minimum}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=at_least(1), default=200, help="requests to send (default 200)")
    parser.add_argument("--min-prompt", type=at_least(1), default=64, help="shortest prompt in tokens (default 64)")
    parser.add_argument("--max-prompt", type=at_least(0), default=0,
                        help="longest prompt in tokens (default: half the context)")
    parser.add_argument("--gen-tokens", type=at_least(1), default=16, help="tokens generated per request (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths and tokens (default 0)")
    parser.add_argument("--settle", type=at_least(0), default=20,
                        help="first requests left out of the slope (default 20)")
    parser.add_argument("--max-slope-kib", type=float, default=64.0,
                        help="largest memory growth per request, device or RSS, that passes (default 64 KiB)")
    parser.add_argument("--trim-heap", action="store_true",
                        help="before each RSS reading, hand the C heap's free pages back to the OS (glibc's "
                             "malloc_trim): what still grows is held, not the allocator's free memory")
    parser.add_argument("--python-growth", action="store_true",
                        help="trace the Python heap over --python-growth-requests requests after --settle and "
                             "print the allocation sites and object types that grew (those requests run several "
                             "times slower: every allocation is traced; the slopes start after them)")
    parser.add_argument("--python-growth-requests", type=at_least(1), default=10,
                        help="requests the --python-growth window traces (default 10)")
    parser.add_argument("--census", action="store_true",
                        help="count live Python objects by type before the slope's first request and after the "
                             "last, and print the types that grew (no tracing: the requests keep their speed)")
    parser.add_argument("--out", help="write one JSON line per request and a summary line to this file")


def slope_bytes_per_request(values: list[int]) -> float:
    """Least-squares slope of ``values`` against their index; 0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(values), dtype=np.float64), np.asarray(values, np.float64), 1)[0])


def run(args: argparse.Namespace, config: Config) -> int:
    from strata.bench.one_run import prompt_tokens
    from strata.engine.facade import Engine
    from strata.engine.sampling import SamplingParams

    engine = Engine.load(config, show_progress=True)
    device_bytes = _device_meter(engine)
    max_prompt = args.max_prompt or engine.context_tokens // 2
    max_prompt = min(max_prompt, engine.context_tokens - args.gen_tokens - 1)
    rng = np.random.default_rng(args.seed)
    banned = {t: float("-inf") for t in engine.tokenizer.eog_ids}
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, logit_bias=banned)
    idle = dict(engine.idle_ledger.by_owner)
    trim = heap_trimmer() if args.trim_heap else None
    heap = heap_meter()
    if args.trim_heap and trim is None:
        print("--trim-heap: this C library has no malloc_trim; RSS is read as it is", file=sys.stderr)
    growth = PythonGrowth() if args.python_growth else None
    census = ObjectCensus() if args.census else None
    trace_from = min(args.settle, args.requests - 1)
    trace_to = min(args.requests, trace_from + max(1, args.python_growth_requests))
    slope_from = trace_to if growth is not None else args.settle
    rows, num_not_idle, growth_report, is_interrupted, is_tracing = [], 0, None, False, False
    census_from = None  # the request the census started before
    out = open(args.out, "w") if args.out else None
    print(f"{'#':>4} {'prompt':>7} {'loan':>5} {'PP tok/s':>9} {'TG tok/s':>9} {'device MiB':>11} {'RSS MiB':>9}")
    try:
        with _stop_on_terminate() as is_stopping:
            for index in range(args.requests):
                if is_stopping():
                    is_interrupted = True
                    print(f"SIGTERM: stopped after {len(rows)} requests", file=sys.stderr)
                    break
                if census is not None and index == slope_from:
                    census.start()
                    census_from = index
                if growth is not None and index == trace_from:
                    growth.start()
                    is_tracing = True
                num_prompt = int(rng.integers(args.min_prompt, max_prompt + 1))
                tokens = prompt_tokens(engine.tokenizer, num_prompt, seed=args.seed * 100_003 + index)
                started = time.perf_counter()
                generation = engine.generate(tokens, params)
                for _ in generation:
                    pass
                stats = generation.stats
                is_idle = dict(engine.ledger.snapshot().by_owner) == idle
                if growth is not None and index + 1 == trace_to:
                    growth_report = growth.report()  # now, so that a soak cut short still prints it
                    is_tracing = False
                    print(format_report(growth_report), flush=True)
                if trim is not None:
                    trim()
                num_not_idle += not is_idle
                row = {"request": index, "prompt_tokens": num_prompt, "generated_tokens": stats.generated_tokens,
                       "loan_taken": stats.loan.is_taken,
                       "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 1),
                       "decode_tokens_per_s": round(stats.decode_tokens_per_s, 1),
                       "seconds": round(time.perf_counter() - started, 3), "device_used_bytes": device_bytes(),
                       "ledger_bytes": sum(engine.ledger.snapshot().by_owner.values()), "rss_bytes": rss_bytes(),
                       "ledger_is_idle": is_idle, "is_traced": growth is not None and trace_from <= index < trace_to,
                       **memory_kinds(), **(heap() if heap is not None else {})}
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                print(f"{index:>4} {num_prompt:>7} {'on' if row['loan_taken'] else 'off':>5} "
                      f"{row['prefill_tokens_per_s']:>9.1f} {row['decode_tokens_per_s']:>9.1f} "
                      f"{row['device_used_bytes'] / 2**20:>11.1f} {row['rss_bytes'] / 2**20:>9.1f}"
                      + ("" if is_idle else "  ledger NOT idle"), flush=True)
    except KeyboardInterrupt:
        is_interrupted = True
        print(f"interrupted after {len(rows)} requests", file=sys.stderr)
    census_report, census_holders = None, None
    try:
        if census_from is not None and len(rows) > census_from:  # before the summary's own objects exist
            census_report = census.report(len(rows) - census_from)
            # what holds the two types that grew most, past the interpreter's own (a tuple or a dict says little)
            grown = [t["type"] for t in census_report if not t["type"].startswith("builtins.")][:2]
            census_holders = {name: census.holders(name) for name in grown}
        elif census is not None:
            print("--census: the soak ended before the census's first request; no census", file=sys.stderr)
        if is_tracing:  # cut inside the window
            growth_report = growth.report()
            print(format_report(growth_report), flush=True)
        if not rows:
            raise SystemExit("soak: no request finished")
        if len(rows) <= slope_from + 1:  # too few after the settling (and the traced window, whose rows never count)
            slope_from = trace_to if growth is not None else 0
        settled = rows[slope_from:]
        is_sloped = len(settled) >= 2  # else no slope says anything: the soak cannot pass
        summary = {"requests": len(rows), "settle": args.settle, "slope_from_request": slope_from,
                   "is_interrupted": is_interrupted, "backend": engine.backend,
                   "is_heap_trimmed": trim is not None,
                   "device_slope_bytes_per_request": _slope(settled, "device_used_bytes"),
                   "rss_slope_bytes_per_request": _slope(settled, "rss_bytes"),
                   "ledger_slope_bytes_per_request": _slope(settled, "ledger_bytes"),
                   "requests_not_idle": num_not_idle, "loans_taken": sum(r["loan_taken"] for r in rows)}
        for key in (*RSS_KIND_LABELS, "python_blocks", "heap_in_use_bytes", "heap_free_bytes", "heap_mmapped_bytes"):
            if key in rows[0]:
                summary[f"{key.removesuffix('_bytes')}_slope_{'bytes' if key.endswith('_bytes') else 'blocks'}"
                        f"_per_request"] = _slope(settled, key)
        if growth_report is not None:
            summary["python_growth"] = growth_report
        if census_report is not None:
            summary["census"], summary["census_from_request"] = census_report, census_from
            summary["census_holders"] = census_holders
            print(format_census(census_report, census_from, len(rows) - census_from), flush=True)
            print(format_holders(census_holders), flush=True)
        if out:
            out.write(json.dumps({"summary": summary}) + "\n")
    finally:
        if out:
            out.close()
        engine.close()
    limit = args.max_slope_kib * 1024
    if not is_sloped:
        print(f"soak failed: no slope: {len(settled)} request(s) from request {slope_from} on, of {len(rows)} "
              f"finished (a slope needs two after the settling and any traced window); send more requests "
              f"(--requests) or settle fewer (--settle); requests leaving the ledger not idle: {num_not_idle}",
              file=sys.stderr)
        return 1
    print(f"slope over requests {summary['slope_from_request']}..{len(rows) - 1}: device "
          f"{summary['device_slope_bytes_per_request'] / 1024:+.1f} KiB/request, RSS "
          f"{summary['rss_slope_bytes_per_request'] / 1024:+.1f} KiB/request, ledger "
          f"{summary['ledger_slope_bytes_per_request'] / 1024:+.1f} KiB/request; loans taken "
          f"{summary['loans_taken']}/{len(rows)}; requests leaving the ledger not idle: {num_not_idle}")
    kinds = [f"{label} {summary[key] / 1024:+.1f}" for label, key in
             ((RSS_KIND_LABELS[k], f"{k.removesuffix('_bytes')}_slope_bytes_per_request") for k in RSS_KIND_LABELS)
             if key in summary]
    if kinds:
        print(f"RSS slope by kind, KiB/request: {', '.join(kinds)}")
    print(f"the interpreter's allocated blocks: {summary['python_blocks_slope_blocks_per_request']:+.1f}/request")
    if heap is not None:
        print(f"C heap slope: in use {summary['heap_in_use_slope_bytes_per_request'] / 1024:+.1f} KiB/request, free "
              f"inside it {summary['heap_free_slope_bytes_per_request'] / 1024:+.1f}, mmapped blocks "
              f"{summary['heap_mmapped_slope_bytes_per_request'] / 1024:+.1f}")
    is_steady = max(summary["device_slope_bytes_per_request"], summary["rss_slope_bytes_per_request"]) <= limit
    if not is_steady or num_not_idle:
        print(f"soak failed: a slope above {args.max_slope_kib} KiB/request or a ledger not idle", file=sys.stderr)
        return 1
    return 0


def _slope(rows: list[dict], key: str) -> float | None:
    """``slope_bytes_per_request`` of the rows' ``key``; None for fewer than two rows."""
    return slope_bytes_per_request([r[key] for r in rows]) if len(rows) >= 2 else None


@contextlib.contextmanager
def _stop_on_terminate():
    """Yields is_stopping(): true once SIGTERM (a time limit's) came, so that the soak stops between requests,
    not inside one, and writes its summary."""
    received = []

    def remember(signum, frame):
        received.append(signum)
    try:
        previous = signal.signal(signal.SIGTERM, remember)
    except ValueError:  # not the main thread: leave SIGTERM as it is
        yield lambda: False
        return
    try:
        yield lambda: bool(received)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _device_meter(engine):
    """Device memory in use, measured by the driver on the cuda backend; elsewhere the ledger's total."""
    if engine.backend == "cuda":
        from strata.gpu.device import used_device_bytes

        device = engine.config.runtime.device
        return lambda: used_device_bytes(device)
    return lambda: sum(engine.ledger.snapshot().by_owner.values())

