"""How fast pinned host memory copies to the device: the planner's PCIe rate, measured at load.

A page-locked host buffer and a device buffer of the largest size; one untimed copy (the first
pays the driver's setup), then ``REPEATS`` copies of each size on a private stream, each between
two timing events. What the caller fits a rate to is the (bytes, seconds) of every copy. About
a tenth of a second on the reference H200, most of it allocating the pinned buffer.
"""

from __future__ import annotations

SIZES_BYTES = (4 << 20, 16 << 20, 64 << 20)
REPEATS = 4


def probe_host_to_device(sizes_bytes: tuple[int, ...] = SIZES_BYTES, repeats: int = REPEATS,
                         device: int = 0) -> list[tuple[int, float]]:
    """(bytes, seconds) of ``repeats`` pinned host-to-device copies of each size, on ``device``."""
    import numpy as np
    from numba import cuda
    from numba.cuda.cudadrv import driver

    from strata.gpu.memory import install_manager

    install_manager()  # a dry run's probe makes the context the engine's load then uses
    with cuda.gpus[device]:
        largest = max(sizes_bytes)
        host = cuda.pinned_array(largest, dtype=np.uint8)
        host[:] = 1  # every page touched before timing
        target = cuda.device_array(largest, dtype=np.uint8)
        stream = cuda.stream()
        driver.host_to_device(target, host, largest, stream=stream)
        samples = []
        for num_bytes in sizes_bytes:
            for _ in range(repeats):
                started, ended = cuda.event(timing=True), cuda.event(timing=True)
                started.record(stream)
                driver.host_to_device(target, host, num_bytes, stream=stream)
                ended.record(stream)
                ended.synchronize()
                samples.append((num_bytes, cuda.event_elapsed_time(started, ended) / 1e3))
        del target, host
        return samples
