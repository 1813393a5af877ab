"""The shared-memory tiles of the prefill GEMM kernels: static arrays up to 48 KiB, one dynamic block beyond.

A block's static shared arrays may hold 48 KiB; more (up to 227 KiB a block on Hopper) must be
dynamic shared memory, which a kernel opts into by a function attribute before its launch. The
GEMM kernels (gemm.py, moe.py) stage X and one or two weight tiles: `tiles_device(config, n)`
returns them as static arrays when they fit, else as slices of the one dynamic array, and
`launch` passes the dynamic size and sets the attribute. The row list (int32 [block_m]) stays
static. The simulator runs either form (it takes the dynamic size from the launch as well).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ._common import IS_SIMULATOR, MAX_STATIC_SHARED_BYTES

_ALIGNMENT = 16  # cp.async and the C++ loop's uint4 stores write 16 bytes at a time


def tile_bytes(config, num_weights: int) -> int:
    """Bytes of X's tile and `num_weights` weight tiles."""
    return np.dtype(config.stage_dtype).itemsize * (config.xs_size + num_weights * config.ws_size)


def shared_bytes(config, num_weights: int) -> int:
    """A block's shared memory: the tiles and the row list."""
    return tile_bytes(config, num_weights) + 4 * config.block_m


def dynamic_bytes(config, num_weights: int) -> int:
    """The dynamic shared memory a launch passes: 0 where the tiles are static arrays."""
    return tile_bytes(config, num_weights) if shared_bytes(config, num_weights) > MAX_STATIC_SHARED_BYTES else 0


@functools.cache
def tiles_device(config, num_weights: int):
    """device_tiles() -> (xs, ws) or (xs, ws_a, ws_b): arrays of config.stage_dtype, of config.xs_size and
    config.ws_size elements. (Numba refuses a device function returning one array it made itself;
    a tuple of them it takes.)"""
    xs_size, ws_size, dtype = config.xs_size, config.ws_size, config.stage_dtype
    if not dynamic_bytes(config, num_weights):
        alignment = None if IS_SIMULATOR else _ALIGNMENT  # the simulator takes no alignment
        # the simulator tells shared arrays apart by their source line: one allocation a line
        if num_weights == 1:
            @cuda.jit(device=True)
            def device_static_tiles():
                xs = cuda.shared.array(xs_size, dtype, alignment=alignment)
                ws = cuda.shared.array(ws_size, dtype, alignment=alignment)
                return xs, ws

            return device_static_tiles

        @cuda.jit(device=True)
        def device_static_dual_tiles():
            xs = cuda.shared.array(xs_size, dtype, alignment=alignment)
            ws_a = cuda.shared.array(ws_size, dtype, alignment=alignment)
            ws_b = cuda.shared.array(ws_size, dtype, alignment=alignment)
            return xs, ws_a, ws_b

        return device_static_dual_tiles

    itemsize = np.dtype(dtype).itemsize
    if (xs_size * itemsize) % _ALIGNMENT or (ws_size * itemsize) % _ALIGNMENT:
        raise ValueError(f"tiles of {xs_size} and {ws_size} elements would leave the dynamic slices "
                         f"unaligned to {_ALIGNMENT} bytes")
    if IS_SIMULATOR:  # which takes no alignment, and sizes the block by a dtype instance
        block_dtype = np.dtype(dtype)

        @cuda.jit(device=True)
        def device_dynamic_tiles():
            block = cuda.shared.array(0, block_dtype)
            return block[:xs_size], block[xs_size:xs_size + ws_size], block[xs_size + ws_size:xs_size + 2 * ws_size]
    else:
        @cuda.jit(device=True)
        def device_dynamic_tiles():
            block = cuda.shared.array(0, dtype, alignment=_ALIGNMENT)
            return block[:xs_size], block[xs_size:xs_size + ws_size], block[xs_size + ws_size:xs_size + 2 * ws_size]

    if num_weights == 2:
        return device_dynamic_tiles

    @cuda.jit(device=True)
    def device_dynamic_single_tiles():  # the second weight's slice is empty: the block holds one
        xs, ws, _ = device_dynamic_tiles()
        return xs, ws

    return device_dynamic_single_tiles


def launch(kernel, grid, threads: int, num_dynamic_bytes: int, *args) -> None:
    """kernel[grid, threads](*args) with `num_dynamic_bytes` of dynamic shared memory. A block may have
    48 KiB of shared memory, static and dynamic together, unless its kernel is allowed more: the kernels
    are ``launcher.Kernel``s, which allow the compiled kernel its dynamic block before they launch it."""
    kernel[grid, threads, 0, num_dynamic_bytes](*args)
