"""The plugin contract: every hook a Strata plugin may implement.

Hook names read ``strata_<subsystem>_<event>``. Every hook is called through pluggy, with its
semantics: a plugin may accept fewer arguments than a spec lists (opt-in arguments), a
``firstresult`` hook stops at the first non-None result, and None results are dropped.

Order: plugins run in the order of ``loan.plugins`` in the TOML (the allow-list). pluggy's marks
apply on top: ``@hookimpl(tryfirst=True)`` runs before the allow-list order, ``trylast=True``
after it, and a wrapper (``wrapper=True`` or ``hookwrapper=True``) runs around all the others,
seeing and able to replace their results. Two hooks are called once per plugin instead, so marks
order only that plugin's own implementations there: ``strata_config_tables`` (in allow-list
order, so every table is attributed to the plugin declaring it) and ``strata_prefill_restore``
(in reverse order, every plugin's hook running even when one raises). An exception escaping any
other hook fails startup or the request with a ``PluginError`` naming the plugin it came from.

The whole sequence, in one place
--------------------------------
At startup, once::

    strata_config_tables()              each plugin declares its [loan.<name>] table
    strata_loan_admit(config, resources) every rejection is collected; any → AdmissionError,
                                        raised before any resource is deferred
    (engine defers the resources the plugins name for the first request: the startup loan)
    strata_prefill_release(ctx)          asked once at startup for the startup loan's resources

Per request, serialized, only when ``loan.enabled`` is true (otherwise no hook runs and the
plan is the one a build without plugins makes)::

    strata_loan_decide(ctx)             votes; any skip vetoes, else any run runs, else the
                                        default: run the startup loan, skip later requests
    if the loan runs:
        strata_prefill_release(ctx)     names of resources to release, in plugin order
        (engine releases them; the budget counts what they freed as expert cache grown into it)
        strata_planner_budget(ctx, budget)  byte adjustments, summed
        (planner plans)
        strata_planner_geometry(ctx, geometry)  first non-None result replaces the plan
        (engine grows the elastic expert cache by what the staging ring can use of the memory the
         chunk's activations leave, then allocates the workspace; on allocation failure retries smaller geometries,
         bounded by planner.max_retries)
    (prefill)
    finally, also when any step above raised:
        (engine frees the workspace, shrinks the cache, restores released resources in reverse
         order and puts back the runtime state captured before release: settings, and the
         expert cache's residency, staging again what the ring evicted)
        strata_prefill_restore(ctx)     reverse plugin order, one call per plugin
        (engine checks the ledger and runtime state equal what they were before)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

import pluggy

from strata.schema import (
    option,  # the field maker of a plugin's own TOML table: part of the contract
)

if TYPE_CHECKING:
    from strata.config import Config
    from strata.hooktypes import (
        Geometry,
        LoanContext,
        LoanVote,
        PlannerBudget,
        Rejection,
        ResourceView,
    )

PROJECT = "strata"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
__all__ = ["PROJECT", "hookimpl", "hookspec", "option"]


@hookspec
def strata_config_tables() -> Mapping[str, type]:
    """Declare the plugin's own TOML table.

    :returns: ``{plugin_name: SchemaDataclass}``; the table ``[loan.<plugin_name>]`` is validated
        against the frozen dataclass (fields made with ``strata.hooks.option``) and the instance is
        available as ``config.plugin_options(plugin_name)``. The key must be the plugin's own name.

    Called once at startup, before admission: once per enabled plugin, in plugin order.
    """


@hookspec
def strata_loan_admit(config: Config, resources: Mapping[str, ResourceView]) -> Iterable[Rejection] | None:
    """Say whether this plugin can run in this configuration.

    :param config: the frozen configuration, plugin tables validated.
    :param resources: the decode-only resources the engine offers for release, by name
        (``verifier``, ``output_head``, ``mtp_draft_head``, ``mtp_experts`` where they exist).
    :returns: the rejections (option, value, problem, fix), or None/empty when admitted.

    Called once at startup, after the core's own admission rules, for every plugin; all rejections
    are reported together and startup fails before any resource is deferred.
    """


@hookspec
def strata_loan_decide(ctx: LoanContext) -> LoanVote | None:
    """Vote on whether the loan runs for this request.

    :param ctx: the request (index, prompt and unread tokens, whether it is the startup loan),
        the configuration and the resources.
    :returns: ``LoanVote(is_run, reason)``, or None to abstain.

    Called for every request while ``loan.enabled``. Not firstresult: every vote counts. Any
    skip vote vetoes the loan; otherwise any run vote runs it; if all abstain, the startup loan runs
    and later requests skip. The reasons appear in the request's timing line.
    """


@hookspec
def strata_prefill_release(ctx: LoanContext) -> Iterable[str] | None:
    """Name the decode-only resources this plugin releases for the request's prefill.

    :param ctx: the loan context.
    :returns: resource names from ``ctx.resources``, in the order to release them.

    Called in plugin order once the loan runs (and once at startup for the startup loan). The
    engine, not the plugin, releases and later restores the resources: restore is guaranteed in
    reverse order inside a ``finally``. A name released by an earlier plugin is not released twice.
    """


@hookspec
def strata_planner_budget(ctx: LoanContext, budget: PlannerBudget) -> int | None:
    """Adjust the bytes the planner may spend on this prefill.

    :param ctx: the loan context.
    :param budget: free bytes and borrowable expert-cache bytes after release, counting the released
        memory as expert cache grown into it (the workspace may take it as ring slots or free memory).
    :returns: bytes to add (> 0) or withhold (< 0); None for no change. Adjustments are summed,
        so their order does not matter; the total never goes below zero.

    Called in plugin order after release, before planning.
    """


@hookspec(firstresult=True)
def strata_planner_geometry(ctx: LoanContext, geometry: Geometry) -> Geometry | None:
    """Replace the geometry the planner chose for this request.

    :param ctx: the loan context (``ctx.startup_geometry`` is the startup plan).
    :param geometry: the planner's choice for this request's budget.
    :returns: the geometry to use instead, or None to keep the planner's. Stops at the first
        non-None result, in plugin order.

    A replaced geometry still goes through allocation and the bounded smaller-geometry retries, its
    chunk capped at the unread prompt (no workspace is sized beyond it).
    """


@hookspec
def strata_prefill_restore(ctx: LoanContext) -> None:
    """Learn that the engine has restored every released resource and the runtime state.

    :param ctx: the loan context.

    Called once per plugin, in reverse plugin order, inside the transaction's ``finally``, also
    after a failed prefill. Put back state the plugin itself changed; resources need nothing from
    the plugin. An exception here is reported after the remaining plugins' restore hooks have run.
    """
