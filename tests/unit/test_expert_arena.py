"""Batched staging into the plane arena: the same bytes as staging expert by expert; the address table of
experts read where they lie (cache slots or the pinned pack)."""

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from numba import config as numba_config

from strata.backend import expert_arena
from strata.backend.expert_arena import HostRange, PlaneArena
from strata.backend.ops import ExpertLayout
from strata.gpu.ledger import VramLedger

pytestmark = pytest.mark.skipif(not numba_config.ENABLE_CUDASIM, reason="needs NUMBA_ENABLE_CUDASIM=1")


class AddressedRange(HostRange):
    """A host range that, like CUDA virtual memory, exposes its base address."""

    def __init__(self, reserved_bytes: int, segment_bytes: int):
        super().__init__(reserved_bytes, segment_bytes)
        self.host = np.zeros(reserved_bytes, dtype=np.uint8)
        self.base = self.host.ctypes.data


def _layout() -> ExpertLayout:
    from strata.gpu.kernels.packing import plane_shapes

    shapes = ((64, 128), (64, 128), (128, 64))
    qtypes = (QType.Q4_0, QType.Q4_0, QType.Q8_0)
    sizes = tuple(sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in plane_shapes(q.name, *shape).values())
                  for q, shape in zip(qtypes, shapes))
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += -(-size // 256) * 256
    return ExpertLayout(qtypes, shapes, tuple(offsets), sizes, offset, encoding="packed-planes")


def _arena(make_range):
    layout = _layout()
    arena = PlaneArena(VramLedger(1 << 30), "expert_cache", 16 * layout.slot_bytes, 8 * layout.slot_bytes, layout,
                       granularity=256, make_range=make_range)
    arena.map_segments(arena.segment_bytes * 2)
    return arena, layout


def test_stage_many_writes_the_bytes_stage_writes(monkeypatch):
    copies = []

    def host_copy(self, destinations, sources, sizes, stream=None):
        copies.append(len(sizes))
        for d, s, n in zip(destinations.tolist(), sources.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)

    monkeypatch.setattr(expert_arena.HostToDeviceCopier, "copy", host_copy)
    batched, layout = _arena(AddressedRange)
    one_by_one, _ = _arena(HostRange)
    rng = np.random.default_rng(0)
    batches = [[9, 0, 3, 15, 4], [int(s) for s in rng.permutation(16)[:13]]]  # the second outgrows the first's sizes
    for slots in batches:
        # slices of one buffer, as the expert pack hands them out; one of them read-only
        pack = rng.integers(0, 256, (len(slots), layout.slot_bytes), dtype=np.uint8)
        hosts = list(pack)
        hosts[1] = hosts[1].copy()
        hosts[1].flags.writeable = False
        batched.stage_many(slots, hosts)
        for slot, host in zip(slots, hosts):
            one_by_one.stage(slot, host)
    assert copies == [len(slots) * len(batched.planes) for slots in batches]  # one call a batch
    for plane_batched, plane_single in zip(batched._ranges, one_by_one._ranges):
        assert np.array_equal(plane_batched.host, plane_single.array.copy_to_host())


def test_stage_many_refuses_a_negative_slot_and_copies_nothing(monkeypatch):
    copies = []
    monkeypatch.setattr(expert_arena.HostToDeviceCopier, "copy", lambda self, *args, **kwargs: copies.append(args))
    arena, layout = _arena(AddressedRange)
    host = np.zeros(layout.slot_bytes, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"expert slots must be non-negative, got \[2, -1\]"):
        arena.stage_many([2, -1], [host, host])  # -1 would index the table from its end: the last slot
    assert copies == []


def test_the_address_table_points_at_slots_for_cached_experts_and_at_the_pack_for_the_rest():
    from strata.gpu.kernels.moe_addressed import HOST_FLAG, TABLE_COLUMNS

    arena, layout = _arena(AddressedRange)
    assert arena.has_device_addresses and not _arena(HostRange)[0].has_device_addresses
    assert _arena(HostRange)[0].address_table(np.zeros(1, np.int32), np.zeros(1, np.uint64)) is None
    slots = np.array([3, -1, 0, -1], np.int32)
    pack_slots = np.array([1 << 40, 2 << 40, 3 << 40, 4 << 40], np.uint64)  # each expert's packed bytes
    table = arena.address_table(slots, pack_slots)
    assert table.shape == (4, TABLE_COLUMNS) and table.dtype == np.uint64
    assert table[:, HOST_FLAG].tolist() == [0, 1, 0, 1]
    present = {3 * index + ("quants", "scales", "extra").index(name): (offset, plane_range, shape, dtype)
               for (index, name, shape, dtype, offset), plane_range in zip(arena.planes, arena._ranges)}
    for column in range(HOST_FLAG):
        if column not in present:  # a plane Q4_0 and Q8_0 do not have: never read
            assert not table[:, column].any()
            continue
        offset, plane_range, shape, dtype = present[column]
        assert offset == _pack_offset(layout, column)  # where the pack holds the plane in an expert's bytes
        slot_bytes = int(np.prod(shape)) * dtype.itemsize
        assert table[0, column] == plane_range.base + 3 * slot_bytes  # slot 3 of the plane's range
        assert table[2, column] == plane_range.base
        assert table[1, column] == (2 << 40) + offset and table[3, column] == (4 << 40) + offset  # pack + plane offset


def _pack_offset(layout, column: int) -> int:
    """The byte offset of plane ``column % 3`` of matrix ``column // 3`` in a packed expert, from the layout: the
    matrix's region, then its planes in order (quants, scales, extra), each as plane_shapes sizes it."""
    from strata.gpu.kernels.packing import plane_shapes

    index, plane = divmod(column, 3)
    planes = plane_shapes(layout.qtypes[index].name, *layout.shapes[index])
    offset = layout.offsets[index]
    for name in ("quants", "scales", "extra")[:plane]:
        if name in planes:
            shape, dtype = planes[name]
            offset += int(np.prod(shape)) * np.dtype(dtype).itemsize
    return offset
