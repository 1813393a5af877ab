"""Every Numba device allocation of the process, charged to the VRAM ledger.

Numba's External Memory Management interface sends each allocation through one memory-manager
class per process, chosen before the CUDA context exists. ``install_ledger`` installs ours; the
ledger it charges is a class attribute because Numba, not Strata, instantiates the manager. An
allocation is charged to the ledger whose owner block is in effect (``with ledger.owner("kv_cache"):
...``), else to the installed one, before the driver is asked; it is discharged when Numba frees
the pointer.
"""

from __future__ import annotations

import weakref

from strata.errors import AllocationError
from strata.gpu.ledger import VramLedger, active_ledger


def install_ledger(ledger: VramLedger) -> None:
    """Route Numba's device allocations through ``ledger`` (call before the first CUDA use)."""
    from numba import cuda

    manager = _manager_class()
    manager.ledger = ledger
    cuda.set_memory_manager(manager)


def is_ledger_managed() -> bool:
    """Whether this process's CUDA context allocates through the ledger's manager (it does not when
    the context existed before ``install_ledger``, e.g. after other CUDA work in the same process)."""
    from numba import cuda

    manager = getattr(cuda.current_context(), "memory_manager", None)
    return isinstance(manager, _manager_class())


def _manager_class():
    from numba.cuda.cudadrv import driver

    cached = getattr(driver, "_strata_ledger_manager", None)
    if cached is not None:
        return cached

    class LedgerMemoryManager(driver.NumbaCUDAMemoryManager):
        ledger: VramLedger | None = None

        def memalloc(self, size):
            ledger = active_ledger() or type(self).ledger
            if ledger is None:
                return super().memalloc(size)
            charge = ledger.charge(ledger.current_owner, size)
            try:
                pointer = super().memalloc(size)
            except driver.CudaAPIError as exc:
                ledger.discharge(charge)
                raise AllocationError(f"{ledger.current_owner}: the driver could not allocate "
                                      f"{size / 2**20:.1f} MiB ({exc})") from exc
            weakref.finalize(pointer, ledger.discharge, charge)
            return pointer

    driver._strata_ledger_manager = LedgerMemoryManager  # one class per process, as Numba requires
    return LedgerMemoryManager
