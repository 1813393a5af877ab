"""The holders of the device allocations behind ledger charges, named for the warm-up's failed ledger check."""

import numpy as np

from strata.gpu import live_allocations
from strata.gpu.ledger import VramLedger


class Memory:  # numba-cuda's MemoryPointer, with the charge ``gpu/memory.py`` tags it with
    def __init__(self, charge):
        self.size, self.ledger_charge = charge.num_bytes, charge


class Pointer:  # numba-cuda's OwnedPointer: the allocation behind ``_mem``
    def __init__(self, mem):
        self._mem = mem


class Holder:  # an array keeping its allocation, as a device array keeps ``gpu_data``
    def __init__(self, pointer, shape):
        self.gpu_data, self.shape, self.dtype = pointer, shape, np.dtype(np.float32)


class Keeper:
    def __init__(self, held):
        self.held = held


def test_the_chain_above_a_charged_allocation_names_the_array_and_its_keeper():
    ledger = VramLedger(2**20)
    leaked, other = ledger.charge("activations", 294_912), ledger.charge("kv_cache", 294_912)
    keeper = Keeper(Holder(Pointer(Memory(leaked)), (36, 2048)))
    held = Holder(Pointer(Memory(other)), (36, 2048))  # the same size under another charge: not listed
    assert ledger.live_charges("activations") == [leaked]
    lines = live_allocations.holders([c.charge_id for c in ledger.live_charges("activations")], pointer_type=Pointer)
    assert len(lines) == 1
    assert lines[0].startswith("294912 bytes: Pointer") and "Holder (36, 2048) float32" in lines[0]
    assert "Keeper" in lines[0]
    assert live_allocations.holders([12345], pointer_type=Pointer) == []
    ledger.discharge(leaked)
    assert ledger.live_charges("activations") == []
    del keeper, held


def test_weak_proxies_among_the_objects_neither_count_nor_raise():
    import weakref

    class Gone:
        pass

    charge = VramLedger(1024).charge("activations", 512)
    target = Pointer(Memory(charge))
    alive = weakref.proxy(target)  # isinstance would take it for a Pointer
    dead_target = Gone()
    dead = weakref.proxy(dead_target)
    del dead_target  # isinstance on it would raise ReferenceError
    kept = [alive, dead]
    assert len(live_allocations.holders([charge.charge_id], pointer_type=Pointer)) == 1
    del kept, target


def test_a_pointer_whose_memory_is_gone_is_skipped():
    class Gone:
        @property
        def _mem(self):
            raise ReferenceError("weakly-referenced object no longer exists")

    kept = [Gone()]
    assert live_allocations.holders([1], pointer_type=Gone) == []
    del kept


def test_views_sharing_an_allocation_are_listed_once():
    ledger = VramLedger(1 << 20)
    charge = ledger.charge("activations", 4096)
    memory = Memory(charge)
    whole, view = Holder(Pointer(memory), (1, 1024)), Holder(Pointer(memory), (1, 512))  # a slice's pointer
    other = ledger.charge("activations", 1024)
    third = Holder(Pointer(Memory(other)), (1, 256))
    lines = live_allocations.holders([charge.charge_id, other.charge_id], pointer_type=Pointer)
    assert len(lines) == 2 and sum(line.startswith("4096 bytes") for line in lines) == 1
    del whole, view, third
