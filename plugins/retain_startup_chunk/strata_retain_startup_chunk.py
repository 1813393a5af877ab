"""Keep the startup planner geometry for the first request.

At startup the planner sizes the prefill geometry for the budget the startup loan leaves. Without
this plugin the first request re-plans for its own budget and prompt; with it the first request
keeps the startup geometry (its ring, and its chunk up to the prompt's length: the engine sizes no
workspace beyond the prompt). Later requests always re-plan.
"""

from strata.hooks import hookimpl


@hookimpl
def strata_planner_geometry(ctx, geometry):
    if ctx.request.is_startup_loan and ctx.startup_geometry is not None:
        return ctx.startup_geometry
    return None
