"""Repeat the loan for later prompts whose unread tokens reach a threshold.

``[loan.repeat_loan] min_tokens`` (default 1,024, minimum 256) is compared with the tokens a
request must prefill beyond the KV prefix it reuses. The first request's startup loan is not
judged: its prompt was unknown when the loan began at startup.
"""

import dataclasses

from strata.hooks import hookimpl, option
from strata.hooktypes import LoanVote

NAME = "repeat_loan"


@dataclasses.dataclass(frozen=True)
class RepeatLoanOptions:
    min_tokens: int = option(1024, doc="unread prompt tokens at which a later request repeats the loan", min=256)


@hookimpl
def strata_config_tables():
    return {NAME: RepeatLoanOptions}


@hookimpl
def strata_loan_decide(ctx):
    if ctx.request.is_startup_loan:
        return None
    threshold = ctx.config.plugin_options(NAME).min_tokens
    unread = ctx.request.unread_tokens
    if unread >= threshold:
        return LoanVote(True, f"repeat loan: {unread:,} unread tokens >= {threshold:,}")
    return LoanVote(False, f"{unread:,} unread tokens < repeat threshold {threshold:,}")
