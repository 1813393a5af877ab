"""Copies queued on a stream, and events, called into libcuda through ctypes.

The decode step uploads a layer's [1, k] slot ids between its two captured segments, 48 times a
token. Numba's ``copy_to_device`` is synchronous for pageable memory and spends tens of
microseconds in Python; ``cuMemcpyHtoDAsync_v2`` from pinned memory, called through ctypes, costs
a few (the driver's own work) and lets the host go on while the copy waits behind the staged
experts. It acts on the calling thread's current context, which Numba has made current; stream 0
is the legacy default stream, where the kernels run. A decode token's id comes back the same way:
a 4-byte device-to-host copy into pinned memory and an event the host waits on (``Readback``
in ``strata.gpu.readback``).

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
        self._copy_out = lib.cuMemcpyDtoHAsync_v2
        self._copy_out.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._copy_out.restype = ctypes.c_int
        self._event_create = lib.cuEventCreate
        self._event_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._event_record = lib.cuEventRecord
        self._event_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._event_synchronize = lib.cuEventSynchronize
        self._event_synchronize.argtypes = [ctypes.c_void_p]
        self._event_destroy = lib.cuEventDestroy_v2
        self._event_destroy.argtypes = [ctypes.c_void_p]
        for call in (self._event_create, self._event_record, self._event_synchronize, self._event_destroy):
            call.restype = ctypes.c_int

    def copy_one(self, destination: int, source: int, num_bytes: int, stream: int) -> None:
        """``num_bytes`` from host address ``source`` to device address ``destination``, queued on ``stream``."""
        _check(self._copy(destination, source, num_bytes, stream), "a host-to-device copy")

    def copy_out(self, destination: int, source: int, num_bytes: int, stream: int) -> None:
        """``num_bytes`` from device address ``source`` to (pinned) host address ``destination``, queued."""
        _check(self._copy_out(destination, source, num_bytes, stream), "a device-to-host copy")

    def event_create(self) -> int:
        """A new event without timing (the cheapest to record and wait on)."""
        handle = ctypes.c_void_p()
        _check(self._event_create(ctypes.byref(handle), _EVENT_DISABLE_TIMING), "creating an event")
        return handle.value

    def event_record(self, event: int, stream: int) -> None:
        _check(self._event_record(event, stream), "recording an event")

    def event_synchronize(self, event: int) -> None:
        """Wait until the work enqueued before the event's last record has run."""
        _check(self._event_synchronize(event), "waiting for an event")

    def event_destroy(self, event: int) -> None:
        _check(self._event_destroy(event), "destroying an event")


_EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING


def _check(err: int, what: str) -> None:
    if err:
        raise EngineError(f"{what} failed: CUDA error {err}; check the GPU with nvidia-smi")


@functools.cache
def load() -> DriverCalls | None:
    try:
        return DriverCalls(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
