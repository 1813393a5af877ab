"""The end of a greedy decode step on the device, as captured segments: the output head, the logit
bias and an argmax write the next token's id, the position steps, and the id is embedded for the
next step (``DecodeStep._greedy_tail`` is what a tail segment runs).

A tail reads the head tensor it was captured over and its bias buffers. The buffers have a fixed
capacity, padded with (id 0, +0.0), which changes no logit, so one capture serves every bias that
fits. The kept tail holds ``BIAS_CAPACITY`` ids and lives as long as decode's kept segments,
charged to ``decode_graphs``; it is captured again, at the same size, over a new head tensor (a
loan uploads the head again; a weak reference tells). A request whose bias is longer gets a tail
of its own, charged to its ``activations`` and dropped at its end, so the kept memory stays what
it was at load.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import numpy as np

from strata.gpu.ledger import ACTIVATIONS_OWNER, DECODE_GRAPHS_OWNER

BIAS_CAPACITY = 16  # biased token ids the kept tail holds


@dataclasses.dataclass
class Tail:
    """A captured tail, the head it reads (weakly: a loan may free it) and its bias buffers."""

    segment: object
    head: weakref.ref
    bias: tuple  # (ids [C] int32, values [C] float32) on the device

    def fits(self, head: tuple, num_bias: int) -> bool:
        return self.head() is head[1] and num_bias <= len(self.bias[0])

    def write_bias(self, ops, bias: tuple | None) -> None:
        """``bias`` (host ids [n] int32, values [n] float32) first, in its order, then (0, +0.0)."""
        capacity = len(self.bias[0])
        ids, values = np.zeros(capacity, np.int32), np.zeros(capacity, np.float32)
        if bias is not None:
            ids[:len(bias[0])], values[:len(bias[1])] = bias
        ops.copy_in(self.bias[0], ids)
        ops.copy_in(self.bias[1], values)

    def close(self, ops) -> None:
        """Drop the segment and free the bias buffers."""
        self.segment.close()
        for array in self.bias:
            ops.free(array)


class GreedyTails:
    """The kept tail and a request's own. ``run_tail(head, bias)`` is what a tail segment runs;
    ``capture(fn, owner)`` records it (``ops.capture``, or the decode step's wrapper of it)."""

    def __init__(self, ops, run_tail: Callable[[tuple, tuple], object], capture: Callable):
        self.ops = ops
        self._run_tail = run_tail
        self._capture_segment = capture
        self.is_kept = False  # the tail outlives requests (decode's segments are kept, the head was resident)
        self._kept: Tail | None = None
        self._wide: Tail | None = None

    def for_request(self, head: tuple, num_bias: int) -> Tail:
        """A tail over ``head`` with room for ``num_bias`` biased ids, captured if none fits."""
        if num_bias > BIAS_CAPACITY:  # the request's own, closed at its end
            if self._wide is None or not self._wide.fits(head, num_bias):
                self._close_wide()
                self._wide = self._capture(head, num_bias, ACTIVATIONS_OWNER)
            return self._wide
        if self._kept is not None and not self._kept.fits(head, num_bias):
            self._kept.close(self.ops)
            self._kept = None
        if self._kept is None:
            self._kept = self._capture(head, BIAS_CAPACITY, DECODE_GRAPHS_OWNER if self.is_kept else ACTIVATIONS_OWNER)
        return self._kept

    def end_request(self) -> None:
        """Drop what only the ending request used."""
        self._close_wide()
        if not self.is_kept and self._kept is not None:
            self._kept.close(self.ops)
            self._kept = None

    def close(self) -> None:
        self.is_kept = False
        self.end_request()

    def _capture(self, head: tuple, capacity: int, owner: str) -> Tail:
        ops = self.ops
        bias = (ops.alloc(owner, (capacity,), np.int32), ops.alloc(owner, (capacity,), np.float32))
        segment = self._capture_segment(lambda: self._run_tail(head, bias), owner)
        return Tail(segment, weakref.ref(head[1]), bias)

    def _close_wide(self) -> None:
        if self._wide is not None:
            self._wide.close(self.ops)
            self._wide = None
