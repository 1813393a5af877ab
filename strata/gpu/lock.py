"""An advisory lock per GPU, held for the life of the process: one loan-taker per device.

A process whose configuration can take prefill VRAM loans releases decode memory during every
prefill and expects to find it free again before decode. Two such processes on one GPU would take
each other's memory in between, so the second one refuses to start. The lock is ``flock`` on a file
named after the device in a runtime directory: the kernel drops it when the process ends, however
it ends, so a crashed holder leaves nothing to clean up. The file holds the holder's pid, for the
refusal's message.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
from pathlib import Path

from strata.errors import DeviceLockError

_HELD: dict[Path, int] = {}  # lock file → its descriptor, open until the process exits
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def default_lock_dir() -> Path:
    """``$XDG_RUNTIME_DIR/strata``, or ``<tmp>/strata-<uid>`` where there is no runtime directory."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return Path(runtime_dir) / "strata"
    return Path(tempfile.gettempdir()) / f"strata-{os.getuid()}"


def lock_path(identity: str, directory: Path) -> Path:
    return directory / f"loan-taker-{_UNSAFE.sub('_', identity)}.lock"


def hold_device_lock(identity: str, directory: Path, fix: str) -> Path:
    """Take the lock of device ``identity`` for this process (again: a no-op), or raise
    ``DeviceLockError`` naming the process that holds it and ``fix``. Returns the lock file."""
    path = lock_path(identity, directory)
    if path in _HELD:
        return path
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise DeviceLockError(f"cannot create the loan-taker lock {path} ({exc.strerror or exc}); set "
                              "runtime.lock_dir to a writable directory") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise DeviceLockError(f"process {holder} already takes prefill VRAM loans on GPU {identity} (lock {path}); "
                              f"two loan-takers on one GPU would take each other's released memory: {fix}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _HELD[path] = fd
    return path


def release_device_lock(path: Path) -> None:
    """Give the lock back before the process ends (tests; a process that stops taking loans)."""
    fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor of the open file drops the flock


def _read_holder(fd: int) -> str:
    """The pid the holder wrote; it writes it just after taking the lock, so it may not be there yet."""
    text = os.pread(fd, 64, 0).decode("ascii", errors="replace").strip()
    return text if text.isdigit() else "(pid not yet written)"
