"""The holders of a device allocation of a given size, named for the warm-up's failed ledger check."""

import numpy as np

from strata.gpu import live_allocations


class Memory:
    def __init__(self, size):
        self.size = size


class Pointer:  # numba-cuda's OwnedPointer: the allocation behind ``_mem``
    def __init__(self, mem):
        self._mem = mem


class Holder:  # an array keeping its allocation, as a device array keeps ``gpu_data``
    def __init__(self, pointer, shape):
        self.gpu_data, self.shape, self.dtype = pointer, shape, np.dtype(np.float32)


class Keeper:
    def __init__(self, held):
        self.held = held


def test_the_chain_above_an_allocation_of_the_size_names_the_array_and_its_keeper():
    keeper = Keeper(Holder(Pointer(Memory(294_912)), (36, 2048)))
    other = Holder(Pointer(Memory(4096)), (1, 1024))  # another size: not listed
    lines = live_allocations.holders(294_912, pointer_type=Pointer)
    assert len(lines) == 1
    assert lines[0].startswith("Pointer") and "Holder (36, 2048) float32" in lines[0] and "Keeper" in lines[0]
    assert live_allocations.holders(123, pointer_type=Pointer) == []
    del keeper, other


def test_weak_proxies_among_the_objects_neither_count_nor_raise():
    import weakref

    class Gone:
        pass

    target = Pointer(Memory(512))
    alive = weakref.proxy(target)  # isinstance would take it for a Pointer
    dead_target = Gone()
    dead = weakref.proxy(dead_target)
    del dead_target  # isinstance on it would raise ReferenceError
    kept = [alive, dead]
    assert len(live_allocations.holders(512, pointer_type=Pointer)) == 1
    del kept, target


def test_a_pointer_whose_memory_is_gone_is_skipped():
    class Gone:
        @property
        def _mem(self):
            raise ReferenceError("weakly-referenced object no longer exists")

    kept = [Gone()]
    assert live_allocations.holders(0, pointer_type=Gone) == []
    del kept
