"""Arms run in fresh processes, interleaved, and the figures the tables take from their runs.

An arm is a configuration file and a way to start ``strata.bench.one_run`` on it (this
interpreter, another one, or through a wrapper module). Arms are interleaved per repetition, as
``strata bench`` does: the first process after the GPU has idled runs slower, and it must not
always be the same arm's.
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

from strata.bench.harness import ONE_RUN, run_fresh
from strata.errors import ExperimentError


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str  # the runs' "arm" field
    label: str  # the table's Configuration column
    config: Path  # the arm's TOML file
    loan: str = "off"  # one_run's --loan: "on" runs the config as written, "off" with loan.enabled = false
    python: str = sys.executable
    launcher: tuple[str, ...] = ONE_RUN

    def describe(self) -> dict:
        return {"name": self.name, "label": self.label, "config": str(self.config), "loan": self.loan,
                "command": " ".join([self.python, *self.launcher])}


def run_interleaved(arms: Sequence[Arm], lengths: Sequence[int], reps: int, gen_tokens: int, timeout: float,
                    record: Callable[[dict], None]) -> None:
    """Every arm at every length, ``reps`` fresh processes each, arms interleaved per repetition;
    ``record`` gets each run's figures with its arm and repetition as it ends."""
    for length in lengths:
        for rep in range(reps):
            for arm in arms:
                record({**run_arm(arm, length, gen_tokens, rep, timeout), "arm": arm.name, "rep": rep + 1})


def run_arm(arm: Arm, length: int, gen_tokens: int, rep: int, timeout: float) -> dict:
    try:
        result = run_fresh(str(arm.config), length, gen_tokens, arm.loan, rep, timeout, python=arm.python,
                           launcher=arm.launcher)
    except subprocess.TimeoutExpired as exc:
        raise ExperimentError(f"arm {arm.name!r} at {length:,} prompt tokens ran past --timeout {timeout:g} s; "
                              "raise --timeout") from exc
    except RuntimeError as exc:
        raise ExperimentError(f"arm {arm.name!r} at {length:,} prompt tokens failed: {exc}") from exc
    print(f"[{arm.name} {length:,} #{rep + 1}] {result['timing_line']}", file=sys.stderr, flush=True)
    return result


def select(runs: Iterable[dict], **fields) -> list[dict]:
    return [r for r in runs if all(r.get(k) == v for k, v in fields.items())]


def plans(runs: Iterable[dict]) -> list[str]:
    """The distinct plans (chunk / ring) of ``runs``, as the tables write them."""
    return sorted({f"{r['chunk_tokens']:,} / {r['ring_slots']}" for r in runs})


def figures(runs: Sequence[dict], key: str) -> dict:
    """Median, least and greatest of ``key`` over ``runs`` (zeros without a run)."""
    values = [r[key] for r in runs]
    if not values:
        return {"median": 0.0, "min": 0.0, "max": 0.0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_range(f: dict) -> str:
    return f"{f['median']:,.1f} ({f['min']:,.1f}–{f['max']:,.1f})"


def spread(f: dict) -> float:
    """The range over the median: the noise one arm's runs show."""
    return (f["max"] - f["min"]) / f["median"] if f["median"] else 0.0


def change(new: float, base: float) -> float:
    return new / base - 1.0 if base else 0.0


def percent(value: float) -> str:
    return f"{value:+.1%}".replace("-", "−")


def is_loan_taken(run: dict) -> bool:
    return run.get("loan_summary", "").startswith("loan on")
