"""``python -m strata.bench.device_trace``: what the device does during decode, kernel by kernel.

The bench times a token; this says where its time goes. One process loads the engine, and for
each arm (plain decode, or speculation's fixed or auto policy, with the bench's draft oracle)
runs a request untraced (so captures and compilations are done) and then the same request with
its decode traced by PyTorch's profiler, which reads every kernel the process runs from CUPTI,
the kernels of replayed CUDA graphs included. Per arm it writes the trace (Chrome's JSON,
gzipped) and prints, per decoded token: each kernel's count and device time, the span, how much
of it some kernel ran (``busy``), the idle gaps and the kernels around them, the host's driver
calls and its marked work (graph replays, readbacks, a step's inputs), and the device time of
each phase (a plain step, a draft, a verify step: each phase starts and ends with a one-thread
marker kernel, and a kernel belongs to the phase whose markers the device ran it between). A
profile, not a benchmark: one process, the profiler's own overhead on the host.

Needs PyTorch (the reference GPU's image has it; it is no dependency of Strata's) and a GPU.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import functools
import gzip
import json
import re
import time
from pathlib import Path

import numpy as np

PHASE_PREFIX = "strata:"  # the marks of decode's phases in the trace (user annotations)
HOST_PREFIX = "strata-host:"  # the marks of the host's work inside them: graph replays, readbacks, a step's inputs
# one-thread kernels launched at the start and at the end of each mark: the device runs a replayed graph's
# kernels, which the profiler does not tie to the host call that launched them, between the markers of the
# phase that launched it
PHASE_MARKER, PHASE_END_MARKER = "phase_marker_kernel", "phase_end_kernel"
GAP_FLOOR_US = 5.0  # idle stretches shorter than this are a graph's launch latency, not a stall
_IDENTIFIER = re.compile(r"(\d+)")
_LOCALS = "_3clocals_3e"  # "<locals>", as Numba mangles it
_DEMANGLED = re.compile(r"^((?:\w+::)+\w+)(?:\[abi:\w+\])*(?:\(|$)")  # a::b::kernel[abi:..](args)
_NUMBA_SUFFIX = re.compile(r"(_24\d+|_2[0-9a-fA-F]{2})+$")  # "$241" and other escapes Numba mangles as _24...


def short_name(mangled: str) -> str:
    """A kernel's readable name from an Itanium-mangled one (Numba's ``_ZN6cudapy<module path>
    <function>...E``, or C++'s) or from one the profiler demangled (``strata::gpu::...::kernel[abi:..](..)``):
    its module and function (a factory's kernel: the factory's module and the kernel), Numba's ``$N``
    suffixes dropped; other names as they are."""
    if _DEMANGLED.match(mangled):
        names = _DEMANGLED.match(mangled).group(1).split("::")
        return _module_and_function([name for name in names if name != "cudapy"]) or mangled
    if not mangled.startswith("_ZN"):
        return mangled
    names, index = [], 3
    while index < len(mangled) and mangled[index].isdigit():
        length = _IDENTIFIER.match(mangled, index)
        size = int(length.group(1))
        start = length.end()
        names.append(mangled[start:start + size])
        index = start + size
    return _module_and_function([name for name in names if name != "cudapy"]) or mangled


def _module_and_function(names: list[str]) -> str:
    """'module.function' from a kernel's nested names (a factory's kernel: the factory's module and the kernel)."""
    if not names:
        return ""
    if _LOCALS in names:
        names = [names[names.index(_LOCALS) - 2], names[-1]] if names.index(_LOCALS) >= 2 else names[-1:]
    return ".".join(_NUMBA_SUFFIX.sub("", name) for name in names[-2:])


@dataclasses.dataclass
class KernelTime:
    name: str
    count: int = 0
    total_us: float = 0.0


@dataclasses.dataclass
class TraceSummary:
    num_kernels: int
    span_us: float  # first kernel's start to last kernel's end
    busy_us: float  # the union of the kernels' intervals
    kernels: list[KernelTime]  # by total time, longest first
    gaps: list[tuple[int, float, str, str]]  # (count, total µs, kernel before, kernel after), idle ≥ GAP_FLOOR_US
    host_calls: list[KernelTime]  # the host's runtime and driver calls by total time
    phases: list[tuple[str, int, float, int, float]]  # (phase, times marked, host µs, kernels, device µs)
    host_work: list[KernelTime] = dataclasses.field(default_factory=list)  # HOST_PREFIX marks by total time


