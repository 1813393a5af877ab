"""Which code a benchmark ran: the commit of the ``strata`` package it imported, and where from.

``python -m`` puts the working directory ahead of ``PYTHONPATH``, so an A/B that points
``PYTHONPATH`` at an older copy but runs from the repository root measures the working tree twice.
The benchmarks print this line so that each arm shows what it ran.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import strata


def code_identity(package_dir: Path | None = None) -> str:
    """``strata <commit>[+changes] at <folder>``; the folder alone outside a git checkout (a copy)."""
    folder = Path(package_dir or Path(strata.__file__).parent).resolve()

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # a copy inside another checkout (an ignored folder) is not that checkout's code
    commit = git("rev-parse", "--short", "HEAD") if git("ls-files", "--", "__init__.py") else None
    if not commit:
        return f"strata at {folder} (not a git checkout)"
    changes = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return f"strata {commit}{'+changes' if changes else ''} at {folder}"


def device_name(backend: str, ordinal: int = 0) -> str:
    """The device a run ran on: the GPU's name on the cuda backend (call it where the run made its
    CUDA context), else the backend's name."""
    if backend != "cuda":
        return f"{backend} backend, no GPU"
    from numba import cuda

    try:
        name = cuda.gpus[ordinal].name
    except (AttributeError, IndexError):  # a label: never the reason a benchmark fails
        return f"CUDA device {ordinal}"
    return name.decode() if isinstance(name, bytes) else str(name)
