"""Take the loan only where the cost model predicts it pays.

For each request the engine's cost model predicts the prefill time without the loan and with it
(``LoanContext.predict``: the plan each budget allows, the experts it streams and evicts, the MTP
block's pass over the prompt, the measured PCIe and compute rates), and what taking the loan adds
(the transaction's own work, measured from the loans so far; for a repeat loan the upload of what
it releases). Prefill only: decode is not weighed (the MTP block's cache holds the prompt after a
loaned prefill too, unless the block has an embedding table of its own). The loan runs
when it saves more than ``[loan.cost_gate] min_gain`` of the loan-off time, and is skipped
otherwise, whatever the prompt's length: this is the engine's own choice per request, where
``repeat_loan`` applies a fixed threshold. A vote to skip wins over other plugins' votes to run.
Without a prediction (a dense model, a fixed geometry) the plugin does not vote.
"""

import dataclasses

from strata.hooks import hookimpl, option
from strata.hooktypes import LoanVote

NAME = "cost_gate"


@dataclasses.dataclass(frozen=True)
class CostGateOptions:
    min_gain: float = option(0.0, doc="fraction of the loan-off prefill time the loan must be predicted to save",
                             min=0.0, max=0.5)


@hookimpl
def strata_config_tables():
    return {NAME: CostGateOptions}


@hookimpl
def strata_loan_decide(ctx):
    prediction = ctx.predict() if ctx.predict is not None else None
    if prediction is None:
        return None
    min_gain = ctx.config.plugin_options(NAME).min_gain
    saved = prediction.gain_seconds
    without = (f"{prediction.off_seconds:.3f} s at {prediction.off_geometry}" if prediction.off_geometry is not None
               else "no plan that fits without it")
    figures = (f"{prediction.on_seconds:.3f} s at {prediction.on_geometry} + {1e3 * prediction.reload_seconds:.0f} ms "
               f"of loan against {without}")
    if prediction.off_geometry is None:
        return LoanVote(True, f"cost model: only the loan fits a plan ({figures})")
    if saved > min_gain * prediction.off_seconds:
        return LoanVote(True, f"cost model: the loan saves {1e3 * saved:.0f} ms ({figures})")
    return LoanVote(False, f"cost model: the loan would not pay ({figures})")
