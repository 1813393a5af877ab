"""Where a prefill chunk's time goes, layer by layer: a measurement aid of the bench (``--layer-timeline``).

Each layer of each chunk is marked on the device (the backend's timing marks: CUDA events on the kernels'
stream) at its start, after its attention block, around each wait for a ring batch's copies, and at its end,
and on the host when the runner starts and finishes issuing it. Read after the chunk's synchronize:

    device    start .. end of every layer: what the GPU took, waits included
    attention start .. after attention (norms, projections, RoPE, KV write, attention, output projection)
    moe       after attention .. end (routing, the cached experts, the ring batches, the shared expert)
    stall     the waits: the kernels' stream held for copies still running (PCIe-bound when large)
    host      issuing every layer's launches; a device time near it means the GPU waited for the host

The events cost a few microseconds of host time each, so a timed request is slower than an untimed one;
compare layers and shares within it, not its speed with another's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any


@dataclasses.dataclass
class LayerMarks:
    layer: int
    host_start: float
    start: Any
    after_attention: Any = None
    waits: list = dataclasses.field(default_factory=list)  # (before, after) marks around a ring batch's wait
    end: Any = None
    host_end: float = 0.0


class PrefillTimeline:
    def __init__(self, ops):
        self.ops = ops
        self.layers: list[LayerMarks] = []

    def begin(self, layer: int) -> LayerMarks:
        return LayerMarks(layer, time.perf_counter(), self.ops.timing_mark())

    def attention_done(self, marks: LayerMarks) -> None:
        marks.after_attention = self.ops.timing_mark()

    def end(self, marks: LayerMarks) -> None:
        marks.end = self.ops.timing_mark()
        marks.host_end = time.perf_counter()
        self.layers.append(marks)

    def summary(self) -> dict:
        """Milliseconds summed over every marked layer (``layers`` of them), and the device time of the
        slowest and the median layer. Call after the backend synchronized."""
        between = self.ops.seconds_between
        rows = [{"device": between(m.start, m.end), "attention": between(m.start, m.after_attention),
                 "moe": between(m.after_attention, m.end), "stall": sum(between(a, b) for a, b in m.waits),
                 "host": m.host_end - m.host_start} for m in self.layers]
        totals = {f"{key}_ms": 1e3 * sum(row[key] for row in rows)
                  for key in ("device", "attention", "moe", "stall", "host")}
        device = sorted(row["device"] for row in rows)
        return {"layers": len(rows), **totals,
                "median_layer_ms": 1e3 * device[len(device) // 2] if device else 0.0,
                "slowest_layer_ms": 1e3 * device[-1] if device else 0.0}


def format_summary(summary: dict) -> str:
    return (f" | layers: device {summary['device_ms']:.1f} ms (attention {summary['attention_ms']:.1f}, "
            f"MoE {summary['moe_ms']:.1f}, copy stall {summary['stall_ms']:.1f}), host issue "
            f"{summary['host_ms']:.1f} ms over {summary['layers']} layer(s)")
