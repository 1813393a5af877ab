"""Tensor-core fragments: warp-level ``mma.sync`` device functions in CUDA C++, linked into Numba kernels.

Numba has no tensor-core intrinsics, so the warp-level products live in small CUDA C++ device
functions under ``kernels/cuda/`` (``extern "C"``, C ABI), declared with ``cuda.declare_device``
and linked when a kernel calling them is compiled. Kernels pass shared- and local-memory arrays
as pointers with ``ffi.from_buffer(array)`` (cffi). Staging, dequantization, softmax bookkeeping
and epilogues stay in Numba.

Every C++ function has a pure-Numba twin with the same fragment layout (PTX ISA,
``mma.m16n8k16`` with f16 inputs and f32 accumulators), which is what the simulator runs and
what the GPU tests compare the C++ path against. Fragment layout for a lane (g = lane / 4,
t = lane % 4): accumulator c[r] of a 16 x 8 tile is element (g + 8 * (r // 2), 2 * t + r % 2).
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

from numba import types

from ._common import IS_SIMULATOR

CUDA_SOURCE_DIR = Path(__file__).with_name("cuda")
_LOCAL_INCLUDE = re.compile(r'\s*#include "([\w.]+\.cuh)"')
MMA_M, MMA_N, MMA_K = 16, 8, 16
MIN_COMPUTE_CAPABILITY = (8, 0)  # mma.sync.m16n8k16 with f16 inputs
HOPPER_MAX_SHARED_BYTES = 227 * 1024  # a block's shared memory on sm_90, with the dynamic opt-in


@functools.cache
def is_available() -> bool:
    """True on a real GPU of compute capability 8.0+ with cffi installed (the pointer passing)."""
    return unavailable_reason() is None


@functools.cache
def unavailable_reason() -> str | None:
    """Why the tensor-core kernels cannot run here, with the fix where there is one; None when they can."""
    if IS_SIMULATOR:
        return "the CUDA simulator runs the pure-Numba twins"
    try:
        from numba import cuda

        if not cuda.is_available():
            return "no CUDA GPU is available"
        from strata.gpu.memory import install_manager

        install_manager()  # the query below makes the process's context: with the ledger's manager
        capability = cuda.get_current_device().compute_capability
    except Exception as exc:
        return f"the GPU cannot be queried ({exc!r})"
    if capability < MIN_COMPUTE_CAPABILITY:
        return f"the GPU's compute capability {capability} is below {MIN_COMPUTE_CAPABILITY} (mma.sync with f16)"
    try:
        import cffi  # noqa: F401
    except ImportError:
        return "cffi is not installed; install it (pip install 'strata[gpu]') to pass tiles to the CUDA C++ kernels"
    return None


@functools.cache
def max_shared_bytes() -> int:
    """The shared memory a block may have on this GPU with the dynamic opt-in; in the simulator (or with
    no GPU at all) Hopper's, so configs validate there as on the reference H200."""
    if IS_SIMULATOR or not _has_gpu():
        return HOPPER_MAX_SHARED_BYTES
    from numba import cuda
    from numba.cuda.cudadrv.driver import binding

    attribute = binding.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    err, value = binding.cuDeviceGetAttribute(attribute, binding.CUdevice(cuda.get_current_device().id))
    if err != binding.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot read the device's shared memory per block: {err}")
    return int(value)


def _has_gpu() -> bool:
    try:
        from numba import cuda

        return cuda.is_available()
    except Exception:
        return False


@functools.cache
def ffi():
    """The cffi FFI whose ``from_buffer`` turns a Numba array into a pointer inside kernels."""
    import cffi

    return cffi.FFI()


def source(name: str) -> str:
    """Path of a CUDA C++ source under kernels/cuda/."""
    path = CUDA_SOURCE_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"missing CUDA source {path}")
    return str(path)


@functools.cache
def source_text(name: str) -> str:
    """A source under kernels/cuda/ with its local ``#include "x.cuh"`` lines replaced by those files' text
    (NVRTC searches only the CUDA and Numba include paths, not the source's folder)."""
    lines = []
    for line in Path(source(name)).read_text().splitlines(keepends=True):
        match = _LOCAL_INCLUDE.match(line)
        lines.append(source_text(match.group(1)) if match else line)
    return "".join(lines)


@functools.cache
def cu_source(name: str, suffix: str = ""):
    """The linkable code of kernels/cuda/<name>, with `suffix` appended (on-demand instantiations): on a
    GPU its LTO-IR or PTX as each link took it, compiled once (ptx_cache.py); elsewhere the source, which
    nothing compiles there.
    One object per text: a kernel links each object once, and two copies of a text would define its
    symbols twice."""
    from numba import cuda

    label = f"{name}-{hashlib.sha1(suffix.encode()).hexdigest()[:12]}" if suffix else name  # one name per text
    text = source_text(name) + suffix
    if not is_available():
        return cuda.CUSource(text.encode(), name=label)
    from .ptx_cache import compiled_code, is_lto_link, link_cc

    is_lto = is_lto_link()
    code = compiled_code(text, label, link_cc(cuda.get_current_device().compute_capability), is_lto)
    return cuda.LTOIR(code, name=label) if is_lto else cuda.PTXSource(code, name=label)


def declare(name: str, argtypes: tuple, source_name: str, suffix: str = ""):
    """Declare ``extern "C" __device__ void name(argtypes...)`` from kernels/cuda/<source_name> (+ suffix)."""
    from numba import cuda

    return cuda.declare_device(name, types.void(*argtypes), link=[cu_source(source_name, suffix)], abi="c")


HALF_PTR = types.CPointer(types.float16)
FLOAT_PTR = types.CPointer(types.float32)
INT32 = types.int32
