"""launcher.Kernel on recording stand-ins for Numba's kernel: which launches take Numba's path, what the
direct path packs, and when a compiled kernel is allowed its dynamic shared memory. The real path runs in
every GPU kernel test (every kernel is a Kernel there) and in tests/gpu/test_launcher_gpu.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from numba.cuda import types

from strata.gpu.kernels import launcher


class _Pointer:
    def __init__(self, value):
        self.value = value


class _DeviceArray:
    """What the launcher reads of a Numba device array."""

    def __init__(self, shape, dtype=np.float32, pointer=4096, strides=None):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
        self.size = int(np.prod(shape))
        self.strides = strides or tuple(int(s) for s in np.empty(shape, dtype).strides)
        self.device_ctypes_pointer = _Pointer(pointer)

    def copy_to_host(self):
        raise AssertionError("a launch never reads an array back")

    def is_c_contiguous(self):  # an empty array is contiguous whatever its strides, as in NumPy
        return self.size == 0 or self.strides == tuple(int(s) for s in np.empty(self.shape, self.dtype).strides)

    def is_f_contiguous(self):
        return self.strides == tuple(int(s) for s in np.empty(self.shape, self.dtype, order="F").strides)


def _numba_type(value):
    if isinstance(value, _DeviceArray):
        return types.Array(types.float32 if value.dtype == np.float32 else types.int32, value.ndim, "C")
    return {int: types.int64, float: types.float64, np.int32: types.int32, np.float32: types.float32}[type(value)]


class _Compiled:
    """numba-cuda's _Kernel: its argument types and its own packing (``_prepare_args``, as Numba writes it)."""

    def __init__(self, argument_types, is_packing_wrong=False):
        self.argument_types = argument_types
        self.debug, self.extensions, self.cooperative = False, [], False
        self.is_packing_wrong = is_packing_wrong
        function = object()  # the device function, one a context
        self._codelibrary = type("CodeLibrary", (), {"get_cufunc": lambda library: function})()

    def _prepare_args(self, ty, value, stream, retr, params):
        if isinstance(ty, types.Array):
            params += [0, 0, value.size, value.dtype.itemsize, value.device_ctypes_pointer.value, *value.shape,
                       *value.strides]
        elif isinstance(ty, types.Integer):
            params.append(getattr(ctypes, f"c_{ty}")(value + self.is_packing_wrong))
        else:
            params.append(ctypes.c_double(value) if ty == types.float64 else ctypes.c_float(value))


class _Dispatcher:
    def __init__(self, is_packing_wrong=False):
        self.overloads, self.calls, self.specialized = {}, [], False
        self.is_packing_wrong = is_packing_wrong

    def typeof_pyval(self, value):
        return _numba_type(value)

    def compile(self, signature):
        self.calls.append(("compile", signature))
        self.overloads[signature] = _Compiled(signature, self.is_packing_wrong)
        return self.overloads[signature]

    def __getitem__(self, launch_config):
        return lambda *args: self.calls.append(("numba launch", launch_config, args))


@pytest.fixture
def recorded(monkeypatch):
    """The direct launches and the allowances, as (what, ...) tuples."""
    calls = []
    monkeypatch.setattr(launcher, "core_launch", lambda stream, config, compiled, params:
                        calls.append(("direct launch", stream, config, compiled, params)))
    monkeypatch.setattr(launcher, "launch_config", lambda grid, block, shared, coop: ("config", grid, block, shared))
    monkeypatch.setattr(launcher, "allow_dynamic_shared", lambda compiled, n: calls.append(("allow", compiled, n)))
    return calls


def test_the_first_launch_is_numbas_and_the_next_are_direct(recorded):
    dispatcher = _Dispatcher()
    kernel = launcher.Kernel(dispatcher)
    x, y = _DeviceArray((3, 4), pointer=1 << 20), _DeviceArray((3,), pointer=2 << 20)
    kernel[(2, 1), 128](x, y, np.int32(7), 0.5)
    assert [c[0] for c in dispatcher.calls] == ["compile", "numba launch"] and recorded == []
    compiled = next(iter(dispatcher.overloads.values()))
    kernel[(2, 1), 128](x, y, np.int32(9), 0.25)
    assert len(dispatcher.calls) == 2  # no second Numba launch
    (what, stream, config, launched, params), = recorded
    assert (what, stream, config, launched) == ("direct launch", 0, ("config", (2, 1), 128, 0), compiled)
    assert params[:9] == [0, 0, 12, 4, 1 << 20, 3, 4, 16, 4]  # meminfo, parent, size, itemsize, data, shape, strides
    assert params[9:16] == [0, 0, 3, 4, 2 << 20, 3, 4]
    assert type(params[16]) is ctypes.c_int32 and params[16].value == 9
    assert type(params[17]) is ctypes.c_double and params[17].value == 0.25


