"""Compilations while the engine runs, counted from numba-cuda's compiler lock.

The load's warm-up compiles every kernel a request uses; a kernel compiled inside a request costs
that request seconds of its prefill or decode time (a shape the warm-up did not reach), which no
other figure shows. numba-cuda holds its global compiler lock around each compilation (a kernel's
new specialization, a device function, a linked source) and reports taking and leaving it as the
``numba-cuda:compiler_lock`` event; a launch of a kernel already compiled does not take it. The
lock is reentrant: a compile nested in another counts once, with the outer's seconds. The counter
is one listener for the engine's life; a request reads the tally before and after itself. A kernel
that the kernel cache loads instead of compiling (``kernels/kernel_cache.py``) takes the lock too: its
load event inside the lock counts it as loaded, not compiled.
"""

from __future__ import annotations

import dataclasses
import sys
import time

COMPILE_EVENT = "numba-cuda:compiler_lock"
LOAD_EVENT = "strata:kernel-cache-load"  # kernel_cache.LOAD_EVENT (a lower layer's name, not imported here)


MAX_NAMES = 64  # compiles a tally names, the latest kept
# the frames that hold a kernel being compiled and its arguments: numba-cuda's dispatcher (the lock is
# taken in the wrapper of its ``compile``, so the caller's frame is the innermost with the arguments) and
# the launcher's
_COMPILING_FRAMES = frozenset({"_compile_for_args", "call", "specialize", "_compiled"})
_MAX_FRAMES = 64


@dataclasses.dataclass(frozen=True)
class CompileTally:
    num_compiles: int = 0
    seconds: float = 0.0
    num_loaded: int = 0  # kernels the kernel cache loaded (their seconds are not in ``seconds``)
    names: tuple[str, ...] = ()  # what compiled, latest last (at most MAX_NAMES), so a warning can name it

    def since(self, earlier: CompileTally) -> CompileTally:
        num_compiles = self.num_compiles - earlier.num_compiles
        return CompileTally(num_compiles, self.seconds - earlier.seconds, self.num_loaded - earlier.num_loaded,
                            self.names[len(self.names) - min(num_compiles, len(self.names)):])


def compiled_kernel_name(frame) -> str:
    """The kernel a compile is for, read from the stack that took the lock: the Numba dispatcher's
    function and argument types, else the innermost Strata function (a linked CUDA source), else "?".
    Never raises: it runs while numba-cuda holds its compiler lock."""
    try:
        return _kernel_name(frame)
    except Exception:  # noqa: BLE001 - a name for a log line must not fail the compile
        return "?"


def _kernel_name(frame) -> str:
    fallback = "?"
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        # only the compile path's frames: reading a frame's locals keeps a copy of them on the frame
        if code.co_name in _COMPILING_FRAMES and code.co_varnames[:1] == ("self",):
            local = frame.f_locals
            owner = local.get("self")
            py_func = getattr(owner, "py_func", None)
            if py_func is not None:
                args = local.get("args", local.get("sig", ()))
                try:
                    types = ", ".join(str(owner.typeof_pyval(a)) for a in args)
                except Exception:  # noqa: BLE001 - any argument may refuse typing
                    types = ", ".join(type(a).__name__ for a in args) if isinstance(args, tuple) else str(args)
                return f"{py_func.__qualname__}({types})"
        module = frame.f_globals.get("__name__", "")
        if fallback == "?" and module.startswith("strata.") and module != __name__:
            fallback = f"{module}.{code.co_name}"
        frame = frame.f_back
    return fallback


class CompileCounter:
    """The compilations since ``listen`` (none on a backend that compiles nothing: never listening)."""

    def __init__(self):
        self.tally = CompileTally()
        self._depth = 0
        self._started = 0.0
        self._is_loaded = False  # the outermost lock held now loaded a kept kernel
        self._name = "?"
        self._listeners = []

    def listen(self) -> CompileCounter:
        from numba.cuda.core import event

        counter = self

        class _Lock(event.Listener):
            def on_start(self, _event):
                counter._on_start()

            def on_end(self, _event):
                counter._on_end()

        class _Load(event.Listener):
            def on_start(self, _event):
                pass

            def on_end(self, _event):
                counter._is_loaded = counter._depth > 0

        self._listeners = [(COMPILE_EVENT, _Lock()), (LOAD_EVENT, _Load())]
        for kind, listener in self._listeners:
            event.register(kind, listener)
        return self

    def close(self) -> None:
        if self._listeners:
            from numba.cuda.core import event

            for kind, listener in self._listeners:
                event.unregister(kind, listener)
            self._listeners = []

    def _on_start(self) -> None:
        if self._depth == 0:
            self._started = time.perf_counter()
            self._name = compiled_kernel_name(sys._getframe(2))  # above the listener's own frames
        self._depth += 1

    def _on_end(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            tally = self.tally
            if self._is_loaded:
                self.tally = dataclasses.replace(tally, num_loaded=tally.num_loaded + 1)
            else:
                self.tally = CompileTally(tally.num_compiles + 1, tally.seconds + time.perf_counter() - self._started,
                                          tally.num_loaded, (*tally.names, self._name)[-MAX_NAMES:])
            self._is_loaded = False
