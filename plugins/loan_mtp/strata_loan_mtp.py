"""Defer the MTP routed experts and the MTP draft head during prefill.

Both serve only speculative decode; the engine restores them, and MTP draft sampling with
them, before the first generated token. Requires ``runtime.mtp`` with ``runtime.spec_depth >= 2``
and a model with an MTP block.
"""

from strata.engine.loan.admission import mtp_rejections
from strata.engine.loan.resources import MTP_DRAFT_HEAD, MTP_EXPERTS
from strata.hooks import hookimpl
from strata.hooktypes import Rejection

NAME = "loan_mtp"
RELEASES = (MTP_EXPERTS, MTP_DRAFT_HEAD)


@hookimpl
def strata_loan_admit(config, resources):
    rejections = mtp_rejections(config, NAME)
    missing = [name for name in RELEASES if name not in resources]
    if not rejections and missing:
        rejections.append(Rejection("model.path", str(config.model.path),
                                    f"the model has no MTP block ({', '.join(missing)} missing)",
                                    f"use a GGUF with an MTP (nextn) block or remove {NAME} from loan.plugins"))
    return rejections


@hookimpl
def strata_prefill_release(ctx):
    return [name for name in RELEASES if name in ctx.resources]
