"""Kernel launches without Numba's per-launch argument marshalling.

Numba turns each argument of each launch into kernel parameters in Python (a device array becomes
5 + 2 * ndim of them, through a cuda.core memory view), and builds a launch configuration and a
stream object every time: tens of microseconds a launch of a kernel with a dozen arrays. A prefill
layer issues ~28 launches, and a 2k chunk is bound by the host's time to issue them (see
docs/PERFORMANCE.md). ``Kernel`` wraps one Numba kernel and does that work once per argument
types: the first launch of each goes through Numba (compiling if need be), and the parameters it
would pack are checked against Numba's own; later launches pack them directly and call the same
cuda.core launch with a configuration kept from before. Argument types it does not know (host
arrays, records, tuples), a kernel Numba specializes per launch configuration, or a parameter
list that differs from Numba's keep Numba's path.

Each kernel's compiled code is kept between processes (``kernel_cache.py``). In the CUDA simulator
``jit`` returns Numba's kernel itself.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
from numba import cuda

from ._common import IS_SIMULATOR, is_device_array
from .kernel_cache import DiskCache

if not IS_SIMULATOR:  # the launch path's calls, resolved once (a function-level import costs each launch)
    from cuda.core import launch as _cuda_core_launch
    from numba.cuda.cudadrv.driver import _to_core_stream

_NUMBA = object()  # an entry: these argument types launch through Numba
_SCALAR_TYPES = (int, float, bool, np.integer, np.floating, np.bool_)
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1
# launch configurations kept a kernel, the least recently used dropped first: a prefill kernel's grid follows
# its chunk's length, and a server sees many (each ~0.4 KiB; a chunk reuses its configuration for every layer)
_MAX_CONFIGS = 64


def jit(fn=None, **options):
    """``cuda.jit`` for a global kernel, launched through ``Kernel`` (Numba's kernel in the simulator)."""
    if fn is None:
        return lambda f: jit(f, **options)
    dispatcher = cuda.jit(**options)(fn) if options else cuda.jit(fn)
    if IS_SIMULATOR:
        return dispatcher
    dispatcher._cache = DiskCache(dispatcher)  # Numba asks it before compiling, and hands it what it compiled
    return Kernel(dispatcher)


class Kernel:
    """A Numba kernel, launched as one: ``kernel[grid, block, stream, shared_bytes](*args)``. Any other
    attribute is the Numba kernel's. A launch with dynamic shared memory first allows the compiled
    kernel that much (past 48 KiB a kernel must be allowed it; the attribute is per device)."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._entries: dict = {}  # argument key -> _Entry, or _NUMBA
        self._configs: dict = {}  # (grid, block, shared bytes, cooperative) -> cuda.core LaunchConfig
        self._allowed_shared_bytes: dict = {}  # a compiled function -> the dynamic shared memory it was allowed

    def __getattr__(self, name):
        return getattr(self.dispatcher, name)

    def __getitem__(self, launch_config):
        if len(launch_config) not in (2, 3, 4):
            raise ValueError("a launch takes [grid, block], [grid, block, stream] or "
                             "[grid, block, stream, shared bytes]")
        grid, block, *rest = launch_config
        stream = rest[0] if rest else 0
        shared_bytes = rest[1] if len(rest) > 1 else 0
        return functools.partial(self.launch, grid, block, stream, shared_bytes)

    def launch(self, grid, block, stream, shared_bytes: int, *args) -> None:
        key = argument_key(args)
        entry = self._entries.get(key) if key is not None else _NUMBA
        if entry is None:
            entry = self._first_launch(key, grid, block, stream, shared_bytes, args)
            self._entries[key] = entry
            return
        if entry is _NUMBA:
            if shared_bytes:
                self._allow_shared(self._compiled(args), shared_bytes)
            self.dispatcher[grid, block, stream, shared_bytes](*args)
            return
        if shared_bytes:
            self._allow_shared(entry.kernel, shared_bytes)
        core_launch(stream, self._config(grid, block, shared_bytes, entry.kernel), entry.kernel, entry.pack(args))

    def _compiled(self, args):
        signature = tuple(self.dispatcher.typeof_pyval(a) for a in args)
        # compile() takes numba-cuda's compiler lock even for a kernel it has: look the kernel up first
        return self.dispatcher.overloads.get(signature) or self.dispatcher.compile(signature)

    def _first_launch(self, key, grid, block, stream, shared_bytes, args):
        compiled = self._compiled(args)
        if shared_bytes:
            self._allow_shared(compiled, shared_bytes)
        self.dispatcher[grid, block, stream, shared_bytes](*args)
        dispatcher = self.dispatcher
        if dispatcher.specialized or getattr(dispatcher, "_launch_config_sensitive", False) or \
                getattr(compiled, "launch_config_sensitive", False) or compiled.debug or compiled.extensions:
            return _NUMBA
        entry = _Entry(compiled)
        return entry if entry.matches_numba(args, stream) else _NUMBA

    def _allow_shared(self, compiled, num_bytes: int) -> None:
        """Allowed once per compiled kernel's function on a device (the attribute is the function's) and size,
        never lowered: two argument keys may share a kernel."""
        function = compiled._codelibrary.get_cufunc()  # one a device and context
        if num_bytes > self._allowed_shared_bytes.get(function, 0):
            allow_dynamic_shared(compiled, num_bytes)
            self._allowed_shared_bytes[function] = num_bytes

    def _config(self, grid, block, shared_bytes: int, compiled):
        grid = tuple(grid) if isinstance(grid, list) else grid
        block = tuple(block) if isinstance(block, list) else block
        key = (grid, block, shared_bytes, compiled.cooperative)
        config = self._configs.pop(key, None)
        if config is None:
            if len(self._configs) >= _MAX_CONFIGS:
                del self._configs[next(iter(self._configs))]  # the least recently used
            config = launch_config(grid, block, shared_bytes, compiled.cooperative)
        self._configs[key] = config  # now the most recently used
        return config


def argument_key(args) -> tuple | None:
    """What selects a compiled kernel and its parameter layout: each device array's class, dtype, rank and
    layout (Numba's: C, F, or A where strided or broadcast), each scalar's class; None for anything else."""
    key = []
    for a in args:
        if _is_device_array(a):
            key.append((type(a), a.dtype, a.ndim, _layout(a)))
        elif type(a) is int and not _INT64_MIN <= a <= _INT64_MAX:
            return None  # Numba types it uint64 (or refuses it)
        elif isinstance(a, _SCALAR_TYPES):
            key.append(type(a))
        else:
            return None
    return tuple(key)


def _is_device_array(a) -> bool:  # a device record has no contiguity: Numba packs it
    return is_device_array(a) and hasattr(a, "is_c_contiguous")


def _layout(a) -> str:  # as DeviceNDArray._numba_type_ decides it
    if 0 in a.strides and a.size != 0:  # broadcast
        return "A"
    if a.is_c_contiguous():
        return "C"
    return "F" if a.is_f_contiguous() else "A"


class _Entry:
    """One compiled kernel's parameters for one argument key: what Numba's ``_Kernel._prepare_args`` packs."""

    def __init__(self, compiled):
        from numba.cuda import types

        self.kernel = compiled
        self._packers = []
        for ty in compiled.argument_types:
            if isinstance(ty, types.Array):
                self._packers.append(_array_parameters)
            elif isinstance(ty, types.Integer):
                self._packers.append(_ctype_packer(getattr(ctypes, f"c_{ty}")))
            elif ty == types.float32:
                self._packers.append(_ctype_packer(ctypes.c_float))
            elif ty == types.float64:
                self._packers.append(_ctype_packer(ctypes.c_double))
            elif ty == types.boolean:
                self._packers.append(_as_is)
            else:
                self._packers.append(None)

    def pack(self, args) -> list:
        params = []
        for packer, value in zip(self._packers, args):
            packer(value, params)
        return params

    def matches_numba(self, args, stream) -> bool:
        """Whether ``pack`` gives the parameters Numba gave these arguments, value for value and ctypes type
        for ctypes type."""
        if None in self._packers:
            return False
        numba_params, retr = [], []
        for ty, value in zip(self.kernel.argument_types, args):
            self.kernel._prepare_args(ty, value, stream, retr, numba_params)
        ours = self.pack(args)
        return len(ours) == len(numba_params) and all(_same_parameter(a, b) for a, b in zip(ours, numba_params))


def _array_parameters(a, params: list) -> None:
    params += (0, 0, a.size, a.dtype.itemsize, a.device_ctypes_pointer.value or 0)
    params += a.shape
    params += a.strides


def _ctype_packer(ctype):
    def pack(value, params: list) -> None:
        params.append(ctype(value))

    return pack


def _as_is(value, params: list) -> None:
    params.append(value)


def _same_parameter(ours, theirs) -> bool:
    if isinstance(theirs, ctypes._SimpleCData):
        return type(ours) is type(theirs) and ours.value == theirs.value
    return not isinstance(ours, ctypes._SimpleCData) and ours == theirs


def launch_config(grid, block, shared_bytes: int, is_cooperative: bool):
    """cuda.core's launch configuration, as Numba makes it for a launch."""
    from cuda.core import LaunchConfig
    from numba.cuda._compat import CUDA_CORE_GE_1_0
    from numba.cuda.errors import normalize_kernel_dimensions

    griddim, blockdim = normalize_kernel_dimensions(grid, block)
    cooperative = {"is_cooperative" if CUDA_CORE_GE_1_0 else "cooperative_launch": is_cooperative}
    return LaunchConfig(grid=griddim, block=blockdim, shmem_size=shared_bytes, **cooperative)


def core_launch(stream, config, compiled, params: list) -> None:
    """cuda.core's launch of the compiled kernel on ``stream`` (0, a Numba stream or a graph builder), as
    Numba's ``_Kernel.launch`` makes it."""
    _cuda_core_launch(_to_core_stream(stream), config, compiled._codelibrary.get_cufunc().kernel, *params)


def allow_dynamic_shared(compiled, num_bytes: int) -> None:
    """Let the compiled kernel (numba-cuda's _Kernel) take ``num_bytes`` of dynamic shared memory on the
    current device."""
    from numba.cuda.cudadrv.driver import binding, driver

    # the call numba-cuda makes for a function's shared-memory carveout (set_shared_memory_carveout);
    # numba-cuda has none for this attribute
    function = compiled._codelibrary.get_cufunc()
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, num_bytes, function.handle, function.device.id)
