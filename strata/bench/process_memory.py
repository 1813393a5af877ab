"""The process's memory as the soak reads it after each request: RSS, RSS by kind, the C heap, and the
interpreter's live blocks. Which of them an RSS slope follows says where the growth lives:

- RSS by kind (Linux ``/proc/self/status``): anonymous memory (heaps, the interpreter's arenas, the
  driver's private mappings), file-backed pages (mapped files, libraries), shared memory; where the
  status file has no such lines (some sandboxed kernels), ``/proc/self/statm``'s resident and shared
  pages: anonymous, and file-backed or shared;
- the C heap (glibc's mallinfo2): bytes in use grow with a leak through malloc, free bytes with
  fragmentation ``malloc_trim`` cannot return, neither with growth outside malloc;
- the interpreter's allocated blocks (``sys.getallocatedblocks``): objects kept alive, whichever
  allocator holds them.
"""

from __future__ import annotations

import ctypes
import os
import sys

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_STATUS_KINDS = {"RssAnon:": "rss_anon_bytes", "RssFile:": "rss_file_bytes", "RssShmem:": "rss_shmem_bytes"}
# every key ``rss_kinds`` may give -> what a report calls it (the last: statm's, where the status file has none)
RSS_KIND_LABELS = {"rss_anon_bytes": "anonymous", "rss_file_bytes": "file-backed", "rss_shmem_bytes": "shared",
                   "rss_file_or_shared_bytes": "file-backed or shared"}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def rss_kinds(status_path: str = "/proc/self/status", statm_path: str = "/proc/self/statm") -> dict[str, int]:
    """{rss_anon_bytes, rss_file_bytes, rss_shmem_bytes} from the kernel's status file, else
    {rss_anon_bytes, rss_file_or_shared_bytes} from statm; {} where neither can be read."""
    kinds = {}
    try:
        with open(status_path) as f:
            for line in f.read().splitlines():
                fields = line.split()
                if fields and fields[0] in _STATUS_KINDS and len(fields) >= 2 and fields[1].isdecimal():
                    kinds[_STATUS_KINDS[fields[0]]] = int(fields[1]) * 1024  # the file says kB
    except OSError:
        pass
    if kinds:
        return kinds
    try:
        with open(statm_path) as f:
            resident, shared = (int(x) for x in f.read().split()[1:3])
    except (OSError, ValueError):
        return {}
    return {"rss_anon_bytes": (resident - shared) * PAGE_BYTES, "rss_file_or_shared_bytes": shared * PAGE_BYTES}


def memory_kinds() -> dict[str, int]:
    """RSS by kind and the interpreter's allocated blocks, one reading."""
    return {**rss_kinds(), "python_blocks": sys.getallocatedblocks()}


def heap_trimmer():
    """glibc's malloc_trim(0) as a function, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (2.33+): every arena's totals
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_meter():
    """A function giving the C heap's bytes in use, free inside it, and in mmapped blocks (glibc's
    mallinfo2), or None where the C library has none."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.argtypes, mallinfo2.restype = [], _MallInfo2

    def measure() -> dict[str, int]:
        info = mallinfo2()
        return {"heap_in_use_bytes": info.uordblks, "heap_free_bytes": info.fordblks,
                "heap_mmapped_bytes": info.hblkhd}
    return measure
