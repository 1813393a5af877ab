"""What the host's CPUs did while a bench request ran: the machine's busy and stolen shares, and this
process's own CPU time and context switches.

A short prefill and decode are bound by the Python that issues them, and fresh processes of one build
have run it 1.5-2x apart (docs/PERFORMANCE.md). Time stolen by a hypervisor, other processes busy on the
machine, or this process waiting for a CPU (involuntary switches) each slow every function alike; a
bench row records them so that a slow process can be told apart from a slow build. The machine's
shares come from ``/proc/stat`` (Linux); elsewhere the record has the process's figures alone.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from pathlib import Path

_STAT = Path("/proc/stat")
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


def snapshot(stat_text: str | None = None) -> CpuSnapshot:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return CpuSnapshot(time.perf_counter(), _machine_ticks(stat_text), usage.ru_utime + usage.ru_stime,
                       usage.ru_nivcsw, usage.ru_nvcsw)


def between(before: CpuSnapshot, after: CpuSnapshot) -> dict:
    """The interval's record: machine busy and steal shares (of all CPUs' time), this process's CPU
    seconds and its share of the wall time, and its context switches."""
    wall = max(after.seconds - before.seconds, 1e-9)
    record = {"wall_seconds": wall, "process_cpu_seconds": after.process_seconds - before.process_seconds,
              "involuntary_switches": after.involuntary_switches - before.involuntary_switches,
              "voluntary_switches": after.voluntary_switches - before.voluntary_switches}
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
    return (f"host CPU over the request: {machine}this process {record['process_cpu_seconds']:.2f} s of CPU "
            f"in {record['wall_seconds']:.2f} s, {record['involuntary_switches']} involuntary switches")


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
