"""``strata bench --draft-oracle P``: speculation measured independent of the draft head's weights.

A synthetic model's MTP block has random weights, so its drafts are almost never taken and say
nothing about what speculation can do. The oracle keeps every draft computation (the MTP block
runs; its memory and time are real) but replaces each proposed token by the target's own greedy
continuation, recorded by plain decode from the same request's prefill before its timed decode
(another prefill of the prompt, in other chunks, may pick other tokens where two logits nearly
tie), with probability P, and by a token that differs from it otherwise. Each position is drawn
once: a position drafted again (after a refusal before it) gets the same token, so a device step
can read the oracle's tokens for positions it only learns on the device (``window``). A
measurement mode of the bench only: serving never passes one.
"""

from __future__ import annotations

import numpy as np


class DraftOracle:
    def __init__(self, continuation: list[int] | None, first_position: int, probability: float, vocab_size: int,
                 seed: int = 0):
        """continuation: the greedy tokens of a plain run, the first at ``first_position`` (the prompt's
        length); None: the request records them from its own prefill before its timed decode."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"the draft oracle's probability must be in [0, 1], got {probability}")
        self.continuation = continuation
        self.first_position = first_position
        self.probability = probability
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(seed)
        self._drawn: dict[int, int] = {}  # position -> the token verified there

    def replace(self, position: int, proposed: int) -> int:
        """The token to verify at ``position`` instead of ``proposed`` (``proposed`` past the continuation)."""
        index = position - self.first_position
        if not 0 <= index < len(self.continuation):
            return proposed
        if position not in self._drawn:
            truth = self.continuation[index]
            is_truth = self._rng.random() < self.probability
            wrong = (truth + 1 + self._rng.integers(self.vocab_size - 1)) % self.vocab_size  # never the truth
            self._drawn[position] = truth if is_truth else int(wrong)
        return self._drawn[position]

    def window(self, first: int, size: int) -> list[int]:
        """The tokens to verify at positions first .. first + size - 1, -1 where the draft stays."""
        return [self.replace(position, -1) for position in range(first, first + size)]
