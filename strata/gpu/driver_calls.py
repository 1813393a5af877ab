"""Copies queued on a stream, streams and events, called into libcuda through ctypes.

The decode step uploads a layer's [1, k] slot ids between its two captured segments, 48 times a
token. Numba's ``copy_to_device`` is synchronous for pageable memory and spends tens of
microseconds in Python; ``cuMemcpyHtoDAsync_v2`` from pinned memory, called through ctypes, costs
a few (the driver's own work) and lets the host go on while the copy waits behind the staged
experts. It acts on the calling thread's current context, which Numba has made current; stream 0
is the legacy default stream, where the kernels run. A decode token's id comes back the same way:
a 4-byte device-to-host copy into pinned memory and an event the host waits on (``Readback``
in ``strata.gpu.readback``).

Expert staging goes the same way: a batch of host-to-device DMAs (one per expert plane) is one
``cuMemcpyBatchAsync`` call over address arrays the caller already holds, between an event
record and a stream wait, so its host cost is the driver's own work and no Python object is made
per copy. Only the CUDA 13 form of the call is bound; with an older driver each DMA is a call.

``load()`` returns None where libcuda cannot be opened (no driver, another OS).
"""

from __future__ import annotations

import ctypes
import functools

from strata.errors import EngineError


def host_address(array) -> int:
    """The address of a host array's first byte: ``array.ctypes.data``, at a third of its cost where the
    array is writable (a ctypes view of its buffer; ``.ctypes`` builds a helper object each time). The
    staging path asks for a few a layer, ~80 times a decoded token."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):  # read-only, or a buffer ctypes cannot view (empty, not contiguous)
        return array.ctypes.data


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes (cuda.h, CUDA 12.8+)
    _fields_ = [("src_access_order", ctypes.c_int), ("src_location_hint", _MemLocation),
                ("dst_location_hint", _MemLocation), ("flags", ctypes.c_uint)]


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
        self._stream_create = lib.cuStreamCreate
        self._stream_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._stream_wait_event = lib.cuStreamWaitEvent
        self._stream_wait_event.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._stream_destroy = lib.cuStreamDestroy_v2
        self._stream_destroy.argtypes = [ctypes.c_void_p]
        for call in (self._event_create, self._event_record, self._event_synchronize, self._event_destroy,
                     self._stream_create, self._stream_wait_event, self._stream_destroy):
            call.restype = ctypes.c_int
        # the CUDA 13 signature (no failure index); a driver without it copies one DMA per call
        self._copy_batch = getattr(lib, "cuMemcpyBatchAsync_v2", None)
        if self._copy_batch is not None:
            self._copy_batch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            self._copy_batch.restype = ctypes.c_int
        # every copy of a batch reads its source in stream order (the pinned slot may be rewritten
        # once the copy stream has passed it)
        self._batch_attributes = _MemcpyAttributes(src_access_order=_SRC_ACCESS_ORDER_STREAM)
        self._batch_attribute_index = (ctypes.c_size_t * 1)(0)

    @property
    def can_copy_batch(self) -> bool:
        return self._copy_batch is not None

    def copy_batch(self, destinations, sources, sizes, stream: int) -> int:
        """Queue ``sizes[i]`` bytes from host ``sources[i]`` to device ``destinations[i]`` on
        ``stream`` (a created stream: the call refuses the legacy default one) in one call; the
        three are contiguous uint64 arrays. Returns the CUDA error code (0: queued), so that a
        caller can fall back to ``copy_one`` where the driver refuses batches."""
        return self._copy_batch(host_address(destinations), host_address(sources), host_address(sizes), len(sizes),
                                ctypes.byref(self._batch_attributes), self._batch_attribute_index, 1, stream)

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

    def stream_create(self) -> int:
        """A stream that does not synchronize with the legacy default stream."""
        handle = ctypes.c_void_p()
        _check(self._stream_create(ctypes.byref(handle), _STREAM_NON_BLOCKING), "creating a stream")
        return handle.value

    def stream_destroy(self, stream: int) -> None:
        """Its resources go once the work queued on it has run."""
        _check(self._stream_destroy(stream), "destroying a stream")

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now on runs after the event's last record."""
        _check(self._stream_wait_event(stream, event, 0), "ordering a stream after an event")


_EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING
_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM


def _check(err: int, what: str) -> None:
    if err:
        raise EngineError(f"{what} failed: CUDA error {err}; check the GPU with nvidia-smi")


@functools.cache
def load() -> DriverCalls | None:
    try:
        return DriverCalls(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
