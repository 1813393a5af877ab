"""Prefill's fills of a tiered KV cache one layer ahead: the next layer's cells are copied into its
staging layer on a stream of their own while this layer's experts compute.

The staging layers alternate by layer (``CudaKv.staging[layer % 2]``). After layer l's attention is
queued, the fill of layer l + 1 waits for it (the staging layer it overwrites was read by layer l - 1's
attention, queued before) and runs beside the kernels; layer l + 1's ``kv_write`` makes the kernels
wait for the fill. A fill not taken by the very next write (a chunk that failed between them) is
dropped, and that layer fills in the kernels' stream again.
"""

from __future__ import annotations

from typing import Callable

from strata.errors import EngineError


class AheadFills:
    def __init__(self):
        from numba import cuda

        from strata.gpu import driver_calls

        self._calls = driver_calls.load()
        if self._calls is None:
            raise EngineError("the KV host tier's fill stream needs the CUDA driver library (libcuda), which could "
                              "not be opened")
        self.handle = self._calls.stream_create()
        self._stream = cuda.external_stream(self.handle)
        self._after_attention = self._calls.event_create()
        self._filled = self._calls.event_create()
        self._pending = None  # (key, positions): the fill queued ahead, and the positions it reads

    def fill_ahead(self, key: tuple, positions, fill: Callable) -> None:
        """Queue ``fill(stream=...)`` after every kernel queued so far, on the fill stream; ``key`` names
        the write that takes it (``take``)."""
        calls = self._calls
        calls.event_record(self._after_attention, 0)
        calls.stream_wait_event(self.handle, self._after_attention)
        fill(stream=self._stream)
        calls.event_record(self._filled, self.handle)
        self._pending = (key, positions)  # held until taken: the fill reads the positions on the device

    def take(self, key: tuple) -> bool:
        """Whether the fill of ``key`` was queued ahead; kernels queued from now on then run after it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        # a fill not taken may still be writing its staging layer, which an in-stream fill writes next
        self._calls.stream_wait_event(0, self._filled)
        return pending[0] == key

    def close(self) -> None:
        """Destroy the stream and its events (the driver lets work queued on them finish); once only."""
        if self.handle is None:
            return
        self._pending = None
        for event in (self._after_attention, self._filled):
            self._calls.event_destroy(event)
        self._calls.stream_destroy(self.handle)
        self.handle = self._stream = self._after_attention = self._filled = None
