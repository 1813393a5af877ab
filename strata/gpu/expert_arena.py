"""The expert cache's storage on the GPU: one range per plane of the packed layout, slots in step.

The MoE kernels read stacked experts (``gate`` as ``[slots * F, H]`` planes: quants, scales,
extra), so the arena keeps each plane of each matrix in its own range and slot ``s`` at row
``s * rows`` of every plane. A segment adds ``slots_per_segment`` slots to every plane; each plane's
share is rounded up to the device granularity, and that is what the ledger is charged. On the real
GPU the ranges are CUDA virtual memory (``VmmArena``); under the simulator they are host arrays.

Experts arrive as their packed slot bytes (planes concatenated, in ``ExpertLayout`` order) and are
scattered into the planes by ``stage``.
"""

from __future__ import annotations

import numpy as np

from strata.engine.ops import ExpertLayout
from strata.gpu.ledger import Charge, VramLedger

_PLANE_NAMES = ("quants", "scales", "extra")


def plane_sizes(layout: ExpertLayout) -> list[tuple[int, str, tuple[int, int], np.dtype, int]]:
    """(matrix index, plane, per-slot plane shape, dtype, byte offset in the slot) of every plane present."""
    from strata.gpu.kernels.packing import plane_shapes

    planes = []
    for index, (qtype, shape, offset) in enumerate(zip(layout.qtypes, layout.shapes, layout.offsets)):
        within = 0
        for name, (plane_shape, dtype) in plane_shapes(qtype.name, *shape).items():
            planes.append((index, name, plane_shape, np.dtype(dtype), offset + within))
            within += int(np.prod(plane_shape)) * np.dtype(dtype).itemsize
    return planes


class PlaneArena:
    def __init__(self, ledger: VramLedger, owner: str, reserved_bytes: int, segment_bytes: int,
                 layout: ExpertLayout, *, granularity: int, make_range, placeholders=None):
        self.layout = layout
        self.slots_per_segment = max(1, segment_bytes // layout.slot_bytes)
        self.num_segments_reserved = max(1, reserved_bytes // segment_bytes)
        self.planes = plane_sizes(layout)
        # bytes each plane maps per segment, rounded up to the device's mapping granularity
        self._chunks = [-(-self.slots_per_segment * int(np.prod(s)) * d.itemsize // granularity) * granularity
                        for _, _, s, d, _ in self.planes]
        self.segment_bytes = sum(self._chunks)
        self.reserved_bytes = self.segment_bytes * self.num_segments_reserved
        self._ranges = [make_range(chunk * self.num_segments_reserved, chunk) for chunk in self._chunks]
        self._ledger, self._owner = ledger, owner
        self._charges: list[Charge] = []
        self._placeholders = placeholders or {}
        self._matrices = None
        self._plane_slot_bytes = [int(np.prod(shape)) * dtype.itemsize for _, _, shape, dtype, _ in self.planes]
        # raw device addresses when the ranges are CUDA virtual memory: staging then issues one async
        # DMA per plane, with no array objects built per copy
        bases = [getattr(r, "base", None) for r in self._ranges]
        self._device_bases = bases if all(b is not None for b in bases) else None

    @property
    def mapped_bytes(self) -> int:
        return len(self._charges) * self.segment_bytes

    @property
    def num_slots(self) -> int:
        return len(self._charges) * self.slots_per_segment

    @property
    def num_slots_reserved(self) -> int:
        return self.num_segments_reserved * self.slots_per_segment

    def map_segments(self, num_bytes: int) -> None:
        for _ in range(num_bytes // self.segment_bytes):
            if len(self._charges) >= self.num_segments_reserved:
                raise ValueError("mapping beyond the reserved range")
            charge = self._ledger.charge(self._owner, self.segment_bytes)
            mapped = []
            try:
                for plane_range in self._ranges:
                    plane_range.map_segments(plane_range.segment_bytes)
                    mapped.append(plane_range)
            except BaseException:
                for plane_range in mapped:
                    plane_range.unmap_to(plane_range.mapped_bytes - plane_range.segment_bytes)
                self._ledger.discharge(charge)
                raise
            self._charges.append(charge)

    def unmap_to(self, num_bytes: int) -> None:
        while self.mapped_bytes > num_bytes:
            for plane_range in self._ranges:
                plane_range.unmap_to(plane_range.mapped_bytes - plane_range.segment_bytes)
            self._ledger.discharge(self._charges.pop())

    def matrices(self):
        """(gate, up, down) as PackedMatrix stacks over every reserved slot (kernels touch mapped ones)."""
        if self._matrices is None:
            self._matrices = self._build_matrices()
        return self._matrices

    def _build_matrices(self):
        from strata.gpu.kernels.packing import PackedMatrix

        views: dict[tuple[int, str], object] = {}
        for (index, name, shape, dtype, _), plane_range in zip(self.planes, self._ranges):
            rows = shape[0] * self.num_slots_reserved
            num_bytes = rows * shape[1] * dtype.itemsize
            views[(index, name)] = plane_range.array[:num_bytes].view(dtype).reshape(rows, shape[1])
        out = []
        for index, (qtype, (num_rows, num_cols)) in enumerate(zip(self.layout.qtypes, self.layout.shapes)):
            present = {n: views[(index, n)] for i, n, *_ in self.planes if i == index}
            placeholder = {n: self._placeholders[n] for n in _PLANE_NAMES if n not in present}
            planes = {**present, **placeholder}
            out.append(PackedMatrix(qtype.name, num_rows * self.num_slots_reserved, num_cols,
                                    planes["quants"], planes["scales"], planes["extra"]))
        return tuple(out)

    def stage(self, slot: int, host_slot: np.ndarray, stream=0) -> None:
        """Copy one expert's packed slot bytes into slot ``slot`` of every plane (ordered with the
        kernels of the default stream)."""
        if self._device_bases is not None:
            from cuda.bindings import driver as cu

            source = host_slot.ctypes.data
            for (_, _, _, _, offset), base, num_bytes in zip(self.planes, self._device_bases, self._plane_slot_bytes):
                (err,) = cu.cuMemcpyHtoDAsync(base + slot * num_bytes, source + offset, num_bytes, 0)
                if err != cu.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"expert upload failed: {err}")
            return
        for (_, _, shape, dtype, offset), plane_range in zip(self.planes, self._ranges):
            num_bytes = int(np.prod(shape)) * dtype.itemsize
            start = slot * num_bytes
            plane_range.array[start:start + num_bytes].copy_to_device(host_slot[offset:offset + num_bytes],
                                                                       stream=stream)

    def close(self) -> None:
        self.unmap_to(0)
        for plane_range in self._ranges:
            close = getattr(plane_range, "close", None)
            if close:
                close()


class HostRange:
    """A plane range for the simulator: ordinary memory, mapping is bookkeeping only."""

    def __init__(self, reserved_bytes: int, segment_bytes: int):
        from numba import cuda

        self.segment_bytes = segment_bytes
        self.array = cuda.to_device(np.zeros(reserved_bytes, dtype=np.uint8))
        self.mapped_bytes = 0

    def map_segments(self, num_bytes: int) -> None:
        self.mapped_bytes += num_bytes

    def unmap_to(self, num_bytes: int) -> None:
        self.mapped_bytes = min(self.mapped_bytes, num_bytes)


class CountingRange(HostRange):
    """A plane range that only counts (``strata check``'s dry run)."""

    def __init__(self, reserved_bytes: int, segment_bytes: int):
        self.segment_bytes = segment_bytes
        self.array = None
        self.mapped_bytes = 0