def test_packing_unlike_numbas_keeps_numbas_path(recorded):
    dispatcher = _Dispatcher(is_packing_wrong=True)
    kernel = launcher.Kernel(dispatcher)
    for value in (1, 2, 3):
        kernel[1, 32](_DeviceArray((8,)), value)
    assert [c[0] for c in dispatcher.calls] == ["compile"] + ["numba launch"] * 3 and recorded == []


def test_host_arrays_and_new_layouts_are_told_apart(recorded):
    dispatcher = _Dispatcher()
    kernel = launcher.Kernel(dispatcher)
    host = np.zeros(4, np.float32)
    kernel[1, 32](host)
    kernel[1, 32](host)
    assert [c[0] for c in dispatcher.calls].count("numba launch") == 2 and recorded == []
    contiguous, strided = _DeviceArray((4, 4)), _DeviceArray((4, 4), strides=(32, 4))
    assert launcher.argument_key((contiguous,)) != launcher.argument_key((strided,))
    assert launcher.argument_key((contiguous,)) != launcher.argument_key((_DeviceArray((4, 4), np.int32),))
    assert launcher.argument_key((np.int32(1),)) != launcher.argument_key((1,))
    assert launcher.argument_key((host,)) is None
    assert launcher.argument_key((2**63,)) is None  # Numba types it uint64
    empty = _DeviceArray((0, 4), strides=(0, 4))
    assert launcher.argument_key((empty,)) == launcher.argument_key((_DeviceArray((0, 4)),))  # not broadcast: C


def test_dynamic_shared_memory_is_allowed_once_per_kernel_and_never_lowered(recorded):
    dispatcher = _Dispatcher()
    kernel = launcher.Kernel(dispatcher)
    x = _DeviceArray((8,))
    kernel[1, 32, 0, 61_440](x, 1)
    compiled = next(iter(dispatcher.overloads.values()))
    assert recorded == [("allow", compiled, 61_440)]  # before Numba's first launch
    kernel[1, 32, 0, 61_440](x, 2)
    kernel[1, 32, 0, 40_000](x, 3)  # a smaller block: still allowed
    kernel[1, 32, 0, 98_304](x, 4)
    allowances = [c for c in recorded if c[0] == "allow"]
    assert allowances == [("allow", compiled, 61_440), ("allow", compiled, 98_304)]
    assert [c[2][3] for c in recorded if c[0] == "direct launch"] == [61_440, 40_000, 98_304]


def test_a_kernel_numba_specializes_keeps_numbas_path(recorded):
    dispatcher = _Dispatcher()
    dispatcher.specialized = True
    kernel = launcher.Kernel(dispatcher)
    for value in (1, 2):
        kernel[1, 32](_DeviceArray((8,)), value)
    assert [c[0] for c in dispatcher.calls].count("numba launch") == 2 and recorded == []


def test_the_simulator_gets_numbas_kernel():
    def kernel(x):
        pass

    jitted = launcher.jit(kernel)
    assert isinstance(jitted, launcher.Kernel) != launcher.IS_SIMULATOR


def test_launch_configurations_are_kept_to_a_bound_the_least_recently_used_dropped(recorded, monkeypatch):
    monkeypatch.setattr(launcher, "_MAX_CONFIGS", 3)
    made = []
    monkeypatch.setattr(launcher, "launch_config", lambda grid, block, shared, coop: made.append(grid) or grid)
    kernel = launcher.Kernel(_Dispatcher())
    x = _DeviceArray((8,))
    for grid in (1, 2, 3, 1, 4, 1, 2):  # the first launch is Numba's; 4 drops 2, and the last 2 drops 3
        kernel[grid, 32](x)
    assert made == [2, 3, 1, 4, 2]  # 1's second launch hit
    assert [key[0] for key in kernel._configs] == [4, 1, 2]
