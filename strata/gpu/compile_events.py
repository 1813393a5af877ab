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
import time

COMPILE_EVENT = "numba-cuda:compiler_lock"
LOAD_EVENT = "strata:kernel-cache-load"  # kernel_cache.LOAD_EVENT (a lower layer's name, not imported here)


@dataclasses.dataclass(frozen=True)
class CompileTally:
    num_compiles: int = 0
    seconds: float = 0.0
    num_loaded: int = 0  # kernels the kernel cache loaded (their seconds are not in ``seconds``)

    def since(self, earlier: CompileTally) -> CompileTally:
        return CompileTally(self.num_compiles - earlier.num_compiles, self.seconds - earlier.seconds,
                            self.num_loaded - earlier.num_loaded)


class CompileCounter:
    """The compilations since ``listen`` (none on a backend that compiles nothing: never listening)."""

    def __init__(self):
        self.tally = CompileTally()
        self._depth = 0
        self._started = 0.0
        self._is_loaded = False  # the outermost lock held now loaded a kept kernel
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
        self._depth += 1

    def _on_end(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            tally = self.tally
            if self._is_loaded:
                self.tally = CompileTally(tally.num_compiles, tally.seconds, tally.num_loaded + 1)
            else:
                self.tally = CompileTally(tally.num_compiles + 1, tally.seconds + time.perf_counter() - self._started,
                                          tally.num_loaded)
            self._is_loaded = False
