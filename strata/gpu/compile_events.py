"""Compilations while the engine runs, counted from numba-cuda's compiler lock.

The load's warm-up compiles every kernel a request uses; a kernel compiled inside a request costs
that request seconds of its prefill or decode time (a shape the warm-up did not reach), which no
other figure shows. numba-cuda holds its global compiler lock around each compilation (a kernel's
new specialization, a device function, a linked source) and reports taking and leaving it as the
``numba-cuda:compiler_lock`` event; a launch of a kernel already compiled does not take it. The
lock is reentrant: a compile nested in another counts once, with the outer's seconds. The counter
is one listener for the engine's life; a request reads the tally before and after itself.
"""

from __future__ import annotations

import dataclasses
import time

COMPILE_EVENT = "numba-cuda:compiler_lock"


@dataclasses.dataclass(frozen=True)
class CompileTally:
    num_compiles: int = 0
    seconds: float = 0.0

    def since(self, earlier: CompileTally) -> CompileTally:
        return CompileTally(self.num_compiles - earlier.num_compiles, self.seconds - earlier.seconds)


class CompileCounter:
    """The compilations since ``listen`` (none on a backend that compiles nothing: never listening)."""

    def __init__(self):
        self.tally = CompileTally()
        self._depth = 0
        self._started = 0.0
        self._listener = None

    def listen(self) -> CompileCounter:
        from numba.cuda.core import event

        counter = self

        class _Listener(event.Listener):
            def on_start(self, _event):
                counter._on_start()

            def on_end(self, _event):
                counter._on_end()

        self._listener = _Listener()
        event.register(COMPILE_EVENT, self._listener)
        return self

    def close(self) -> None:
        if self._listener is not None:
            from numba.cuda.core import event

            event.unregister(COMPILE_EVENT, self._listener)
            self._listener = None

    def _on_start(self) -> None:
        if self._depth == 0:
            self._started = time.perf_counter()
        self._depth += 1

    def _on_end(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.tally = CompileTally(self.tally.num_compiles + 1,
                                      self.tally.seconds + time.perf_counter() - self._started)
