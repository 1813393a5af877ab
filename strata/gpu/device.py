"""The CUDA device as the engine sees it: free memory, identity."""

from __future__ import annotations

from strata.gpu.memory import install_manager


def free_device_bytes(device: int = 0) -> int:
    from numba import cuda

    install_manager()  # this may make the process's context: with the ledger's manager

    with cuda.gpus[device]:
        free, _ = cuda.current_context().get_memory_info()
    return int(free)


def used_device_bytes(device: int = 0) -> int:
    """Device memory in use by every process (total less free), as the driver counts it."""
    from numba import cuda

    install_manager()

    with cuda.gpus[device]:
        free, total = cuda.current_context().get_memory_info()
    return int(total - free)


def device_uuid(device: int = 0) -> str:
    """The device's UUID ("GPU-…"): the same GPU under any ordinal or CUDA_VISIBLE_DEVICES mapping."""
    from numba import cuda

    install_manager()
    return str(cuda.gpus[device].uuid)
