"""Defer the MTP routed experts and the MTP draft head during prefill.

Both serve only speculative decode; the engine restores them, and MTP draft sampling with
them, before the first generated token. Requires ``runtime.mtp`` with ``runtime.spec_depth >= 2``
and a model with an MTP block.
"""

from strata.hooks import hookimpl
from strata.hooktypes import MTP_DRAFT_HEAD, MTP_EXPERTS, model_rejection, mtp_rejections, offered

NAME = "loan_mtp"
RELEASES = (MTP_EXPERTS, MTP_DRAFT_HEAD)


@hookimpl
def strata_loan_admit(config, resources):
    rejections = mtp_rejections(config, NAME)
    missing = [name for name in RELEASES if name not in resources]
    if not rejections and missing:
        rejections.append(model_rejection(config, NAME, f"the model has no MTP block ({', '.join(missing)} missing)",
                                          "use a GGUF with an MTP (nextn) block"))
    return rejections


@hookimpl
def strata_prefill_release(ctx):
    return offered(RELEASES, ctx.resources)
