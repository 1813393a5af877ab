"""Compiled kernels kept between processes, so that a process's warm-up loads its kernels instead of
compiling them.

Numba compiles every kernel specialization anew in each process (Python to LLVM to PTX, then a link
with the CUDA C++ code it calls), and a process of the benchmark spends most of its load doing so.
Numba's own disk cache cannot hold these kernels: it refuses a kernel that links CUDA C++ code, and
it keys an entry by the kernel's own source file alone, so an edit to a device function defined in
another file would load a stale kernel. Here the dispatcher's cache (the object Numba asks before
compiling and hands every new kernel to) keeps the linked cubin under a key of:
- every source file of the ``strata`` package (any edit anywhere compiles everything again),
- the kernel function, its defaults and what it closes over, recursively through the device functions
  it captures (two kernels of one factory with other arguments are two entries); a closure holding
  anything whose identity cannot be written down is not cached,
- the signature, the device's architecture and the compilers' and Numba's versions.
An entry that is cut, unreadable or fails to load is compiled again. Entries of other source trees
are removed whenever an entry is written.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import marshal
import pickle
import sys
import types
from pathlib import Path

import numpy as np
from numba.cuda.core.caching import NullCache

from . import ptx_cache

log = logging.getLogger("strata.kernels")
_DIGEST_BYTES = 32
_SOURCE_SUFFIXES = (".py", ".cu", ".cuh")
_MAX_DEPTH = 16
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


class Uncacheable(Exception):
    """An object in a kernel's closure whose identity cannot be written down."""


def cache_dir() -> Path:
    return ptx_cache.cache_dir().parent / "kernels"


