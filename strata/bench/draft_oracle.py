"""``strata bench --draft-oracle P``: speculation measured independent of the draft head's weights.

A synthetic model's MTP block has random weights, so its drafts are almost never taken and say
nothing about what speculation can do. The oracle keeps every draft computation (the MTP block
runs; its memory and time are real) but replaces each proposed token by the target's own greedy
continuation, recorded by plain decode from the same request's prefill before its timed decode
(another prefill of the prompt, in other chunks, may pick other tokens where two logits nearly
tie), with probability P, and by a token that differs from it otherwise. A position's draw is a
function of the seed and the position alone: a position drafted again (after a refusal before it)
gets the same token, and a device step can read the oracle's tokens for positions it only learns on
the device (``window``), drawing some that a step launched from the host never drafts (the position
after d drafts all taken) without changing any other position's token. A measurement mode of the
bench only: serving never passes one.
"""

from __future__ import annotations

_MASK_64 = (1 << 64) - 1
_GOLDEN_64 = 0x9E3779B97F4A7C15


def _mix64(value: int) -> int:
    """splitmix64's finalizer: 64 well-mixed bits of ``value``."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return value ^ (value >> 31)


class DraftOracle:
    def __init__(self, continuation: list[int] | None, first_position: int, probability: float, vocab_size: int,
                 seed: int = 0):
        """continuation: the greedy tokens of a plain run, the first at ``first_position`` (the prompt's
        length); None: the request records them from its own prefill before its timed decode."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"the draft oracle's probability must be in [0, 1], got {probability}")
        if vocab_size < 2:
            raise ValueError(f"the draft oracle needs a vocabulary of at least 2 tokens (a wrong one to draw), "
                             f"got {vocab_size}")
        self.continuation = continuation
        self.first_position = first_position
        self.probability = probability
        self.vocab_size = vocab_size
        self._seed_bits = _mix64(seed & _MASK_64)
        self._drawn: dict[int, int] = {}  # position -> the token verified there

    def replace(self, position: int, proposed: int) -> int:
        """The token to verify at ``position`` instead of ``proposed`` (``proposed`` past the continuation)."""
        index = position - self.first_position
        if not 0 <= index < len(self.continuation):
            return proposed
        if position not in self._drawn:
            truth = self.continuation[index]
            bits = _mix64((self._seed_bits + _GOLDEN_64 * (position + 1)) & _MASK_64)
            is_truth = (bits >> 11) / float(1 << 53) < self.probability  # a uniform draw in [0, 1)
            wrong = (truth + 1 + _mix64(bits) % (self.vocab_size - 1)) % self.vocab_size  # never the truth
            self._drawn[position] = truth if is_truth else int(wrong)
        return self._drawn[position]

    def window(self, first: int, size: int) -> list[int]:
        """The tokens to verify at positions first .. first + size - 1, -1 where the draft stays."""
        return [self.replace(position, -1) for position in range(first, first + size)]
