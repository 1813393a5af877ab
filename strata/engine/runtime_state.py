"""Runtime settings that prefill (and a loan) may change and must be put back before decode."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
    """One value of every setting the transaction captures before release and restores after.

    :ivar pcie_balancing: split expert uploads across copy engines by measured rate.
    :ivar adaptive_overlap: gate copy/compute overlap on the measured stream rates.
    :ivar residency_prelaunch_sync: synchronize expert residency before launching a layer.
    :ivar logit_bias: token id → bias added to the output head's logits.
    :ivar mtp_draft_sampling: sample MTP draft tokens (off while the draft head is released).
    """

    pcie_balancing: bool = True
    adaptive_overlap: bool = True
    residency_prelaunch_sync: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    mtp_draft_sampling: bool = False


class RuntimeState:
    """The engine's live settings. ``capture``/``put_back`` bracket every prefill."""

    def __init__(self, settings: RuntimeSettings | None = None):
        self._settings = settings or RuntimeSettings()

    @property
    def settings(self) -> RuntimeSettings:
        return self._settings

    def capture(self) -> RuntimeSettings:
        return self._settings

    def put_back(self, captured: RuntimeSettings) -> None:
        self._settings = captured

    def update(self, **changes: Any) -> None:
        self._settings = dataclasses.replace(self._settings, **changes)
