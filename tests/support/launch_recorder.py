"""Every kernel launch under the CUDA simulator, with the argument types a GPU compiles it for.

On a GPU a Numba kernel compiles once per argument types (array dtype, rank and layout, scalar type),
so a launch with types the load's warm-up did not launch compiles inside a request. The simulator
compiles nothing; this recorder lets a CI test ask the GPU's question anyway: is every launch of a
request one the warm-up made?"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field

import numba
import numpy as np


@dataclass
class LaunchRecorder:
    launches: set = field(default_factory=set)  # (kernel's function, argument types)
    counts: collections.Counter = field(default_factory=collections.Counter)  # launches by kernel name

    def names(self, launches=None) -> list[str]:
        """Each launch as the kernel's name, the constants its factory closed over (a row count, a format)
        and its argument types."""
        return sorted(f"{fn.__module__}.{fn.__qualname__}{_constants(fn)}{types}"
                      for fn, types in (self.launches if launches is None else launches))


@contextlib.contextmanager
def recording_launches(monkeypatch):
    """Record the simulator's kernel launches (not device functions called inside them) while the
    context is open."""
    from numba.cuda.simulator import kernel as simulated

    recorder = LaunchRecorder()
    call = simulated.FakeCUDAKernel.__call__

    def recording_call(kernel, *args):
        if not kernel._device and not simulated._kernel_context:
            recorder.launches.add((kernel.fn, tuple(_numba_type(a) for a in args)))
            recorder.counts[kernel.fn.__name__] += 1
        return call(kernel, *args)

    monkeypatch.setattr(simulated.FakeCUDAKernel, "__call__", recording_call)
    try:
        yield recorder
    finally:
        monkeypatch.setattr(simulated.FakeCUDAKernel, "__call__", call)


def _numba_type(value) -> str:
    array = getattr(value, "_ary", value)  # a simulated device array holds its host array
    if isinstance(array, np.ndarray) and array.ndim > 0:
        flags = array.flags
        layout = "C" if flags.c_contiguous else "F" if flags.f_contiguous else "A"
        readonly = "" if flags.writeable else "readonly "  # Numba compiles a read-only array apart
        return f"{readonly}array({array.dtype}, {array.ndim}d, {layout})"
    try:
        return str(numba.typeof(value))
    except ValueError:
        return type(value).__name__


def _constants(fn) -> list:
    return [c.cell_contents for c in fn.__closure__ or () if isinstance(c.cell_contents, (int, str, float))]
