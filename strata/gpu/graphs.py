"""Captured launch sequences: a segment of the decode step recorded once, replayed for every token.

A Numba launch costs 18–47 µs on the host and a decode token is hundreds of launches; a CUDA graph
of the same launches replays at ~1 µs per kernel (measured on the reference H200). Numba launches
on a ``cuda.core`` graph builder as on a stream, so capturing is running the segment's Python once
with the ops backend launching on the builder.

What a graph reads and writes is fixed at capture, so a segment must keep its memory:
- its inputs are buffers that live as long as the graph (the caller's), refreshed before a replay;
- what it allocates while captured is retained by the memory manager for the graph's life, so
  the allocator cache never hands those blocks to anyone else (``memory.retaining``);
- its kernels take no argument that changes between tokens (positions are read on the device).

The simulator has no graphs: there a segment re-runs its function on each replay and copies the
new results into the arrays returned the first time, which is what a replayed graph leaves behind.
Either way nothing runs at capture; the first ``replay`` executes the segment. A captured graph is uploaded
to the device at capture, where the load pays for it: else its first launch would, inside a request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


class GraphSegment:
    """A completed CUDA graph and everything it references."""

    def __init__(self, graph, outputs: Any, retained: list):
        self.graph = graph
        self.outputs = outputs
        self._retained = retained  # the blocks allocated during capture

    def replay(self) -> None:
        from cuda.bindings import driver

        # the legacy default stream: ordered with the uncaptured kernels, copies and events around it
        (err,) = driver.cuGraphLaunch(self.graph.handle, driver.CUstream(0))
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuGraphLaunch failed: {err}")

    def close(self) -> None:
        self.graph.close()
        self.outputs = None
        self._retained = []


class RerunSegment:
    """The simulator's stand-in: each replay runs ``fn`` again; results land in the first outputs."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn = fn
        self.outputs = None

    def replay(self) -> None:
        results = self._fn()
        if self.outputs is None:
            self.outputs = results
            return
        for held, new in zip(_flat(self.outputs), _flat(results)):
            if held is not new:
                held.copy_to_device(new)

    def close(self) -> None:
        self.outputs = None


def capture_graph(fn: Callable[[], Any], launching_on: Callable, retaining: Callable) -> GraphSegment:
    """Record the launches ``fn`` makes: ``launching_on(builder)`` points the backend's launches at
    the builder, ``retaining()`` yields the list that keeps every allocation made meanwhile."""
    builder = _device().create_graph_builder()
    builder.begin_building("relaxed")  # allocations (cuMemAlloc) may happen while capturing
    try:
        with retaining() as retained, launching_on(builder):
            outputs = fn()
    except BaseException:
        # ending a capture that the error broke may fail as well: the first error is the one to see
        with contextlib.suppress(Exception):
            builder.end_building()
        with contextlib.suppress(Exception):
            builder.close()
        raise
    graph = builder.end_building().complete()
    builder.close()
    try:
        _upload(graph)
    except BaseException:
        graph.close()
        raise
    return GraphSegment(graph, outputs, retained)


def _upload(graph) -> None:
    """Upload ``graph`` on the legacy default stream (where ``replay`` launches it), behind the work queued there."""
    from cuda.bindings import driver

    (err,) = driver.cuGraphUpload(graph.handle, driver.CUstream(0))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuGraphUpload failed: {err}")


def _device():
    try:
        from cuda.core import Device
    except ImportError:  # cuda-core before 1.0
        from cuda.core.experimental import Device
    device = Device()
    device.set_current()
    return device


def _flat(outputs) -> list:
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
