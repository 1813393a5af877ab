"""What the host's CPUs did while a bench request ran: the machine's busy and stolen shares, this
process's own CPU time and context switches, and its threads' CPU time (which of them besides the
engine's was busy: a helper spinning beside the engine's thread slows it).

A short prefill and decode are bound by the Python that issues them, and fresh processes of one build
have run it 1.5-2x apart (docs/PERFORMANCE.md). Time stolen by a hypervisor, other processes busy on the
machine, or this process waiting for a CPU (involuntary switches) each slow every function alike; a
bench row records them so that a slow process can be told apart from a slow build. The machine's
shares come from ``/proc/stat`` (Linux); elsewhere the record has the process's figures alone.

A fixed pure-Python workload timed before and after the request (``speed_probe``) tells a process whose
interpreter runs slowly on the CPU it was given from one whose engine does more work: on a machine of
shared virtual CPUs the same build's per-token host time has differed ~2x between processes. The same
workload on each CPU the process may use (``cpu_speeds``) shows whether the CPUs differ, and ``pin``
(``bench --host-cpu``) runs the request's thread on the fastest or a chosen one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import resource
import time
from pathlib import Path

from strata.errors import ConfigError

_STAT = Path("/proc/stat")
_THREAD_STAT = Path("/proc/thread-self/stat")
_TASKS = Path("/proc/self/task")
_UTIME_FIELD, _STIME_FIELD = 11, 12  # /proc/*/stat's fields 14 and 15, counted after the ")"
_MIN_THREAD_SECONDS = 0.01  # threads busier than this over the request are listed
_PROCESSOR_FIELD = 36  # /proc/*/stat's field 39, counted after the ")" closing the command name
_PROBE_KEYS = 1024  # the workload's dict stays in the L1/L2 caches: it times the interpreter, not memory
_PROBE_ITEMS = 40_000
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal (guest time is inside user)
_BUSY_FIELDS = (0, 1, 2, 5, 6)
_IDLE_FIELDS = (3, 4)
_STEAL_FIELD = 7


@dataclasses.dataclass(frozen=True)
class CpuSnapshot:
    seconds: float
    machine_ticks: tuple[int, ...] | None  # /proc/stat's aggregate cpu line, None where unreadable
    process_seconds: float
    involuntary_switches: int
    voluntary_switches: int
    thread_seconds: dict[int, tuple[str, float]] = dataclasses.field(default_factory=dict)  # tid -> (name, CPU s)


def snapshot(stat_text: str | None = None, tasks: Path = _TASKS) -> CpuSnapshot:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return CpuSnapshot(time.perf_counter(), _machine_ticks(stat_text), usage.ru_utime + usage.ru_stime,
                       usage.ru_nivcsw, usage.ru_nvcsw, thread_seconds(tasks))


def thread_seconds(tasks: Path = _TASKS) -> dict[int, tuple[str, float]]:
    """{tid: (name, CPU seconds, user + system)} of each thread of this process (the main thread's tid
    is the process id); {} where unreadable (not Linux)."""
    ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    threads = {}
    try:
        entries = list(tasks.iterdir())
    except OSError:
        return {}
    for entry in entries:
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            name = (entry / "comm").read_text().strip()
            seconds = (int(fields[_UTIME_FIELD]) + int(fields[_STIME_FIELD])) / ticks_per_s
            threads[int(entry.name)] = (name, seconds)
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return threads


def between(before: CpuSnapshot, after: CpuSnapshot) -> dict:
    """The interval's record: machine busy and steal shares (of all CPUs' time), this process's CPU
    seconds and its share of the wall time, its context switches, and the CPU seconds of each of its
    threads busy for ``_MIN_THREAD_SECONDS`` or more ("name[tid]", busiest first)."""
    wall = max(after.seconds - before.seconds, 1e-9)
    record = {"wall_seconds": wall, "process_cpu_seconds": after.process_seconds - before.process_seconds,
              "involuntary_switches": after.involuntary_switches - before.involuntary_switches,
              "voluntary_switches": after.voluntary_switches - before.voluntary_switches}
    busy = {f"{name}[{tid}]": seconds - before.thread_seconds.get(tid, ("", 0.0))[1]  # by tid: a thread may rename
            for tid, (name, seconds) in after.thread_seconds.items()}
    record["thread_seconds"] = dict(sorted(((n, round(s, 3)) for n, s in busy.items() if s >= _MIN_THREAD_SECONDS),
                                           key=lambda item: -item[1]))
    record["process_cpu_share"] = record["process_cpu_seconds"] / wall
    if before.machine_ticks and after.machine_ticks:
        delta = [b - a for a, b in zip(before.machine_ticks, after.machine_ticks)]
        total = sum(delta[:8]) or 1
        record["machine_busy_share"] = sum(delta[i] for i in _BUSY_FIELDS) / total
        record["machine_steal_share"] = delta[_STEAL_FIELD] / total
    return record


def summary(record: dict) -> str:
    machine = ""
    if "machine_busy_share" in record:
        machine = (f"machine busy {record['machine_busy_share']:.0%} of all CPUs, stolen "
                   f"{record['machine_steal_share']:.1%}; ")
    probe = ""
    if "probe_seconds" in record:
        before, after = (f"{1e3 * seconds:.2f}" for seconds in record["probe_seconds"])
        cpus = " / ".join("?" if cpu is None else str(cpu) for cpu in record["cpus"])
        probe = f"; interpreter probe {before} / {after} ms before / after, on CPU {cpus}"
    if "cpu_speeds" in record:
        probe += f"; per-CPU probe {speeds_summary(record['cpu_speeds'])}"
    if record.get("pinned_cpu") is not None:
        probe += f", pinned to CPU {record['pinned_cpu']}"
    if record.get("thread_seconds"):
        busy = record["thread_seconds"].items()
        probe += "; threads: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in busy)
    return (f"host CPU over the request: {machine}this process {record['process_cpu_seconds']:.2f} s of CPU "
            f"in {record['wall_seconds']:.2f} s, {record['involuntary_switches']} involuntary switches{probe}")


def speed_probe(num_repeats: int = 5) -> float:
    """Seconds of the fastest of ``num_repeats`` runs of a fixed pure-Python workload (~3 ms on a fast
    core): this interpreter's speed on the CPU it runs on now, comparable between processes of one build."""
    best = math.inf
    for _ in range(num_repeats):
        started = time.perf_counter()
        _workload()
        best = min(best, time.perf_counter() - started)
    return best


