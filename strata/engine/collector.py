"""Python's garbage collector while the engine runs: its passes counted and timed, and the loaded
model kept out of them.

A loaded engine holds hundreds of thousands of Python objects (tensors' handles, plans, captured
segments). A full pass of the collector walks all of them: ~0.3 s on the reference GPU machine, the
whole of a 2k prompt's prefill. When such a pass lands inside a request depends on what the process
allocated before, so it differs between fresh processes of one build. ``freeze_loaded`` moves the
loaded objects to the collector's permanent generation once the load is done (full passes then walk
only what requests made); ``CollectorWatch`` times every pass, so a request's timing line shows what
the collector cost it.
"""

from __future__ import annotations

import dataclasses
import gc
import time

FULL_GENERATION = 2


@dataclasses.dataclass(frozen=True)
class CollectorTally:
    num_passes: int = 0
    num_full_passes: int = 0
    seconds: float = 0.0

    def since(self, earlier: CollectorTally) -> CollectorTally:
        return CollectorTally(self.num_passes - earlier.num_passes, self.num_full_passes - earlier.num_full_passes,
                              self.seconds - earlier.seconds)


class CollectorWatch:
    """The collector's passes since ``listen``, in every thread (a pass holds the interpreter's lock)."""

    def __init__(self):
        self.tally = CollectorTally()
        self._started = 0.0
        self._is_listening = False

    def listen(self) -> CollectorWatch:
        if not self._is_listening:
            gc.callbacks.append(self._on_pass)
            self._is_listening = True
        return self

    def close(self) -> None:
        if self._is_listening:
            if self._on_pass in gc.callbacks:  # whoever owns the interpreter may have dropped it already
                gc.callbacks.remove(self._on_pass)
            self._is_listening = False

    def _on_pass(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        is_full = info.get("generation") == FULL_GENERATION
        self.tally = CollectorTally(self.tally.num_passes + 1, self.tally.num_full_passes + is_full,
                                    self.tally.seconds + time.perf_counter() - self._started)


def freeze_loaded() -> None:
    """Collect the load's garbage, then keep every object alive now out of later passes (until
    ``thaw``). The freeze is the interpreter's, not the engine's: a second engine's load freezes
    its objects too, and the first of them to close thaws both (which costs later passes, never
    correctness: the VRAM ledger's last-resort collection thaws for itself, ``gpu/memory.py``)."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """The frozen objects go back to the collector: what a closed engine held is collected again."""
    gc.unfreeze()
