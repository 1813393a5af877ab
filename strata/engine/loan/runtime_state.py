"""The engine's runtime state that a prefill changes and the loan transaction puts back before decode.

Two parts, captured together before the transaction releases anything and put back after it has
restored every resource, before the first decoded token:

- ``RuntimeSettings``: values the engine reads while it runs. Prefill sets its own (copy overlap
  by its ring, no logit bias) and decode gets the captured ones back; ``apply`` hands each value
  to whoever reads it (the ops backend's copy overlap).
- the expert cache's residency (which expert sits in which slot, in recency order). The prompt
  workspace borrows the cache's top slots for the staging ring, evicting what decode had cached
  there; putting the residency back stages those experts again into the slots they had, so decode
  finds the cache as the previous request left it, and a fully cached model stays fully cached
  (its captured decode graphs are kept). Experts cached since the capture are dropped (prefill
  inserts none: expert_cache.py's policy).

The sampling state is not here: a request's sampler is created from its seed after this put-back,
so no prefill can touch it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
    """One value of every setting the transaction captures before release and restores after.

    :ivar copy_overlap: expert copies run on the copy stream alongside the kernels (the ops backend's
        ``is_copy_overlapped``); false: the kernels issued after a staging wait for it at once.
        Decode's value is ``runtime.copy_overlap``; prefill overlaps when its ring has two halves.
    :ivar logit_bias: token id → bias added to the output head's logits of every decoded token.
    """

    copy_overlap: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()


class Residency(Protocol):
    """What the expert cache holds, as a value that compares equal when nothing moved."""

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> int:
        """Make the cache hold ``snapshot`` again; returns the bytes staged to do so."""


@dataclasses.dataclass(frozen=True)
class CapturedState:
    settings: RuntimeSettings
    residency: Any = None


class RuntimeState:
    """The engine's live settings and cache residency. ``capture``/``put_back`` bracket every prefill."""

    def __init__(self, settings: RuntimeSettings | None = None, *,
                 apply: Callable[[RuntimeSettings], None] | None = None, residency: Residency | None = None):
        self._settings = settings or RuntimeSettings()
        self._apply = apply or (lambda settings: None)
        self._residency = residency
        self.restaged_bytes = 0  # what the last put_back staged to restore the residency
        self._apply(self._settings)

    @property
    def settings(self) -> RuntimeSettings:
        return self._settings

    def capture(self) -> CapturedState:
        return CapturedState(self._settings, self._residency.snapshot() if self._residency else None)

    def put_back(self, captured: CapturedState) -> None:
        """Settings first (they cost nothing and must be back even if restaging fails), then residency."""
        self.restaged_bytes = 0
        self._set(captured.settings)
        if self._residency is not None:
            self.restaged_bytes = self._residency.restore(captured.residency)

    def update(self, **changes: Any) -> None:
        self._set(dataclasses.replace(self._settings, **changes))

    def _set(self, settings: RuntimeSettings) -> None:
        self._settings = settings
        self._apply(settings)
