"""Defer the native output head and the speculative verifier's arena during prefill.

Prefill needs neither: the first token's logits are computed after the restore. Requires MTP with
``runtime.spec_depth >= 2`` (the verifier exists only then) and a native output head: a model whose
head is tied to the token embeddings has none to release, since prefill reads the embeddings.
"""

from strata.hooks import hookimpl
from strata.hooktypes import OUTPUT_HEAD, VERIFIER, model_rejection, mtp_rejections, offered

NAME = "loan_head"
RELEASES = (VERIFIER, OUTPUT_HEAD)


@hookimpl
def strata_prefill_release(ctx):
    return offered(RELEASES, ctx.resources)


@hookimpl
def strata_loan_admit(config, resources):
    rejections = mtp_rejections(config, NAME)
    if OUTPUT_HEAD not in resources:
        rejections.append(model_rejection(config, NAME,
                                          "the model has no native output head (its head is tied to token_embd)",
                                          "use a model with its own output.weight"))
    return rejections
