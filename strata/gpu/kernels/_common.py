"""Host-side helpers shared by every kernel family: input checks, output allocation, constants.

Arrays handed to a host wrapper are either NumPy arrays (Numba copies them to the device and
back around the launch: fine for tests, slow for serving) or device arrays (`cuda.to_device`,
`cuda.device_array`, or anything exposing `__cuda_array_interface__` wrapped by
`cuda.as_cuda_array`). Outputs are allocated on the device when any input lives there.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

OCTET = 8  # elements one thread dequantizes per step: 8 of any format = at most two uint32 words
MAX_STATIC_SHARED_BYTES = 48 * 1024  # a block's static shared arrays; more needs a dynamic opt-in
IS_SIMULATOR = bool(_cuda_config.ENABLE_CUDASIM)


def is_device_array(a) -> bool:
    return not isinstance(a, np.ndarray) and hasattr(a, "copy_to_host")


def is_c_contiguous(a) -> bool:
    if isinstance(a, np.ndarray):
        return a.flags.c_contiguous
    return a.is_c_contiguous()


def check_array(name: str, a, *, dtypes=None, ndim: int | None = None, shape: tuple | None = None):
    """Raise TypeError/ValueError naming `name` unless `a` is a C-contiguous array as described.

    `shape` entries that are None are not checked.
    """
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be a NumPy or device array, got {type(a).__name__}")
    if dtypes is not None:
        allowed = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)))
        if np.dtype(a.dtype) not in allowed:
            names = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {names}, got {np.dtype(a.dtype)}")
    if ndim is not None and len(a.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if shape is not None:
        if len(a.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, a.shape)):
            want = tuple("*" if w is None else w for w in shape)
            raise ValueError(f"{name} must have shape {want}, got {tuple(a.shape)}")
    if not is_c_contiguous(a):
        raise ValueError(f"{name} must be C-contiguous")
    return a


def check_positive(name: str, value: int) -> int:
    if int(value) != value or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def check_power_of_two(name: str, value: int) -> int:
    check_positive(name, value)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


def any_on_device(*arrays) -> bool:
    return any(is_device_array(a) for a in arrays if a is not None)


def empty(shape, dtype, *like):
    """An output array: on the device if any of `like` is a device array, else on the host."""
    if any_on_device(*like):
        return cuda.device_array(shape, dtype=dtype)
    return np.empty(shape, dtype=dtype)


def zeros(shape, dtype, *like):
    host = np.zeros(shape, dtype=dtype)
    return cuda.to_device(host) if any_on_device(*like) else host


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stand_in(source, dtype, ndim: int):
    """An array for an argument the kernel variant never touches, of `dtype` and `ndim` dims.

    On the device, a view of `source` when the dtype matches, so a captured step allocates
    nothing. On the host, a fresh array: Numba copies every host argument back after a launch,
    and a stale copy of an array the kernel wrote would overwrite its result.
    """
    if is_device_array(source) and np.dtype(source.dtype) == np.dtype(dtype):
        return source.reshape(-1)[:1].reshape((1,) * ndim)
    return zeros((1,) * ndim, dtype, source)


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(float(value))
