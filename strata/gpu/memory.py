"""Every Numba device allocation of the process, charged to the VRAM ledger.

Numba's External Memory Management interface sends each allocation through one memory-manager
class per process, chosen before the CUDA context exists. ``install_ledger`` installs ours; the
ledger it charges is a class attribute because Numba, not Strata, instantiates the manager. An
allocation is charged to the ledger whose owner block is in effect (``with ledger.owner("kv_cache"):
...``), else to the installed one, before the driver is asked. When Numba frees the pointer the
block goes to that ledger's ``BlockPool`` (``block_pool.py``) for the next allocation of its size;
``trim_pool`` gives the pooled blocks back to the driver.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref

from strata.errors import AllocationError
from strata.gpu.block_pool import BlockPool, rounded_bytes
from strata.gpu.ledger import VramLedger, active_ledger


def install_ledger(ledger: VramLedger | None) -> None:
    """Route Numba's device allocations through ``ledger`` (call before the first CUDA use). None
    installs the manager alone: allocations go to Numba's own path until a ledger is installed, and
    a context made meanwhile already has the manager (a test session making contexts early)."""
    from numba import cuda

    manager = _manager_class()
    manager.ledger = ledger
    cuda.set_memory_manager(manager)


def install_manager() -> None:
    """Install the ledger's memory manager if it is not installed, leaving the ledger it charges as
    it is. Every helper that may make the process's CUDA context calls it first (the PCIe probe of
    a dry run, reading the free memory for the budget, the device's identity): a context made
    without it keeps Numba's own manager, and an engine made in it later cannot capture decode
    graphs (``CudaOps.can_capture``), so it decodes through uncaptured launches, ~10x slower."""
    from numba import config as numba_config

    if numba_config.ENABLE_CUDASIM:
        return
    from numba import cuda
    from numba.cuda.cudadrv import driver

    manager = _manager_class()
    if getattr(driver, "_memory_manager", None) is not manager:
        cuda.set_memory_manager(manager)


def is_ledger_managed() -> bool:
    """Whether this process's CUDA context allocates through the ledger's manager (it does not when
    the context existed before ``install_ledger``, e.g. after other CUDA work in the same process)."""
    from numba import cuda

    manager = getattr(cuda.current_context(), "memory_manager", None)
    return isinstance(manager, _manager_class())


def trim_pool(ledger: VramLedger) -> int:
    """Free ``ledger``'s pooled blocks back to the driver; returns the bytes released."""
    manager = _manager_class()
    pool = manager.pools.get(ledger)
    return pool.reclaim() if pool is not None else 0


def _allocate(num_bytes: int, pool: BlockPool):
    """cuMemAlloc; when the driver is out of memory (its rounding, other processes), the pooled blocks
    go back first and it is asked once more."""
    from numba.cuda.cudadrv import driver

    try:
        return driver.driver.cuMemAlloc(num_bytes)
    except driver.CudaAPIError as exc:
        if exc.code != driver.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY or not pool.reclaim():
            raise
    return driver.driver.cuMemAlloc(num_bytes)


def _collect_and_reclaim(pool: BlockPool, num_bytes: int) -> int:
    """The last resort of a charge that does not fit: temporaries caught in reference cycles hold
    their blocks until a collection; collected, they return to the pool, which gives them back.
    (On the H200 a 32k prefill left enough so held that the decode capture after it ran out of
    budget.) A loaded engine's objects are frozen out of the collector (``engine/collector.py``), so
    a cycle among them would never be found: they are thawed for this one full collection (~0.3 s
    with a model loaded, so it is not run routinely) and frozen again."""
    is_frozen = gc.get_freeze_count() > 0
    if is_frozen:
        gc.unfreeze()
    try:
        gc.collect()
    finally:
        if is_frozen:
            gc.freeze()
    return pool.reclaim(num_bytes)


def _manager_class():
    from numba.cuda.cudadrv import driver

    cached = getattr(driver, "_strata_ledger_manager", None)
    if cached is not None:
        return cached

    class LedgerMemoryManager(driver.NumbaCUDAMemoryManager):
        ledger: VramLedger | None = None
        retained: list | None = None
        pools: weakref.WeakKeyDictionary[VramLedger, BlockPool] = weakref.WeakKeyDictionary()

        def memalloc(self, size):
            owned = self._memalloc(size)
            if self.retained is not None:
                self.retained.append(owned)  # a graph being captured references it: never freed while kept
            return owned

        def _memalloc(self, size):
            ledger = active_ledger() or type(self).ledger
            if ledger is None:
                return super().memalloc(size)
            owner, size_class = ledger.current_owner, rounded_bytes(size)
            pool = self._pool(ledger)
            block = pool.take(size_class, owner, size)
            if block is None:
                charge = ledger.charge(owner, size)  # may reclaim pooled blocks to fit
                try:
                    block = self._attempt_allocation(lambda: _allocate(size_class, pool)), charge
                except driver.CudaAPIError as exc:
                    ledger.discharge(charge)
                    raise AllocationError(f"{owner}: the driver could not allocate {size / 2**20:.1f} MiB "
                                          f"({exc})") from exc
            pointer, charge = block
            key = int(pointer)

            def give_back():
                self.allocations.pop(key, None)
                pool.put(size_class, pointer, charge)

            memory = driver.AutoFreePointer(weakref.proxy(self.context), pointer, size, finalizer=give_back)
            memory.ledger_charge = charge  # who holds it, when a check finds it outliving its owner (live_allocations)
            self.allocations[key] = memory
            return memory.own()

        @contextlib.contextmanager
        def retaining(self):
            """Keep every allocation made inside the block alive as long as the yielded list lives."""
            outer, self.retained = self.retained, []
            try:
                yield self.retained
            finally:
                self.retained = outer

        def _pool(self, ledger: VramLedger) -> BlockPool:
            pool = type(self).pools.get(ledger)
            if pool is None:
                pool = type(self).pools[ledger] = BlockPool(ledger, driver.driver.cuMemFree)
                ledger.add_reclaimer(functools.partial(_collect_and_reclaim, pool))  # after the pool's own
            return pool

    driver._strata_ledger_manager = LedgerMemoryManager  # one class per process, as Numba requires
    return LedgerMemoryManager
