"""The elastic expert cache's storage on CUDA virtual memory.

One address range is reserved for the largest the cache may grow to; physical memory is created
and mapped in segments at its end, and unmapped from its end, so a mapped expert never moves.
Kernels see the whole range as one uint8 Numba array (through ``__cuda_array_interface__``) and
only ever touch mapped slots. Every mapped segment is charged to the ledger.
"""

from __future__ import annotations

from strata.errors import AllocationError, ConfigError
from strata.gpu.ledger import Charge, VramLedger


def _checked(result):
    err, *values = result if isinstance(result, tuple) else (result,)
    from cuda.bindings import driver as cu

    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise AllocationError(f"CUDA virtual memory call failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else values


def allocation_granularity(device: int) -> int:
    from cuda.bindings import driver as cu
    from numba import cuda

    cuda.current_context()  # initializes the driver and makes the primary context current

    return int(_checked(cu.cuMemGetAllocationGranularity(
        _allocation_prop(device), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))


def _allocation_prop(device: int):
    from cuda.bindings import driver as cu

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


class VmmArena:
    def __init__(self, ledger: VramLedger | None, owner: str, reserved_bytes: int, segment_bytes: int,
                 device: int = 0):
        """``ledger`` None: the caller charges the mapped bytes itself."""
        from cuda.bindings import driver as cu
        from numba import cuda

        granularity = allocation_granularity(device)
        if segment_bytes % granularity:
            raise ConfigError(f"runtime.vmm_segment = {segment_bytes >> 20} MiB is not a multiple of this device's "
                              f"allocation granularity ({granularity >> 20} MiB); choose a multiple")
        self.segment_bytes = segment_bytes
        self.reserved_bytes = max(segment_bytes, -(-reserved_bytes // segment_bytes) * segment_bytes)
        self._ledger, self._owner, self._device = ledger, owner, device
        self._prop = _allocation_prop(device)
        self.base = int(_checked(cu.cuMemAddressReserve(self.reserved_bytes, 0, 0, 0)))
        self._segments: list[tuple[object, Charge]] = []
        self.array = cuda.from_cuda_array_interface(
            {"shape": (self.reserved_bytes,), "typestr": "|u1", "data": (self.base, False), "version": 3},
            owner=self, sync=False)

    @property
    def mapped_bytes(self) -> int:
        return len(self._segments) * self.segment_bytes

    def map_segments(self, num_bytes: int) -> None:
        from cuda.bindings import driver as cu

        for _ in range(num_bytes // self.segment_bytes):
            offset = self.mapped_bytes
            if offset + self.segment_bytes > self.reserved_bytes:
                raise AllocationError("the expert cache cannot grow beyond its reserved address range")
            charge = self._ledger.charge(self._owner, self.segment_bytes) if self._ledger else None
            try:
                handle = _checked(cu.cuMemCreate(self.segment_bytes, self._prop, 0))
                try:
                    _checked(cu.cuMemMap(self.base + offset, self.segment_bytes, 0, handle, 0))
                    access = cu.CUmemAccessDesc()
                    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                    access.location.id = self._device
                    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                    _checked(cu.cuMemSetAccess(self.base + offset, self.segment_bytes, [access], 1))
                except Exception:
                    cu.cuMemUnmap(self.base + offset, self.segment_bytes)
                    cu.cuMemRelease(handle)
                    raise
            except Exception:
                if charge:
                    self._ledger.discharge(charge)
                raise
            self._segments.append((handle, charge))

    def unmap_to(self, num_bytes: int) -> None:
        from cuda.bindings import driver as cu
        from numba import cuda

        if self.mapped_bytes > num_bytes:
            cuda.synchronize()  # no kernel may still read a segment being unmapped
        while self.mapped_bytes > num_bytes:
            handle, charge = self._segments.pop()
            offset = self.mapped_bytes
            _checked(cu.cuMemUnmap(self.base + offset, self.segment_bytes))
            _checked(cu.cuMemRelease(handle))
            if charge:
                self._ledger.discharge(charge)

    def close(self) -> None:
        from cuda.bindings import driver as cu

        self.unmap_to(0)
        if self.base:
            _checked(cu.cuMemAddressFree(self.base, self.reserved_bytes))
            self.base = 0
