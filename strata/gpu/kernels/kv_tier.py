"""The KV cache's host tier: cells [resident_cells, num_cells) of a layer in pinned, mapped host memory.

Attention reads a tiered layer from a staging layer of every cell ([num_cells, width], the same
packed format): ``fill_kv_window`` copies cells [0, end) into it, the first ``resident_cells`` from
the layer's device planes and the rest from its host planes, where end is one past the last
position being written, read on the device (a captured decode step replays at any position).
The new cells are written into the staging layer (``kvcache.append_kv``), and ``write_back_kv``
copies them to their home: the device planes below ``resident_cells``, the host planes from it.
The attention kernels then read exactly the bytes an all-resident cache would hold: the same
kernels over the same values, in the same order.

Host planes are read and written by the kernels through their device mapping (zero-copy over
PCIe); only the cells a step reaches move.
"""

from __future__ import annotations

import functools

from numba import cuda

from ._common import check_power_of_two
from .launcher import jit
from .packing import PackedMatrix, plane_shapes

_DEFAULT_THREADS = 256
_DEFAULT_BLOCKS = 256  # per plane: every thread strides over the elements of the cells copied


@functools.cache
def _copy_kernel(is_to_staging: bool):
    @jit
    def copy_kv_cells_kernel(staging, resident, host, resident_cells, positions):
        # the cells [first, end): from 0 when filling (every cell attention reads), the written ones back
        first = 0 if is_to_staging else positions[0]
        end = positions[positions.shape[0] - 1] + 1
        width = staging.shape[1]
        i = first * width + cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        step = cuda.gridDim.x * cuda.blockDim.x
        while i < end * width:
            row = i // width
            col = i - row * width
            if is_to_staging:
                if row < resident_cells:
                    staging[row, col] = resident[row, col]
                else:
                    staging[row, col] = host[row - resident_cells, col]
            elif row < resident_cells:
                resident[row, col] = staging[row, col]
            else:
                host[row - resident_cells, col] = staging[row, col]
            i += step

    return copy_kv_cells_kernel


def tier_planes(layer: PackedMatrix) -> list:
    """The planes a KV layer's format has (placeholders of absent planes are not copied)."""
    return [getattr(layer, name) for name in plane_shapes(layer.fmt, layer.num_rows, layer.num_cols)]


def fill_kv_window(staging: tuple, resident: tuple, host: tuple, resident_cells: int, positions, *,
                   threads: int = _DEFAULT_THREADS, blocks: int = _DEFAULT_BLOCKS, stream=0) -> None:
    """Cells [0, positions[-1] + 1) of a tiered layer into its staging layer. Each argument but
    ``positions`` ([T] int32 on the device, consecutive) is a (K, V) pair of PackedMatrix: staging
    [cells, W], resident [resident_cells, W] on the device, host [cells - resident_cells, W] in
    mapped host memory.

    Launch config per plane: grid ``blocks`` (default 256), block ``threads`` (default 256), a
    grid-stride loop over the plane's elements of the cells copied.
    """
    _copy(True, staging, resident, host, resident_cells, positions, threads, blocks, stream)


def write_back_kv(staging: tuple, resident: tuple, host: tuple, resident_cells: int, positions, *,
                  threads: int = _DEFAULT_THREADS, blocks: int = _DEFAULT_BLOCKS, stream=0) -> None:
    """The cells [positions[0], positions[-1] + 1) from the staging layer to their home (device
    planes below ``resident_cells``, host planes from it); arguments and launch as ``fill_kv_window``."""
    _copy(False, staging, resident, host, resident_cells, positions, threads, blocks, stream)


def _copy(is_to_staging: bool, staging, resident, host, resident_cells, positions, threads, blocks, stream):
    check_power_of_two("threads", threads)
    if not positions.shape[0]:
        return
    for s, r, h in zip(staging, resident, host):
        for planes in zip(tier_planes(s), tier_planes(r), tier_planes(h)):
            _copy_kernel(is_to_staging)[blocks, threads, stream](*planes, resident_cells, positions)
