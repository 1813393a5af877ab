"""Values and rules that cross the plugin contract. Plugins import these (and ``strata.hooks``)
only; they hold no engine internals."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol

if TYPE_CHECKING:
    from strata.config import Config

# The decode-only resources the engine may offer for release, in the reference's order of mention.
VERIFIER = "verifier"
OUTPUT_HEAD = "output_head"
MTP_EXPERTS = "mtp_experts"
MTP_DRAFT_HEAD = "mtp_draft_head"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The prefill geometry the planner picks: tokens per chunk and expert slots in the staging ring."""

    chunk_tokens: int
    ring_slots: int

    def __str__(self) -> str:
        return f"{self.chunk_tokens:,} / {self.ring_slots}"


@dataclasses.dataclass(frozen=True)
class PlannerBudget:
    """Bytes the planner may spend on prompt workspace and staging ring.

    ``free_bytes`` is free under the VRAM budget; ``borrowable_cache_bytes`` is expert-cache storage
    the prompt workspace may borrow; ``adjust_bytes`` is the sum of what loan plugins added (> 0)
    or withheld (< 0) through ``strata_planner_budget``.
    """

    free_bytes: int
    borrowable_cache_bytes: int
    adjust_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return max(0, self.free_bytes + self.borrowable_cache_bytes + self.adjust_bytes)


@dataclasses.dataclass(frozen=True)
class LoanRequest:
    """One request as the loan sees it.

    ``index`` counts requests since startup (0 is the first). ``unread_tokens`` are the prompt
    tokens prefill must process (the rest reuse the previous request's KV prefix).
    ``is_startup_loan`` is true for the first request when resources were deferred at startup:
    its prompt length was unknown when the loan began, so no prompt-length threshold applies.
    """

    index: int
    prompt_tokens: int
    unread_tokens: int
    is_startup_loan: bool


@dataclasses.dataclass(frozen=True)
class LoanVote:
    """A plugin's answer to ``strata_loan_decide``: run the loan or skip it, and why."""

    is_run: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Why a plugin (or the core) cannot run in this configuration: the option, its value and the fix."""

    option: str
    value: object
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.option} = {self.value!r}: {self.problem}; {self.fix}"


class ResourceView(Protocol):
    """What admission and plugins may read of a decode-only resource."""

    name: str
    num_bytes: int
    is_resident: bool


@dataclasses.dataclass(frozen=True)
class LoanPrediction:
    """The cost model's prefill time of one request without the loan and with it (``LoanContext.predict``).

    ``reload_seconds`` is what taking the loan adds beyond the prefill: the transaction's own work
    (measured from the loans taken so far), and for a repeat loan the upload of what it releases at
    the measured PCIe rate (a startup loan's resources are uploaded whichever way it goes).
    """

    off_geometry: Geometry | None  # None (and off_seconds infinite) where only the loan's memory holds a plan
    off_seconds: float
    on_geometry: Geometry
    on_seconds: float
    reload_seconds: float

    @property
    def gain_seconds(self) -> float:
        """Predicted prefill time the loan saves (negative: it costs)."""
        return self.off_seconds - self.on_seconds - self.reload_seconds


@dataclasses.dataclass(frozen=True)
class LoanContext:
    """Passed to the per-request loan hooks.

    :ivar config: the frozen configuration (``config.plugin_options(name)`` is a plugin's table).
    :ivar request: the request being prefilled.
    :ivar resources: the decode-only resources the engine offers for release, by name.
    :ivar startup_geometry: the geometry the planner chose at startup (None before it exists).
    :ivar predict: ``predict()`` is the cost model's ``LoanPrediction`` for this request (computed
        when called: a few planner passes), or None where the engine has no cost model (a dense
        model, a fixed geometry) or no plan fits; the attribute is None where no prediction is
        offered. Call it in ``strata_loan_decide``: once the loan has released anything the
        engine's budget is no longer the idle one it predicts from.
    """

    config: Config
    request: LoanRequest
    resources: Mapping[str, ResourceView]
    startup_geometry: Geometry | None
    predict: Callable[[], LoanPrediction | None] | None = None


def offered(names: Iterable[str], resources: Mapping[str, ResourceView]) -> list[str]:
    """The ``names`` that ``resources`` holds, in the order of ``names``."""
    return [name for name in names if name in resources]


def mtp_rejections(config: Config, plugin: str) -> list[Rejection]:
    """The rule shared by the MTP and head loans: MTP speculation on, depth at least 2."""
    rt = config.runtime
    if not rt.mtp:
        return [Rejection("runtime.mtp", rt.mtp, f"{plugin} defers decode resources that exist only with MTP",
                          f"set runtime.mtp = true and runtime.spec_depth >= 2 {_or_remove(plugin)}")]
    if rt.spec_depth < 2:
        return [Rejection("runtime.spec_depth", rt.spec_depth, f"{plugin} needs MTP speculation depth >= 2",
                          f"set runtime.spec_depth = 2 or more {_or_remove(plugin)}")]
    return []


def model_rejection(config: Config, plugin: str, problem: str, fix: str) -> Rejection:
    """The model lacks what ``plugin`` releases: ``problem`` says what, ``fix`` which model to use."""
    return Rejection("model.path", str(config.model.path), problem, f"{fix} {_or_remove(plugin)}")


def _or_remove(plugin: str) -> str:
    return f"or remove {plugin} from loan.plugins"
