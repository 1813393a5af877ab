"""The PTX of the CUDA C++ sources, compiled once a text and kept between processes.

Numba compiles a linked CUDA source (``cuda.CUSource``) with NVRTC again for every kernel it links
into, and every process compiles all of them again: ``gemv_rows.cu`` alone is ~1.5 MB of PTX and
seconds of NVRTC, and each of the decode GEMVs links it. Here the same NVRTC call that Numba's linker
makes (numba-cuda's ``nvrtc.compile``, its options, the kernel's architecture) runs once a text, and
its PTX is kept in the user's cache folder (``$XDG_CACHE_HOME/strata/ptx``, else
``~/.cache/strata/ptx``) under a key of the text, the architecture and the compilers' versions.
Kernels link that PTX (``cuda.PTXSource``), which is what the source became at each link before.
A folder that cannot be written only loses the reuse between processes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("strata.kernels")
# what a compile returns: the PTX, as numba-cuda's nvrtc.compile gives it (an object with .code, or bytes)
CompileFn = Callable[[str, str, tuple], object]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "strata" / "ptx"


def link_cc(capability: tuple[int, int]) -> tuple[int, int, str]:
    """The architecture Numba links a kernel for on a device of ``capability``: from sm_90 on with its
    architecture-specific features ("a"), as numba-cuda's CUDACodeLibrary does."""
    return (capability[0], capability[1], "a" if tuple(capability) >= (9, 0) else "")


def compiled_ptx(text: str, label: str, cc: tuple, compile_fn: CompileFn | None = None,
                 versions: str | None = None) -> bytes:
    """The PTX of ``text`` for architecture ``cc``: from the cache folder, else compiled and kept there."""
    versions = _compiler_versions() if versions is None else versions
    key = hashlib.sha256("\0".join((text, repr(tuple(cc)), versions)).encode()).hexdigest()[:32]
    path = cache_dir() / f"{label.replace('/', '_')}-{key}.ptx"
    try:
        ptx = path.read_bytes()
        if b".version" in ptx and b".target" in ptx:  # a whole PTX file (writes are atomic)
            return ptx
    except OSError:
        pass
    result = (compile_fn or _nvrtc_compile)(text, label, tuple(cc))
    ptx = result if isinstance(result, bytes) else bytes(result.code)
    _write_atomic(path, ptx)
    return ptx


def _nvrtc_compile(text: str, label: str, cc: tuple) -> object:
    from numba.cuda.cudadrv import nvrtc

    result, _ = nvrtc.compile(text, label, cc)
    return result


def _compiler_versions() -> str:
    import numba_cuda
    from cuda.bindings import nvrtc as bindings_nvrtc

    _, major, minor = bindings_nvrtc.nvrtcVersion()
    return f"numba-cuda {numba_cuda.__version__}, nvrtc {major}.{minor}"


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            temporary = f.name
            f.write(data)
        os.replace(temporary, path)
    except OSError as exc:
        log.debug("the PTX of %s is not kept between processes: %s", path.name, exc)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
