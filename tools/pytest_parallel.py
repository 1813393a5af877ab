"""Run a pytest selection in several processes at once: ``python tools/pytest_parallel.py --jobs N [pytest args]``.

The GPU tests spend most of their time compiling kernels on the host, one process on one core; the machine
that runs them has many. This collects the selection's tests, deals them to N processes in turn (so each
compiles about 1/N of the kernels) and runs them side by side, each writing its log next to the others. It
exits with the first failing process's status, and with pytest's 5 when the selection holds no test: an
empty run never passes. Each job has a runtime directory of its own (``XDG_RUNTIME_DIR``, where the engine keeps
its one-loan-taker-per-GPU lock): the tests' loans lend budgets of a few MiB, which two jobs on one GPU cannot
take from each other, and a test of the lock starts its second process inside its own job.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

NO_TESTS = 5  # pytest's exit status when it collected nothing


def collect(pytest_args: list[str]) -> list[str]:
    """The node ids the selection holds, in pytest's order. The run's verbosity flags stay out: a second -q
    lists files, not node ids."""
    selection = [a for a in pytest_args if not re.fullmatch(r"-[qv]+|--quiet|--verbose", a)]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *selection], capture_output=True, text=True)
    if done.returncode not in (0, NO_TESTS):
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(done.returncode)
    return [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def deal(node_ids: list[str], num_jobs: int) -> list[list[str]]:
    """node_ids dealt to at most num_jobs groups in turn; no group empty."""
    groups = [node_ids[j::num_jobs] for j in range(num_jobs)]
    return [group for group in groups if group]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8, help="processes side by side (default 8)")
    parser.add_argument("--logs", type=Path, help="folder for each process's log (default: a new temporary one)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    node_ids = collect(pytest_args)
    if not node_ids:
        print("no tests collected", file=sys.stderr)
        return NO_TESTS
    logs = args.logs or Path(tempfile.mkdtemp(prefix="pytest-parallel-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    for j, group in enumerate(deal(node_ids, args.jobs)):
        log, runtime_dir = logs / f"job-{j}.log", logs / f"job-{j}-runtime"
        runtime_dir.mkdir(mode=0o700, exist_ok=True)
        env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)}
        with open(log, "w") as out:
            # the selection's arguments (paths, -k, -m) chose the ids; a job runs its ids alone
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *group]
            runs.append((log, len(group), subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)))
    status = 0
    for log, num_tests, run in runs:
        code = run.wait()
        lines = log.read_text().strip().splitlines()
        print(f"{log.name} ({num_tests} tests): {lines[-1] if lines else 'no output'}")
        status = status or code
    print(f"logs in {logs}")
    return status


if __name__ == "__main__":
    sys.exit(main())
