"""Greedy speculation on the device: the draft chain and the verify step as captured segments.

A greedy speculation step never brings logits to the host:

    draft:   the verified rows [R, D] and their next tokens go to fixed buffers; segment first(R)
             runs the MTP block over them and writes the argmax of its last row (draft 1) into
             ``tok_c`` and that row into ``x_c``; segment chain runs the block on (x_c, tok_c) at
             ``pos_c`` and writes draft j + 1 over them, d - 1 times. A kernel copies each draft
             into ``drafts``.
    verify:  the step of d + 1 rows (``DecodeStep``) embeds the token and the drafts from
             ``drafts``; ``greedy_rows`` writes the model's own pick after each row into
             ``targets``; the host reads drafts and targets (4 bytes each) in one wait.

The host compares them: the longest agreeing prefix is taken, and the target after it is the next
token. With the bench's draft oracle, the host draws each place's replacement before the chain runs
(``overrides``, -1 where the draft stays), and segments captured with it write the replacement over
each draft on the device, so the oracle adds no host wait to a step. Drafts are picked without the
request's logit bias (they only propose); targets with it.
The segments read the MTP block's weights and the head where they were when captured, and a loan
uploads those again for every request, so they are captured per request (one first(R) for each
R the request meets, and one chain) and dropped at its end (``close``). Their buffers and the verify
step's logits are views of the ``verifier`` arena (``verifier_arena.py``), a loan resource that is
resident whenever a request decodes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from strata.engine.decode.mtp import MtpDraft
from strata.engine.memory.verifier_arena import VerifierLayout
from strata.engine.stream_stats import StreamStats
from strata.errors import EngineError, NonFiniteLogitsError
from strata.gpu.ledger import ACTIVATIONS_OWNER


@dataclasses.dataclass
class _Buffers:
    h_in: object  # [R_max, D] float32: the rows the first draft step reads
    tok_in: object  # [R_max] int32: the token after each of them
    pos_in: object  # [R_max] int32: their positions
    x_c: object  # [1, D] float32: the chain's state
    tok_c: object  # [1] int32: the chain's newest draft
    pos_c: object  # [1] int32: the chain's position
    drafts: object  # [R_max] int32
    targets: object  # [R_max] int32
    logits: object  # [R_max, V] float32: the verify step's
    overrides: object  # [R_max] int32: the draft oracle's token at each place, -1 to keep the draft
    place_c: object  # [1] int32: the chain's place in overrides


class DeviceSpeculation:
    def __init__(self, runner, mtp: MtpDraft, max_depth: int, arena):
        """arena: the ``verifier`` resource (``ArenaResource``), whose buffer the steps' buffers are carved from."""
        self.runner = runner
        self.arena = arena
        self.mtp = mtp
        self.ops = runner.ops
        self.max_rows = max_depth + 1
        self._buffers: _Buffers | None = None
        self._first: dict[tuple[int, bool], object] = {}  # [(R, is_oracle)] the first draft step over R rows
        self._chain: dict[bool, object] = {}  # [is_oracle]
        # [3 R_max + 2] int32 pinned: next tokens, positions, the chain's position, overrides, their first place
        self._host = None
        self._readback = None

    def draft(self, rows, next_tokens: list[int], start: int, depth: int, oracle=None) -> None:
        """``depth`` drafts into ``drafts`` after ``rows`` [R, D] (device) at positions ``start``..
        followed by ``next_tokens`` [R]. oracle: the bench's replacement of each draft, drawn on the host
        in place order and written over the draft on the device (the chain continues from it)."""
        ops, num_rows = self.ops, len(next_tokens)
        buffers = self._allocated()
        ops.copy_array(buffers.h_in[:num_rows], rows)
        host, max_rows = self._host, self.max_rows
        # rewritten only after the previous step's readback: its queued copies have landed
        host[:num_rows] = next_tokens
        host[max_rows:max_rows + num_rows] = np.arange(start, start + num_rows)
        host[2 * max_rows] = start + num_rows
        ops.copy_in(buffers.tok_in[:num_rows], host[:num_rows], is_queued=True)
        ops.copy_in(buffers.pos_in[:num_rows], host[max_rows:max_rows + num_rows], is_queued=True)
        ops.copy_in(buffers.pos_c, host[2 * max_rows:2 * max_rows + 1], is_queued=True)
        is_oracle = oracle is not None
        if is_oracle:
            overrides = host[2 * max_rows + 1:3 * max_rows + 2]  # [R_max] and the place, 0
            # the draft at ``place`` is verified at the position after the newest token's; -1: keep the draft
            overrides[:depth] = [oracle.replace(start + num_rows + place + 1, -1) for place in range(depth)]
            overrides[depth:] = -1
            overrides[max_rows] = 0
            ops.copy_in(buffers.overrides, overrides[:max_rows], is_queued=True)
            ops.copy_in(buffers.place_c, overrides[max_rows:], is_queued=True)
        self._first_segment(num_rows, is_oracle).replay()
        for place in range(depth):
            if place:
                self._chain_segment(is_oracle).replay()
            ops.copy_array(buffers.drafts[place:place + 1], buffers.tok_c)

    def verify(self, token: int, position: int, depth: int, head: tuple, bias, stats: StreamStats):
        """The rows [d + 1, D] of ``token`` and the ``depth`` drafts at ``position``.., and the host's
        copies of the drafts [d] and of the model's greedy pick after each row [d + 1]."""
        buffers = self._allocated()
        step = self.runner.step_of(depth + 1)
        rows = step.forward([token] + [0] * depth, position, stats, buffers.drafts[:depth] if depth else None)
        self.ops.greedy_rows(rows, *head, bias, buffers.targets[:depth + 1], logits=buffers.logits[:depth + 1])
        drafts, targets = stats.waited(self._readback.now, buffers.drafts[:depth] if depth else None,
                                       buffers.targets[:depth + 1])
        vocab_size = self.runner.spec.vocab_size
        if np.any(targets < 0) or np.any(targets >= vocab_size):  # the argmax found no finite logit
            raise NonFiniteLogitsError(f"the device picked token id {int(targets.max())} outside the vocabulary: "
                                       "the logits were not finite (NaN); check the model file, or decode with "
                                       "runtime.greedy_on_device = false")
        return rows, ([] if drafts is None else drafts.tolist()), targets.tolist()

    def close(self) -> None:
        """Drop the segments (the end of a request); the arena stays the resource's."""
        for segment in [*self._first.values(), *self._chain.values()]:
            segment.close()
        self._first, self._chain = {}, {}
        self._buffers = None

    def _allocated(self) -> _Buffers:
        if self._buffers is None:
            if not self.arena.is_resident:
                raise EngineError("the verifier arena is not resident: a loan still holds it (speculation runs "
                                  "only after the loan restores)")
            ops, rows, spec = self.ops, self.max_rows, self.runner.spec
            layout = VerifierLayout(spec.hidden_size, spec.vocab_size, rows)
            self._buffers = _Buffers(**layout.carve(self.arena.buffer))
            if self._host is None:
                self._host = ops.host_buffer(4 * (3 * rows + 2)).view(np.int32)
                self._readback = ops.readback()
        return self._buffers

    def _first_segment(self, num_rows: int, is_oracle: bool):
        key = (num_rows, is_oracle)
        if key not in self._first:
            self._first[key] = self.ops.capture(lambda: self._first_step(num_rows, is_oracle), ACTIVATIONS_OWNER)
        return self._first[key]

    def _chain_segment(self, is_oracle: bool):
        if is_oracle not in self._chain:
            self._chain[is_oracle] = self.ops.capture(lambda: self._chain_step(is_oracle), ACTIVATIONS_OWNER)
        return self._chain[is_oracle]

    def _first_step(self, num_rows: int, is_oracle: bool):
        buffers, ops = self._buffers, self.ops
        x = self.mtp.hidden(buffers.h_in[:num_rows], buffers.tok_in[:num_rows], 0,
                            positions=buffers.pos_in[:num_rows])  # [R, D]
        ops.copy_array(buffers.x_c, x[num_rows - 1:])
        ops.greedy_token(buffers.x_c, *self.mtp.head(), None, buffers.tok_c)
        if is_oracle:
            ops.override_token(buffers.tok_c, buffers.overrides, buffers.place_c)
        return ()

    def _chain_step(self, is_oracle: bool):
        buffers, ops = self._buffers, self.ops
        x = self.mtp.hidden(buffers.x_c, buffers.tok_c, 0, positions=buffers.pos_c)  # [1, D]
        ops.copy_array(buffers.x_c, x)
        ops.increment(buffers.pos_c)
        ops.greedy_token(buffers.x_c, *self.mtp.head(), None, buffers.tok_c)
        if is_oracle:
            ops.override_token(buffers.tok_c, buffers.overrides, buffers.place_c)
        return ()