@functools.cache
def source_digest(root: Path | None = None) -> str:
    """sha256 over the path and bytes of every .py, .cu and .cuh file of the package (``root``)."""
    root = Path(__file__).resolve().parents[2] if root is None else root
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def fingerprint(obj, depth: int = 0) -> str:
    """A text that is the same for the same value in any process (never an ``id``); Uncacheable for
    an object of a kind it does not know."""
    if depth > _MAX_DEPTH:
        raise Uncacheable("nested too deeply")
    inner = functools.partial(fingerprint, depth=depth + 1)
    if isinstance(obj, _SCALARS):
        return f"{type(obj).__name__}:{obj!r}"
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__}(" + ",".join(map(inner, obj)) + ")"
    if isinstance(obj, (set, frozenset)):
        return "set(" + ",".join(sorted(map(inner, obj))) + ")"
    if isinstance(obj, dict):
        return "dict(" + ",".join(sorted(f"{inner(k)}={inner(v)}" for k, v in obj.items())) + ")"
    if isinstance(obj, enum.Enum):
        return f"enum:{_qualified(type(obj))}.{obj.name}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = ",".join(f"{f.name}={inner(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"dataclass:{_qualified(type(obj))}({fields})"
    if isinstance(obj, np.dtype):
        return f"dtype:{obj.str}"
    if isinstance(obj, np.generic):
        return f"numpy:{obj.dtype.str}:{obj.item()!r}"
    if isinstance(obj, type):
        return f"class:{_qualified(obj)}"
    if isinstance(obj, types.ModuleType):
        return f"module:{obj.__name__}"
    if isinstance(obj, types.FunctionType):
        return function_fingerprint(obj, depth + 1)
    if isinstance(obj, types.BuiltinFunctionType):
        return f"builtin:{getattr(obj, '__module__', '')}.{obj.__qualname__}"
    if hasattr(obj, "py_func") and hasattr(obj, "targetoptions"):  # a Numba dispatcher (device function)
        return f"dispatcher({function_fingerprint(obj.py_func, depth + 1)},{inner(obj.targetoptions)})"
    if hasattr(obj, "dispatcher") and hasattr(obj.dispatcher, "py_func"):  # launcher.Kernel
        return f"kernel({inner(obj.dispatcher)})"
    if type(obj).__module__ == "cffi.api" and obj is _tile_ffi():  # the tensor-core kernels' pointer maker
        return "cffi:tensor_core.ffi"
    if type(obj).__name__ == "ExternFunction" and hasattr(obj, "sig"):  # cuda.declare_device's
        # its linked code is a kernels/cuda source (in the source digest) plus a suffix made from its name
        return f"extern:{obj.name}:{obj.sig}"
    if hasattr(obj, "data") and type(obj).__module__.startswith("numba.cuda.cudadrv.linkable_code"):
        data = obj.data if isinstance(obj.data, bytes) else str(obj.data).encode()
        return f"linkable:{type(obj).__name__}:{obj.name}:{hashlib.sha256(data).hexdigest()}"
    if type(obj).__module__.startswith(("numba.core.types", "numba.cuda.types")) or \
            type(obj).__module__.startswith("numba.core.typing.templates"):
        return f"numba-type:{obj}"
    raise Uncacheable(f"{_qualified(type(obj))} in a kernel's closure")


def _tile_ffi():
    from .tensor_core import ffi

    return ffi()


def function_fingerprint(fn: types.FunctionType, depth: int = 0) -> str:
    """The function's code, defaults, closure and the globals its code names (modules and classes by name)."""
    inner = functools.partial(fingerprint, depth=depth + 1)
    code = fn.__code__
    cells = [cell.cell_contents for cell in fn.__closure__ or ()]
    named = sorted(name for name in _code_names(code) if name in fn.__globals__)
    globals_ = ",".join(f"{name}={inner(fn.__globals__[name])}" for name in named)
    return (f"function:{fn.__module__}.{fn.__qualname__}:{hashlib.sha256(marshal.dumps(code)).hexdigest()}"
            f"(defaults={inner(fn.__defaults__)},kwdefaults={inner(fn.__kwdefaults__)},"
            f"closure={inner(cells)},globals={globals_})")


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class DiskCache(NullCache):
    """The cache a kernel's dispatcher asks before compiling (``load_overload``) and gives each kernel it
    compiled (``save_overload``)."""

    def __init__(self, dispatcher, folder: Path | None = None, environment: str | None = None):
        self.dispatcher = dispatcher
        self.folder = cache_dir() if folder is None else folder
        self._environment = environment
        self._kernel_key: str | None | bool = False  # False: not yet computed; None: not cacheable

    @property
    def cache_path(self):
        return str(self.folder)

    def load_overload(self, sig, target_context):
        path = self._path(sig)
        if path is None:
            return None
        try:
            kept = path.read_bytes()
        except OSError:
            return None
        payload, digest = kept[:-_DIGEST_BYTES], kept[-_DIGEST_BYTES:]
        try:
            if len(kept) <= _DIGEST_BYTES or hashlib.sha256(payload).digest() != digest:
                raise ValueError("cut or damaged")
            kernel = rebuild(pickle.loads(payload), _current_cc())
        except Exception as exc:  # any failure only costs the compile this entry would have saved
            log.debug("kernel cache entry %s not used: %r", path.name, exc)
            path.unlink(missing_ok=True)
            return None
        return kernel

    def save_overload(self, sig, kernel):
        path = self._path(sig)
        if path is None:
            return
        try:
            payload = pickle.dumps(reduce(kernel), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # Uncacheable, or a state that does not pickle: compiled in every process
            log.debug("kernel %s not kept: %r", path.name, exc)
            return
        _remove_other_trees(self.folder, source_digest())
        ptx_cache._write_atomic(path, payload + hashlib.sha256(payload).digest())

    def _path(self, sig) -> Path | None:
        if self._kernel_key is False:
            try:
                self._kernel_key = fingerprint(self.dispatcher)
            except Exception as exc:  # Uncacheable, or an object that failed to describe itself
                log.debug("kernel %s is compiled in every process: %s", self.dispatcher.py_func.__qualname__, exc)
                self._kernel_key = None
        if self._kernel_key is None:
            return None
        environment = self._environment if self._environment is not None else _environment()
        key = hashlib.sha256("\0".join((self._kernel_key, str(sig), environment)).encode()).hexdigest()[:32]
        name = self.dispatcher.py_func.__qualname__.replace("<locals>.", "").replace("<", "").replace(">", "")
        return self.folder / f"{source_digest()[:12]}-{name[-60:]}-{key}.kernel"


def reduce(kernel) -> dict:
    """What rebuilds ``kernel`` (numba-cuda's ``_Kernel``): its state and its code library's, with the
    linked cubin of this device and none of the sources it was linked from."""
    library = kernel._codelibrary
    if kernel.extensions or kernel.debug or getattr(kernel, "launch_config_sensitive", False):
        raise Uncacheable("a kernel with extensions, debug code or a launch-configuration specialization")
    if getattr(library, "_setup_functions", None) or getattr(library, "_teardown_functions", None):
        raise Uncacheable("linked code with setup or teardown callbacks")
    if any(getattr(obj, "__cuda_array_interface__", None) is not None
           for obj in (getattr(library, "referenced_objects", None) or {}).values()):
        raise Uncacheable("a kernel that captures a device array")
    if any(_is_numba_runtime(f) for f in library._linking_files):
        raise Uncacheable("a kernel linked with Numba's runtime")
    cc = _current_cc()
    cubin = library._cubin_cache.get(cc)
    if not cubin:
        raise Uncacheable(f"no linked cubin for {cc}")
    return {
        "kernel": dict(cooperative=kernel.cooperative, name=kernel.entry_name, signature=kernel.signature,
                       debug=kernel.debug, lineinfo=kernel.lineinfo, call_helper=kernel.call_helper,
                       extensions=kernel.extensions, shared_memory_carveout=kernel.shared_memory_carveout,
                       launch_config_sensitive=False),
        "library": dict(codegen=None, name=library.name, entry_name=library._entry_name, llvm_strs=[],
                        ptx_cache={}, cubin_cache={cc: cubin}, linkerinfo_cache={},
                        max_registers=library._max_registers, nvvm_options=library._nvvm_options,
                        needs_cudadevrt=library.needs_cudadevrt, nrt=False, use_cooperative=library.use_cooperative,
                        lto=library._lto),
    }


def _is_numba_runtime(linked) -> bool:
    if getattr(linked, "nrt", False):
        return True
    try:
        from numba.cuda.codegen import NRT_LIBRARY
    except ImportError:  # the simulator's numba-cuda has no code library (and compiles nothing)
        return False
    return linked is NRT_LIBRARY


def rebuild(state: dict, cc: tuple):
    """The kernel ``reduce`` wrote, loaded on the current device (a failure here raises, not at a launch)."""
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.dispatcher import _Kernel

    if cc not in state["library"]["cubin_cache"]:
        raise ValueError(f"no cubin for {cc}")
    library = CUDACodeLibrary._rebuild(**state["library"])
    kernel = _Kernel._rebuild(codelibrary=library, **state["kernel"])
    kernel.bind()
    return kernel


def _current_cc() -> tuple:
    from numba import cuda

    from .ptx_cache import link_cc

    return link_cc(cuda.get_current_device().compute_capability)


@functools.cache
def _environment() -> str:
    import numba

    return "\0".join((ptx_cache._compiler_versions(), f"numba {numba.__version__}", repr(_current_cc()),
                      sys.version.split()[0]))


def _remove_other_trees(folder: Path, digest: str) -> None:
    """Entries written by other source trees (an entry is written only where a kernel was compiled)."""
    try:
        for path in folder.glob("*.kernel"):
            if not path.name.startswith(digest[:12] + "-"):
                path.unlink(missing_ok=True)
    except OSError:
        pass

