"""The CUDA device as the engine sees it: free memory, granularity."""

from __future__ import annotations


def free_device_bytes(device: int = 0) -> int:
    from numba import cuda

    with cuda.gpus[device]:
        free, _ = cuda.current_context().get_memory_info()
    return int(free)
