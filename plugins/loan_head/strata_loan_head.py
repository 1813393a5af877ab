"""Defer the native output head and the speculative verifier's arena during prefill.

Prefill needs neither: the first token's logits are computed after the restore. Requires MTP with
``runtime.spec_depth >= 2`` (the verifier exists only then) and a native output head: a model whose
head is tied to the token embeddings has none to release, since prefill reads the embeddings.
"""

from strata.engine.loan.admission import mtp_rejections
from strata.engine.loan.resources import OUTPUT_HEAD, VERIFIER
from strata.hooks import hookimpl
from strata.hooktypes import Rejection

NAME = "loan_head"
RELEASES = (VERIFIER, OUTPUT_HEAD)


@hookimpl
def strata_loan_admit(config, resources):
    rejections = mtp_rejections(config, NAME)
    if OUTPUT_HEAD not in resources:
        rejections.append(Rejection("model.path", str(config.model.path),
                                    "the model has no native output head (its head is tied to token_embd)",
                                    f"use a model with its own output.weight or remove {NAME} from loan.plugins"))
    return rejections


@hookimpl
def strata_prefill_release(ctx):
    return [name for name in RELEASES if name in ctx.resources]
