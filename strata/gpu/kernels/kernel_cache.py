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
An entry that is cut, unreadable or fails to load is compiled again. When an entry is written, other
source trees' entries go once a week has passed without their use, and beyond the _MAX_OTHER_TREES
most recently used (each edit makes a tree: a developer's edits must not pile up copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import logging
import pickle
import sys
import time
import types
from pathlib import Path

import numpy as np
from numba.cuda.core import event
from numba.cuda.core.caching import NullCache

from . import ptx_cache

log = logging.getLogger("strata.kernels")
_DIGEST_BYTES = 32
# another source tree's entries (an older install, a second checkout) go once unused this long: two trees
# in use share the folder, and a tree no longer run does not keep its kernels forever
_OTHER_TREE_MAX_IDLE_S = 7 * 86400
_MAX_OTHER_TREES = 2
_DIGEST_PREFIX_CHARS = 12  # an entry's name starts with its tree's digest, this long, and "-"
_SOURCE_SUFFIXES = (".py", ".cu", ".cuh")
_MAX_DEPTH = 64  # objects on one chain of captures: a runaway, not a real kernel
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
LOAD_EVENT = "strata:kernel-cache-load"  # a kernel loaded here, inside numba-cuda's lock (compile_events.py)
# distributions whose versions change the code a kernel compiles to (NVVM and nvJitLink come as wheels)
_COMPILER_DISTRIBUTIONS = ("numba", "llvmlite", "cuda-bindings", "cuda-python", "nvidia-")
_CODE_SETTINGS = ("BOUNDSCHECK", "CUDA_ENABLE_NRT", "OPT", "CUDA_DEBUGINFO_DEFAULT", "DEBUGINFO_DEFAULT",
                  "FORCE_CUDA_CC", "CUDA_DEFAULT_PTX_CC", "CUDA_PER_THREAD_DEFAULT_STREAM")


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


def fingerprint(obj, _active: frozenset = frozenset()) -> str:
    """A text that is the same for the same value in any process (never an ``id``); Uncacheable for
    an object of a kind it does not know, or for a cycle (a device function reaching itself)."""
    if id(obj) in _active or len(_active) > _MAX_DEPTH:
        raise Uncacheable("a cycle or a chain too long among a kernel's captured objects")
    inner = functools.partial(fingerprint, _active=_active | {id(obj)})
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
    if isinstance(obj, types.CodeType):
        return code_fingerprint(obj, inner)
    if isinstance(obj, types.FunctionType):
        return function_fingerprint(obj, inner)
    if isinstance(obj, types.BuiltinFunctionType):
        return f"builtin:{getattr(obj, '__module__', '')}.{obj.__qualname__}"
    if hasattr(obj, "py_func") and hasattr(obj, "targetoptions"):  # a Numba dispatcher (device function)
        return f"dispatcher({inner(obj.py_func)},{inner(obj.targetoptions)})"
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
    if type(obj).__module__.startswith(("numba.core.types", "numba.cuda.types", "numba.core.typing.templates")):
        return f"numba-type:{_qualified(type(obj))}:{obj}"
    raise Uncacheable(f"{_qualified(type(obj))} in a kernel's closure")


def _tile_ffi():
    from .tensor_core import ffi

    return ffi()


def code_fingerprint(code: types.CodeType, inner=fingerprint) -> str:
    """A code object's structure: its bytecode, names and constants (nested code included). Not its
    marshal bytes: those change with the reference counts of its constants, which compiling it changes."""
    parts = (code.co_name, code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
             code.co_code.hex(), code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)
    return f"code({parts!r},consts={inner(code.co_consts)})"


def function_fingerprint(fn: types.FunctionType, inner=fingerprint) -> str:
    """The function's code, defaults, closure and the globals its code names (modules and classes by name)."""
    code = fn.__code__
    cells = [cell.cell_contents for cell in fn.__closure__ or ()]
    named = sorted(name for name in _code_names(code) if name in fn.__globals__)
    globals_ = ",".join(f"{name}={inner(fn.__globals__[name])}" for name in named)
    return (f"function:{fn.__module__}.{fn.__qualname__}:{inner(code)}"
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
    compiled (``save_overload``). Nothing here raises: a failure costs only the compile it would have saved."""

    def __init__(self, dispatcher, folder: Path | None = None, environment: str | None = None):
        self.dispatcher = dispatcher
        self.folder = cache_dir() if folder is None else folder
        self._environment = environment
        self._kernel_key: str | None | bool = False  # False: not yet computed; None: not cacheable
        try:  # the sources as this process imported them (a later edit must not name what it loaded)
            self._source_digest = source_digest()
        except OSError as exc:
            log.debug("the package's sources cannot be read (%s): kernels are compiled in every process", exc)
            self._source_digest = None

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
            with event.trigger_event(LOAD_EVENT):  # inside the compile's lock: the compile counter tells it apart
                kernel = rebuild(pickle.loads(payload), _current_cc())
        except Exception as exc:  # any failure only costs the compile this entry would have saved
            log.debug("kernel cache entry %s not used: %r", path.name, exc)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return None
        with contextlib.suppress(OSError):
            path.touch()  # in use: its tree's entries are not idle
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
        _remove_idle_trees(self.folder, self._source_digest, time.time())
        ptx_cache._write_atomic(path, payload + hashlib.sha256(payload).digest())

    def _path(self, sig) -> Path | None:
        if self._source_digest is None:
            return None
        try:
            if self._kernel_key is False:
                self._kernel_key = self._fingerprint()
            if self._kernel_key is None:
                return None
            environment = self._environment if self._environment is not None else _environment()
            text = "\0".join((self._kernel_key, signature_key(sig), environment, repr(_current_cc())))
            name = self.dispatcher.py_func.__qualname__.replace("<locals>.", "").replace("<", "").replace(">", "")
        except Exception as exc:  # the compilers' versions, the device: compile, and keep nothing
            log.debug("kernel cache not used for %r: %r", sig, exc)
            return None
        key = hashlib.sha256(text.encode()).hexdigest()[:32]
        return self.folder / f"{self._source_digest[:_DIGEST_PREFIX_CHARS]}-{name[-60:]}-{key}.kernel"

    def _fingerprint(self) -> str | None:
        try:
            return fingerprint(self.dispatcher)
        except Exception as exc:  # Uncacheable, or an object that failed to describe itself
            log.info("kernel %s is compiled in every process (not kept between them): %s",
                     self.dispatcher.py_func.__qualname__, exc)
            return None


def signature_key(sig) -> str:
    """Each argument type with its class (two named-tuple classes of one name print alike)."""
    args = sig.args if hasattr(sig, "args") else sig
    if not isinstance(args, (tuple, list)):
        return f"{_qualified(type(sig))}:{sig}"
    parts = [f"{_qualified(type(t))}:{getattr(t, 'instance_class', None)!r}:{t}" for t in args]
    return "(" + ", ".join(parts) + ")"


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
    kernel.objectmode = False  # as a compiled kernel has it (numba reads it when no overload matches)
    kernel.bind()
    return kernel


def _current_cc() -> tuple:
    from numba import cuda

    from .ptx_cache import link_cc

    return link_cc(cuda.get_current_device().compute_capability)


@functools.cache
def _environment() -> str:
    """The compilers, Numba, and Numba's settings that change the code it emits."""
    from importlib import metadata

    from numba.cuda.core import config

    versions = sorted(f"{d.metadata['Name']} {d.version}" for d in metadata.distributions()
                      if (d.metadata["Name"] or "").lower().startswith(_COMPILER_DISTRIBUTIONS))
    settings = {name: getattr(config, name, None) for name in _CODE_SETTINGS}
    return "\0".join((ptx_cache._compiler_versions(), ",".join(versions), repr(sorted(settings.items())),
                      sys.version.split()[0]))


def _remove_idle_trees(folder: Path, digest: str, now_s: float) -> None:
    """Other source trees' entries unused for _OTHER_TREE_MAX_IDLE_S, and those of all but the
    _MAX_OTHER_TREES most recently used other trees (run where a kernel was compiled)."""
    last_used: dict[str, float] = {}
    entries: list[tuple[str, Path, float]] = []
    try:
        paths = list(folder.glob("*.kernel"))
    except OSError:
        return
    for path in paths:
        tree = path.name[:_DIGEST_PREFIX_CHARS]
        if tree == digest[:_DIGEST_PREFIX_CHARS]:
            continue
        with contextlib.suppress(OSError):  # another process may have removed it since the listing
            used_s = path.stat().st_mtime
            entries.append((tree, path, used_s))
            last_used[tree] = max(used_s, last_used.get(tree, used_s))
    kept = set(sorted(last_used, key=last_used.get, reverse=True)[:_MAX_OTHER_TREES])
    for tree, path, used_s in entries:
        if tree not in kept or now_s - used_s > _OTHER_TREE_MAX_IDLE_S:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