def summarize(events: list[dict]) -> TraceSummary:
    """The summary of a Chrome trace's events (``traceEvents``): kernels are the events of category
    ``kernel``, host calls those of ``cuda_runtime`` and ``cuda_driver``; times in µs."""
    launched = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    kernels = [e for e in launched if not _is_marker(e)]
    if not kernels:
        raise ValueError("the trace holds no kernel: was the profiler's CUDA activity on, and did the GPU run?")
    by_name: dict[str, KernelTime] = {}
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    busy_us, end_us = 0.0, kernels[0]["ts"]
    previous = None
    for event in kernels:
        name = short_name(event["name"])
        entry = by_name.setdefault(name, KernelTime(name))
        entry.count += 1
        entry.total_us += event["dur"]
        start, finish = event["ts"], event["ts"] + event["dur"]
        if previous is not None and start - end_us >= GAP_FLOOR_US:
            gaps[(previous, name)].append(start - end_us)
        if finish > end_us:
            busy_us += finish - max(start, end_us)
            end_us = finish
        previous = name
    host: dict[str, KernelTime] = {}
    host_work: dict[str, KernelTime] = {}
    mark_at = _mark_at(_phase_marks(events))
    for event in events:
        is_call = event.get("cat") in ("cuda_runtime", "cuda_driver")
        is_work = event.get("cat") == "user_annotation" and event["name"].startswith(HOST_PREFIX)
        if is_call or is_work:
            mark = mark_at(event["ts"]) if is_work else None
            phase = "between phases" if mark is None else f"in {mark['name'][len(PHASE_PREFIX):]}"
            name = f"{event['name'][len(HOST_PREFIX):]} ({phase})" if is_work else event["name"]
            entry = (host_work if is_work else host).setdefault(name, KernelTime(name))
            entry.count += 1
            entry.total_us += event.get("dur", 0.0)
    gap_rows = sorted(((len(v), sum(v), before, after) for (before, after), v in gaps.items()), key=lambda g: -g[1])
    return TraceSummary(len(kernels), end_us - kernels[0]["ts"], busy_us,
                        sorted(by_name.values(), key=lambda k: -k.total_us), gap_rows,
                        sorted(host.values(), key=lambda k: -k.total_us), _phases(events, launched),
                        sorted(host_work.values(), key=lambda k: -k.total_us))


def _phase_marks(events: list[dict]) -> list[dict]:
    """The phase marks (user annotations named ``PHASE_PREFIX``...), by start time."""
    return sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(PHASE_PREFIX)),
                  key=lambda e: e["ts"])


def _mark_at(marks: list[dict]):
    """at(ts): the mark of ``marks`` (by start time) that holds the time ts, or None (marks do not nest: the last
    one begun before ts, if it had not ended)."""
    starts = [mark["ts"] for mark in marks]

    def at(ts: float) -> dict | None:
        index = bisect.bisect_right(starts, ts) - 1
        return marks[index] if index >= 0 and ts <= marks[index]["ts"] + marks[index]["dur"] else None
    return at


def _is_marker(kernel: dict) -> bool:
    return short_name(kernel["name"]).endswith((PHASE_MARKER, PHASE_END_MARKER))