def cpu_speeds(num_repeats: int = 3) -> dict[int, float]:
    """``speed_probe`` on each CPU the calling thread may run on, {cpu: seconds}; the thread may run
    anywhere it could before afterwards, and is back on the CPU it started on (a busy thread stays where
    it is put: left on the last CPU probed, every request would run there). Empty where the platform
    cannot pin a thread (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return {}
    allowed, started_on = os.sched_getaffinity(0), current_cpu()
    speeds = {}
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})
            speeds[cpu] = speed_probe(num_repeats)
    finally:
        if started_on in allowed:
            os.sched_setaffinity(0, {started_on})
        os.sched_setaffinity(0, allowed)
    return speeds


def choice(text: str) -> str:
    """``--host-cpu``'s value, checked: any, fastest or a CPU number."""
    if text in ("any", "fastest") or (text.isascii() and text.isdecimal()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: choose any, fastest or a CPU number")


def pin(wanted: str, speeds: dict[int, float]) -> int | None:
    """Pin the calling thread as ``wanted`` says: "any" leaves it free (None), "fastest" pins it to the
    CPU of ``speeds`` with the shortest probe, a number to that CPU; the CPU pinned to."""
    if wanted == "any":
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("pinning the host thread to a CPU needs Linux; use --host-cpu any")
    if wanted == "fastest":
        if not speeds:
            raise ConfigError("no CPU was probed; use --host-cpu any")
        cpu = min(speeds, key=speeds.__getitem__)
    else:
        cpu = int(wanted)
        if cpu not in os.sched_getaffinity(0):
            raise ConfigError(f"--host-cpu {cpu}: this process may run on CPUs {sorted(os.sched_getaffinity(0))}")
    os.sched_setaffinity(0, {cpu})
    return cpu


def speeds_summary(speeds: dict[int, float]) -> str:
    """The spread of the per-CPU probes: "2.91-5.80 ms over 16 CPUs (fastest 3, slowest 12)"."""
    if not speeds:
        return "no per-CPU probe"
    fastest, slowest = min(speeds, key=speeds.__getitem__), max(speeds, key=speeds.__getitem__)
    return (f"{1e3 * speeds[fastest]:.2f}-{1e3 * speeds[slowest]:.2f} ms over {len(speeds)} CPUs "
            f"(fastest {fastest}, slowest {slowest})")


def current_cpu(stat_text: str | None = None) -> int | None:
    """The CPU the calling thread last ran on (Linux), or None where unreadable."""
    try:
        text = _THREAD_STAT.read_text() if stat_text is None else stat_text
        return int(text.rsplit(")", 1)[1].split()[_PROCESSOR_FIELD])
    except (OSError, IndexError, ValueError):
        return None


def _workload() -> int:
    counts: dict[int, int] = {}
    for i in range(_PROBE_ITEMS):
        key = i % _PROBE_KEYS
        counts[key] = counts.get(key, 0) + i
    return sum(counts.values())


def _machine_ticks(stat_text: str | None) -> tuple[int, ...] | None:
    try:
        text = _STAT.read_text() if stat_text is None else stat_text
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu" and len(fields) >= 9:
            return tuple(int(x) for x in fields[1:9])
    return None
