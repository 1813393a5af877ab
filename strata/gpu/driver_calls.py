"""A host-to-device copy queued on a stream, called into libcuda through ctypes.

The decode step uploads a layer's [1, k] slot ids between its two captured segments, 48 times a
token. Numba's ``copy_to_device`` is synchronous for pageable memory and spends tens of
microseconds in Python; ``cuMemcpyHtoDAsync_v2`` from pinned memory, called through ctypes, costs
a few (the driver's own work) and lets the host go on while the copy waits behind the staged
experts. It acts on the calling thread's current context, which Numba has made current; stream 0
is the legacy default stream, where the kernels run.

``load()`` returns None where libcuda cannot be opened (no driver, another OS).
"""

from __future__ import annotations

import ctypes
import functools

from strata.errors import EngineError


class DriverCalls:
    def __init__(self, lib: ctypes.CDLL):
        self._copy = lib.cuMemcpyHtoDAsync_v2
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int

    def copy_one(self, destination: int, source: int, num_bytes: int, stream: int) -> None:
        """``num_bytes`` from host address ``source`` to device address ``destination``, queued on ``stream``."""
        err = self._copy(destination, source, num_bytes, stream)
        if err:
            raise EngineError(f"a host-to-device copy failed: CUDA error {err}; check the GPU with nvidia-smi")


@functools.cache
def load() -> DriverCalls | None:
    try:
        return DriverCalls(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
