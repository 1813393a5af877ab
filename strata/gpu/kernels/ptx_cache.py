"""The compiled CUDA C++ sources, compiled once a text and kept between processes.

Numba compiles a linked CUDA source (``cuda.CUSource``) with NVRTC again for every kernel it links
into, and every process compiles all of them again: ``gemv_rows.cu`` alone is ~1.5 MB of PTX and
seconds of NVRTC, and each of the decode GEMVs links it. Here the same NVRTC call that Numba's linker
makes (numba-cuda's ``nvrtc.compile``, its options, the kernel's architecture, LTO-IR where the link is
link-time optimized) runs once a text, and its output is kept in the user's cache folder
(``$XDG_CACHE_HOME/strata/ptx``, else ``~/.cache/strata/ptx``) under a key of the text, the
architecture, the output kind and the compilers' versions, with a digest that a cut file fails.
Kernels link that output (``cuda.LTOIR`` or ``cuda.PTXSource``), which is what the source became at
each link before. A folder that cannot be written only loses the reuse between processes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("strata.kernels")
# a compile: (text, label, cc, is_ltoir) -> the code, as numba-cuda's nvrtc.compile gives it (.code) or bytes
CompileFn = Callable[[str, str, tuple, bool], object]
_DIGEST_BYTES = 32


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "strata" / "ptx"


def link_cc(capability: tuple[int, int]) -> tuple[int, int, str]:
    """The architecture Numba links a kernel for on a device of ``capability``: from sm_90 on with its
    architecture-specific features ("a"), as numba-cuda's CUDACodeLibrary does."""
    return (capability[0], capability[1], "a" if tuple(capability) >= (9, 0) else "")


def is_lto_link() -> bool:
    """Whether Numba links a kernel without an ``lto`` option (every kernel here but those that set it,
    to the same value) with link-time optimization: numba-cuda's default, nvJitLink present and no
    debug info; the linked sources then join the link as LTO-IR."""
    from numba.cuda.core import config  # the module numba-cuda's jit reads its default from
    from numba.cuda.cudadrv.driver import _have_nvjitlink

    return bool(_have_nvjitlink()) and not config.CUDA_DEBUGINFO_DEFAULT


def compiled_code(text: str, label: str, cc: tuple, is_ltoir: bool, compile_fn: CompileFn | None = None,
                  versions: str | None = None) -> bytes:
    """The PTX (or LTO-IR) of ``text`` for architecture ``cc``: from the cache folder, else compiled and
    kept there."""
    versions = _compiler_versions() if versions is None else versions
    key = hashlib.sha256("\0".join((text, repr(tuple(cc)), str(is_ltoir), versions)).encode()).hexdigest()[:32]
    path = cache_dir() / f"{label.replace('/', '_')}-{key}.{'ltoir' if is_ltoir else 'ptx'}"
    try:
        kept = path.read_bytes()
        code, digest = kept[:-_DIGEST_BYTES], kept[-_DIGEST_BYTES:]
        if len(kept) > _DIGEST_BYTES and hashlib.sha256(code).digest() == digest:
            return code
    except OSError:
        pass
    result = (compile_fn or _nvrtc_compile)(text, label, tuple(cc), is_ltoir)
    code = result if isinstance(result, bytes) else bytes(result.code)
    _write_atomic(path, code + hashlib.sha256(code).digest())
    return code


def _nvrtc_compile(text: str, label: str, cc: tuple, is_ltoir: bool) -> object:
    """numba-cuda's NVRTC call. Its log (remarks such as an unused helper of a format this text does
    not instantiate) goes to this module's debug log, not to the user's terminal as a warning."""
    import warnings

    from numba.cuda.cudadrv import nvrtc

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, _ = nvrtc.compile(text, label, cc, ltoir=is_ltoir)
    for warning in caught:
        if issubclass(warning.category, UserWarning) and str(warning.message).startswith("NVRTC log messages"):
            log.debug("%s: %s", label, warning.message)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
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
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        log.debug("the compiled %s is not kept between processes: %s", path.name, exc)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