def _phases(events: list[dict], kernels: list[dict]) -> list[tuple[str, int, float, int, float]]:
    """Each phase mark (a user annotation named ``PHASE_PREFIX``...): how often it was marked, its host time,
    and its kernels: those the device ran between the phase's start and end marker kernels (graphs' kernels
    included), or, in a trace without markers, those whose launch call lies inside the mark (their correlation
    id). ``kernels``: every kernel, by start time, markers included."""
    marks = _phase_marks(events)
    if not marks:
        return []
    launched_at = {e["args"]["correlation"]: e["ts"] for e in events
                   if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    mark_at = _mark_at(marks)
    rows: dict[str, list] = {}
    for mark in marks:
        row = rows.setdefault(mark["name"][len(PHASE_PREFIX):], [0, 0.0, 0, 0.0])
        row[0] += 1
        row[1] += mark["dur"]

    def holding(kernel: dict) -> list | None:
        """The row of the mark that holds the kernel's launch call."""
        at = launched_at.get(kernel.get("args", {}).get("correlation"))
        mark = mark_at(at) if at is not None else None
        return None if mark is None else rows[mark["name"][len(PHASE_PREFIX):]]

    outside = [0, 0.0, 0, 0.0]
    is_device_order = any(_is_marker(kernel) for kernel in kernels)
    current = outside
    for kernel in kernels:
        if is_device_order and _is_marker(kernel):
            is_start = short_name(kernel["name"]).endswith(PHASE_MARKER)
            current = (holding(kernel) or outside) if is_start else outside
            continue
        row = current if is_device_order else (holding(kernel) or outside)
        row[2] += 1
        row[3] += kernel["dur"]
    if outside[2]:
        rows["(outside the marks)"] = outside
    return [(name, *row) for name, row in rows.items()]


def format_summary(title: str, summary: TraceSummary, num_tokens: int, top: int = 25) -> str:
    """The summary as text, times per decoded token (``num_tokens``)."""
    per = max(num_tokens, 1)
    idle = summary.span_us - summary.busy_us
    lines = [f"## {title}: {num_tokens} tokens, {summary.num_kernels / per:.1f} kernels a token, span "
             f"{summary.span_us / per:.1f} µs a token, busy {summary.busy_us / per:.1f} "
             f"({summary.busy_us / max(summary.span_us, 1e-9):.0%}), idle {idle / per:.1f}",
             "| kernel | a token | µs a token | µs each | share of busy |", "| --- | ---: | ---: | ---: | ---: |"]
    for kernel in summary.kernels[:top]:
        lines.append(f"| {kernel.name} | {kernel.count / per:.1f} | {kernel.total_us / per:.1f} | "
                     f"{kernel.total_us / kernel.count:.1f} | {kernel.total_us / max(summary.busy_us, 1e-9):.1%} |")
    lines += ["", f"idle stretches ≥ {GAP_FLOOR_US:.0f} µs, by the kernels around them:",
              "| a token | µs a token | before | after |", "| ---: | ---: | --- | --- |"]
    for count, total, before, after in summary.gaps[:10]:
        lines.append(f"| {count / per:.1f} | {total / per:.1f} | {before} | {after} |")
    if summary.phases:
        lines += ["", "phases (a kernel in the phase whose marker kernel the device ran last before it):",
                  "| phase | times | host µs each | kernels each | device µs each |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, count, host_us, num_kernels, device_us in summary.phases:
            each = max(count, 1)
            lines.append(f"| {name} | {count} | {host_us / each:.1f} | {num_kernels / each:.1f} | "
                         f"{device_us / each:.1f} |")
    if summary.host_work:
        lines += ["", "the host's marked work, by the phase that holds it (under the profiler, which records every "
                  "kernel a graph replays: an untraced replay cost 5-25 µs on an H100, tools/graph_launch_cost.py):",
                  "| what | a token | µs a token | µs each |", "| --- | ---: | ---: | ---: |"]
        for work in summary.host_work:
            lines.append(f"| {work.name} | {work.count / per:.1f} | {work.total_us / per:.1f} | "
                         f"{work.total_us / max(work.count, 1):.1f} |")
    lines += ["", "host calls:", "| call | a token | µs a token |", "| --- | ---: | ---: |"]
    for call in summary.host_calls[:10]:
        lines.append(f"| {call.name} | {call.count / per:.1f} | {call.total_us / per:.1f} |")
    return "\n".join(lines)


@contextlib.contextmanager
def marked_phases(launch_markers=(lambda: None, lambda: None)):
    """While open, decode's phases are marked in a PyTorch trace: each plain greedy step's launch, each draft
    and each verify step's launch of device speculation, and each chained step's (draft and verify) launch
    (``PHASE_PREFIX`` + plain, draft, verify, chained: a verify mark's host time leaves out the wait for its picks,
    read after the next step is launched where it runs ahead); each
    mark calls ``launch_markers[0]()`` first and ``[1]()`` last (``device_markers``: the phase's start and end on
    the device). Inside and between them, the host's work is marked too (``HOST_PREFIX`` + graph replay, readback,
    step inputs, speculation's read), so a phase's host time splits into its parts."""
    from torch.profiler import record_function

    from strata.engine.decode import device_speculation, speculative, step
    from strata.gpu import graphs, readback

    def marked(owner, name, mark, markers=None):
        """owner.name, wrapped in the mark (and between the phase's marker launches, where given); returns what
        puts the original back."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def in_mark(*args, **kwargs):
            with record_function(mark):
                if markers is None:
                    return fn(*args, **kwargs)
                markers[0]()
                try:
                    return fn(*args, **kwargs)
                finally:
                    markers[1]()
        setattr(owner, name, in_mark)
        return owner, name, fn

    speculation = device_speculation.DeviceSpeculation
    originals = [marked(step, "_launch", PHASE_PREFIX + "plain", launch_markers),
                 marked(speculation, "draft", PHASE_PREFIX + "draft", launch_markers),
                 # ``verify`` launches through it
                 marked(speculation, "launch_verify", PHASE_PREFIX + "verify", launch_markers),
                 marked(speculation, "launch_chained", PHASE_PREFIX + "chained", launch_markers),  # draft and verify
                 marked(graphs.GraphSegment, "replay", HOST_PREFIX + "graph replay"),
                 marked(readback.Readback, "now", HOST_PREFIX + "readback (now)"),
                 marked(readback.Readback, "read", HOST_PREFIX + "readback (ticket)"),
                 marked(readback.Readback, "read_record", HOST_PREFIX + "readback (record)"),
                 marked(step.DecodeStep, "_begin", HOST_PREFIX + "step inputs"),
                 marked(speculative.Speculation, "_read", HOST_PREFIX + "speculation's read and compare")]
    try:
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def device_markers():
    """Launchers of the phases' start and end marker kernels (one thread, no work) on the legacy default
    stream, which orders them with the engine's kernels and graph replays."""
    from numba import cuda

    @cuda.jit
    def phase_marker_kernel(flag):
        if cuda.grid(1) == 0:
            flag[0] += 1

    @cuda.jit
    def phase_end_kernel(flag):
        if cuda.grid(1) == 0:
            flag[0] -= 1

    flag = cuda.to_device(np.zeros(1, np.int32))
    for kernel in (phase_marker_kernel, phase_end_kernel):
        kernel[1, 1](flag)  # compiled here, outside the trace
    cuda.synchronize()
    return lambda: phase_marker_kernel[1, 1](flag), lambda: phase_end_kernel[1, 1](flag)


def _traced_decode(engine, tokens: list[int], params, oracle, path: Path) -> tuple[list[dict], int]:
    """Run the request; trace from its first token (prefill untraced) to its end; write the trace to ``path``
    (gzipped) and return its events and the tokens decoded while traced."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    events = iter(engine.generate(tokens, params, draft_oracle=oracle))
    next(event for event in events if event.token_id >= 0)  # the prefill's token
    markers = device_markers()
    torch.cuda.synchronize()
    with marked_phases(markers), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        num_tokens = sum(1 for event in events if event.token_id >= 0)
        torch.cuda.synchronize()
    raw = path.with_suffix("")  # the profiler writes plain JSON
    profiler.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(path, "wt") as out:
        json.dump(trace, out)
    raw.unlink()
    return trace["traceEvents"], num_tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata.bench.device_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--spec", default="off", help="comma-separated arms: off, fixed, fixed-N, auto (default off)")
    parser.add_argument("--draft-oracle", type=float, default=None, metavar="P",
                        help="the bench's draft oracle for the speculative arms (strata bench --draft-oracle)")
    parser.add_argument("--loan", choices=("on", "off"), default="off")
    parser.add_argument("--out", type=Path, required=True, help="folder for each arm's trace (ARM.json.gz)")
    args = parser.parse_args(argv)
    arms = [arm.strip() for arm in args.spec.split(",") if arm.strip()]
    from strata.bench.one_run import spec_mode

    for arm in arms:
        try:
            spec_mode(arm)
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
        if arm == "config":
            parser.error("--spec takes off, fixed, fixed-N and auto here (config: name the configured policy)")
    try:
        import torch
    except ImportError:
        parser.error("the trace is read through PyTorch's profiler: install torch (no dependency of Strata's)")
    from strata.bench.draft_oracle import DraftOracle
    from strata.bench.one_run import bench_config, prompt_tokens, set_speculation
    from strata.engine.facade import Engine
    from strata.engine.sampling import SamplingParams

    torch.cuda.init()  # the same primary context Numba uses
    engine = Engine.load(bench_config(args.config, args.loan == "on"), show_progress=False)
    tokens = prompt_tokens(engine.tokenizer, args.prompt_tokens, seed=0)
    banned = {t: float("-inf") for t in engine.tokenizer.eog_ids}
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, logit_bias=banned, seed=0)
    args.out.mkdir(parents=True, exist_ok=True)
    mtp, reports = engine.mtp, []
    for arm in arms:
        engine.mtp = mtp
        set_speculation(engine, arm)
        oracle = None
        if args.draft_oracle is not None and arm != "off":
            oracle = DraftOracle(None, len(tokens), args.draft_oracle, engine.spec.vocab_size, seed=0)
        for _ in engine.generate(tokens, params, draft_oracle=oracle):  # captures and compilations, untraced
            pass
        if oracle is not None:
            oracle = DraftOracle(None, len(tokens), args.draft_oracle, engine.spec.vocab_size, seed=0)
        started = time.perf_counter()
        events, num_tokens = _traced_decode(engine, tokens, params, oracle, args.out / f"{arm}.json.gz")
        title = f"{arm}{'' if oracle is None else f', draft oracle {args.draft_oracle}'} (traced decode "
        reports.append(format_summary(f"{title}{time.perf_counter() - started:.2f} s)", summarize(events),
                                      num_tokens))
    engine.close()
    print("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
