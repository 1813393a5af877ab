"""A bound on numba-cuda's memo of device-array layouts.

numba-cuda (0.30) memoizes ``dummyarray.Array.from_desc`` with an unbounded ``functools.cache``: every
(offset, shape, strides, itemsize) a device array was ever made with stays, with its ``Array``, ``Dim``
and ``Extent`` objects. A prefill chunk's arrays are shaped by its token count, so a server sees a new
set with nearly every prompt length: ~27 entries a request on the reference model, growing without end
(found by ``strata soak --census``). The memo only saves rebuilding a layout, and what it returned stays
valid when it is cleared, so past a bound it is cleared between requests (``CudaOps.trim_memory``).
The CUDA simulator has no such memo.
"""

from __future__ import annotations

MAX_ENTRIES = 4096  # ~150 requests of new lengths; a few MiB of layouts at most


def trim_descriptor_cache(max_entries: int = MAX_ENTRIES, layouts=None) -> int:
    """Clear numba-cuda's layout memo when it holds more than ``max_entries``; the entries dropped (0 where
    it holds fewer, or where there is no memo: the simulator, another numba-cuda). layouts: the module
    that defines ``Array`` (default numba-cuda's ``dummyarray``)."""
    if layouts is None:
        try:
            from numba.cuda.cudadrv import dummyarray as layouts
        except ImportError:  # no numba-cuda: nothing memoized
            return 0
    array_class = getattr(layouts, "Array", None)  # None in the simulator's stand-in module
    memo = getattr(vars(array_class).get("from_desc"), "__func__", None) if array_class is not None else None
    if memo is None or not hasattr(memo, "cache_info"):
        return 0
    num_entries = memo.cache_info().currsize
    if num_entries <= max_entries:
        return 0
    memo.cache_clear()
    return num_entries
