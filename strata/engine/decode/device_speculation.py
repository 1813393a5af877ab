"""Greedy speculation on the device: the draft chain and the verify step as captured segments.

A greedy speculation step never brings logits to the host:

    draft:   the verified rows [R, D] (copied by the last verify's picks) and their next tokens and
             positions (one queued copy of ``inputs``) are in fixed buffers; segment first(R)
             runs the MTP block over them and writes the argmax of its row ``row_c`` (the last
             verified one; draft 1) into ``tok_c`` and that row into ``x_c``; segment chain runs
             the block on (x_c, tok_c) at ``pos_c`` and writes draft j + 1 over them, d - 1 times.
             Each ends with ``take_draft``, which records its draft in ``drafts``.
    verify:  the step of d + 1 rows (``DecodeStep``) embeds the token and the drafts from
             ``drafts``; a segment of picks (``greedy_rows``: the head, the request's bias, an argmax
             a row) writes the model's own pick after each row into ``targets``, and ``accept_drafts``
             the longest prefix of drafts equal to them, n, beside the picks into ``record`` (queued
             back to the host: d + 2 ids).

The longest agreeing prefix is taken, and the target after it is the next token. ``accept_drafts``
also writes what the next step reads, as the host would once it had read n: the verify step's token
``targets[n]`` and positions, and the draft's rows (all d + 1 of them: first(d + 1) runs over every
row, and its chain starts from row n; the MTP cells of the rows after n are written again before any
draft reads them, as the model's are). So the next step can be launched before the host reads this
one (``launch_chained``): the device runs on while the host reads and streams. ``take_draft`` also
applies the bench's draft oracle: the host writes the oracle's token for each position from the
first verified row's on (``window``, -1 where the draft stays: every place, outside the bench), and
the launch writes it over the draft on the device, so the oracle adds no host wait to a step and one
capture serves both. Drafts are picked without the request's logit bias (they only propose); targets
with it, from the padded bias buffers of the picks' segment (``greedy_tail.GreedyTails``, one per R).

Capturing a first(R) or the chain takes ~7 ms of the host, so the engine captures one first(R) and
the picks for every R and the chain at load (``prepare``) and keeps them across requests, charged to
``decode_graphs`` as decode's kept segments are, and dropped with them. They read the MTP block's
weights, the head and their buffers where these were when captured: views of the ``verifier``
arena (``verifier_arena.py``), a loan resource that is resident whenever a request decodes. A loan
frees and uploads those again, so a request's start (``begin_request``) checks them (weak references)
and captures the whole kept set again over the new ones, at the same size. Without ``prepare`` each request
captures what it replays, charged to its ``activations``, and ``end_request`` drops it.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref

import numpy as np

from strata.backend.ops import host_tier_bytes
from strata.engine.decode.greedy_tail import GreedyTails
from strata.engine.decode.mtp import MtpDraft
from strata.engine.memory.verifier_arena import VerifierLayout
from strata.engine.stream_stats import StreamStats
from strata.errors import EngineError, NonFiniteLogitsError
from strata.gpu.ledger import ACTIVATIONS_OWNER, DECODE_GRAPHS_OWNER


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
    record: object  # [R_max + 1] int32: a verify step's n and picks (``accept_drafts``)
    chain: object  # [3] int32: pos_c, place_c, row_c
    place_c: object  # [1] int32: the chain's place in drafts
    row_c: object  # [1] int32: the row of the first draft step the chain starts from
    window: object  # [2 R_max] int32: the draft oracle's token at position pos_in[0] + 2 + i, -1 to keep the draft
    inputs: object  # [4 R_max + 3] int32: tok_in, pos_in, chain and window, one block (one copy)


class DeviceSpeculation:
    def __init__(self, runner, mtp: MtpDraft, max_depth: int, arena):
        """arena: the ``verifier`` resource (``ArenaResource``), whose buffer the steps' buffers are carved from."""
        self.runner = runner
        self.arena = arena
        self.mtp = mtp
        self.ops = runner.ops
        self.max_rows = max_depth + 1
        self.is_kept = False  # segments kept across requests (``prepare``)
        self._buffers: _Buffers | None = None
        self._carved_from = None  # weakref to the arena buffer ``_buffers`` are views of
        self._first: dict[int, object] = {}  # [R] the first draft step over R rows
        self._chain = None
        self._tails: dict[int, tuple] = {}  # [R] (weakref to the step's rows, GreedyTails): the verify's picks
        self._biased: dict[int, object] = {}  # [R] the tail this request's bias was written into
        self._captured_over: list[weakref.ref] = []  # what the segments read that a loan uploads again
        self._is_pool_trimmed = False  # this request's (or the load's) first capture trimmed the allocator cache
        self._num_verified_rows = 0  # rows of the last verify that its picks copied into h_in, until a draft
        # [4 R_max + 3] int32 pinned, as ``inputs``: next tokens, positions, the chain's position, place and row,
        # the oracle's window
        self._host = None
        self._windows = None  # [2, 2 R_max] int32 pinned: the windows of chained steps, alternating
        self._num_chained = 0
        self._pending: collections.deque = collections.deque()  # (depth, ticket, is_chained) of steps not read
        self._readback = None

    @property
    def segments(self) -> tuple:
        """The captured draft segments: each first(R) by R, then the chain (the verify steps' picks aside)."""
        chain = () if self._chain is None else (self._chain,)
        return (*(self._first[rows] for rows in sorted(self._first)), *chain)

    def prepare(self, head: tuple) -> None:
        """Capture every first(R), the chain and the picks after a verify step of each R over ``head``
        now (the engine's load, after the verify steps' ``prepare``) and keep them across requests.
        Captures only: nothing runs, the block's KV cache is untouched."""
        self.is_kept = True
        self._check_segments()
        for num_rows in range(1, self.max_rows + 1):
            self._first_segment(num_rows)
            step = self.runner.step_of(num_rows)
            if step.rows is not None:
                self._picks(step.rows, head, None)
                if num_rows > 1:  # also after a plain run's one-row verify step (``launch_chained``)
                    step.prepare_drafts(self._buffers.drafts, after=self.runner.step_of(1))
        if self.max_rows > 2:  # a chain follows the first draft only from depth 2
            self._chain_segment()
        self._biased = {}

    def begin_request(self, head: tuple) -> None:
        """A request's decode starts (the loan has restored): where a loan uploaded again what kept segments
        read, capture the whole kept set again now, over ``head`` (the model's), so that the idle engine holds
        what the load kept; segments not kept are captured when first replayed."""
        self._allocated()
        self._is_pool_trimmed, self._num_verified_rows = False, 0
        if not self._is_current():
            self._check_segments()
            if self.is_kept:
                self.prepare(head)

    def draft(self, rows, next_tokens: list[int], start: int, depth: int, oracle=None) -> None:
        """``depth`` drafts into ``drafts`` after ``rows`` [R, D] (device) at positions ``start``..
        followed by ``next_tokens`` [R]. rows None: the first R rows of the last ``verify``, which its picks'
        segment copied where the draft reads them. oracle: the bench's replacement of each draft, drawn on
        the host in place order and written over the draft on the device (the chain continues from it)."""
        ops, num_rows = self.ops, len(next_tokens)
        buffers = self._allocated()
        if rows is not None:
            ops.copy_array(buffers.h_in[:num_rows], rows)
        elif num_rows > self._num_verified_rows:
            raise EngineError(f"a draft from the last verify step's {num_rows} rows follows a verify of "
                              f"{self._num_verified_rows}: pass the rows")
        self._num_verified_rows = 0
        host, max_rows = self._host, self.max_rows
        # in the layout of ``inputs``; rewritten only after the previous step's readback: its queued copy has landed
        host[:num_rows] = next_tokens
        host[max_rows:max_rows + num_rows] = np.arange(start, start + num_rows)
        host[2 * max_rows:2 * max_rows + 3] = (start + num_rows, 0, num_rows - 1)  # the chain's position, place, row
        window = host[2 * max_rows + 3:]  # [2 R_max]: window[i] verified at start + 2 + i
        window[:] = -1
        if oracle is not None:  # the draft at ``place`` (window[row + place]) follows the newest token
            window[num_rows - 1:num_rows - 1 + depth] = oracle.window(start + num_rows + 1, depth)
        ops.copy_in(buffers.inputs, host, is_queued=True)
        self._replay_drafts(num_rows, depth)

    def verify(self, token: int, position: int, depth: int, head: tuple, bias, stats: StreamStats):
        """The rows [d + 1, D] of ``token`` and the ``depth`` drafts at ``position``.., how many drafts the
        model took and its greedy pick after each row [d + 1]. bias: the request's logit bias on the host
        (ids [n] int32, values [n] float32), or None."""
        rows = self.launch_verify(token, position, depth, head, bias, stats)
        return (rows, *self.read_verify(depth, stats, position))

    def launch_ahead(self, depth: int) -> bool:
        """Whether a verify step of ``depth`` drafts runs without the host between its layers (every expert
        cached, or misses read in place): only such a step launched ahead lets the host go on meanwhile."""
        return self.runner.step_of(depth + 1).is_host_free

    def launch_verify(self, token: int, position: int, depth: int, head: tuple, bias, stats: StreamStats):
        """``verify``'s launches, the host not waiting: the rows [d + 1, D]. ``read_verify`` reads the
        step's drafts and picks, with nothing launched in between."""
        buffers = self._allocated()
        step = self.runner.step_of(depth + 1)
        rows = step.forward([token] + [0] * depth, position, stats, buffers.drafts if depth else None)
        self._replay_picks(rows, head, bias, is_chained=False)
        return rows

    def launch_after_greedy(self, head: tuple, bias, stats: StreamStats) -> None:
        """A verify step of no drafts, queued behind the greedy step launched last (``DecodeStep.greedy_tokens``'s
        ``then``) on the token it picked on the device: its row is where the next draft reads it, and
        ``read_verify(0, ...)`` reads its pick, the host never having launched from that token."""
        self._allocated()
        rows = self.runner.step_of(1).forward_picked(stats)
        self._replay_picks(rows, head, bias, is_chained=True)

    def can_chain(self, depth: int) -> bool:
        """Whether a step of ``depth`` drafts can be chained on the device after the step launched last: a whole-token
        verify step that this request has run before (its first step writes its tables from the host)."""
        step = self.runner.step_of(depth + 1)
        return depth > 0 and step.is_host_free and step.is_started

    def launch_chained(self, depth: int, start: int, head: tuple, bias, stats: StreamStats, oracle=None) -> None:
        """The next step of ``depth`` drafts after the step launched last (of the same depth, or a verify step of no
        drafts: a plain run's last), launched before the host has read that one: its draft and verify read what
        that step's acceptance wrote on the device. start: the first position of the step launched last (the
        host knows it; the one launched now starts n + 1 later). oracle: as ``draft`` takes it, its tokens from
        start + 2 on."""
        buffers = self._allocated()
        previous = self._pending[-1][0] if self._pending else None
        if previous not in (0, depth) or not self.can_chain(depth):
            raise EngineError(f"a chained step of depth {depth} follows a launched step of the same depth or of none, "
                              f"and a step of its rows this request ran (launched: "
                              f"{[entry[0] for entry in self._pending]})")
        if oracle is not None:  # for every n of the step before: the place j reads window[n + j]
            window = self._windows[self._num_chained % 2]  # its queued copy two chained steps ago has landed
            window[:] = -1
            window[:2 * depth] = oracle.window(start + 2, 2 * depth)
            self.ops.copy_in(buffers.window, window, is_queued=True)
        self._num_chained += 1
        self._replay_drafts(previous + 1, depth)  # from every row of the step before
        after = self.runner.step_of(1) if previous != depth else None  # its token and position are that step's
        rows = self.runner.step_of(depth + 1).forward_queued(stats, buffers.drafts, after)
        self._replay_picks(rows, head, bias, is_chained=True)

    def read_verify(self, depth: int, stats: StreamStats, position: int) -> tuple[int, list[int]]:
        """How many drafts the oldest launched step not read yet took, n, and the model's picks [d + 1] after its
        rows (it emits picks[:n + 1]), once it has run. position: the step's first position."""
        if not self._pending or self._pending[0][0] != depth:
            raise EngineError(f"a read of a step of depth {depth}, but the steps launched are of depths "
                              f"{[entry[0] for entry in self._pending]}")
        _, ticket, is_chained = self._pending.popleft()
        record = stats.waited(self._readback.read_record, ticket)  # [d + 2]
        targets, vocab_size = record[1:], self.runner.spec.vocab_size
        if np.any(targets < 0) or np.any(targets >= vocab_size):  # the argmax found no finite logit
            raise NonFiniteLogitsError(f"the device picked token id {int(targets.max())} outside the vocabulary: "
                                       "the logits were not finite (NaN); check the model file, or decode with "
                                       "runtime.greedy_on_device = false")
        if is_chained:  # its positions were the device's: counted now, as ``forward`` counts the host's
            stats.kv_host_bytes += host_tier_bytes(self.runner.kv, position, position + depth + 1)
        return int(record[0]), targets.tolist()

    def _replay_drafts(self, num_rows: int, depth: int) -> None:
        """first(num_rows), then the chain: ``depth`` drafts from the inputs in place."""
        self._first_segment(num_rows).replay()
        for _ in range(depth - 1):
            self._chain_segment().replay()

    def _replay_picks(self, rows, head: tuple, bias, is_chained: bool) -> None:
        """The picks and acceptance after a verify step's ``rows`` [d + 1, D], and their record queued back."""
        if len(self._pending) >= 2:  # the readback's record slots: a third would overwrite the oldest unread
            raise EngineError("a third verify step launched before the first was read; read it first")
        self._picks(rows, head, bias).segment.replay()
        depth = rows.shape[0] - 1
        self._num_verified_rows = depth + 1
        self._pending.append((depth, self._readback.queue_record(self._buffers.record[:depth + 2]), is_chained))

    def end_request(self) -> None:
        """A request's speculation is over: kept segments wait for the next one, others are dropped."""
        self._is_pool_trimmed, self._num_verified_rows = False, 0
        self._biased = {}
        self._pending.clear()
        for _, tails in self._tails.values():
            tails.end_request()
        if not self.is_kept:
            self.reset()

    def reset(self) -> None:
        """Drop the segments, kept or not (a later request captures again); the arena stays the resource's."""
        self._close_segments()
        self._buffers = self._carved_from = None
        self.is_kept = self._is_pool_trimmed = False
        self._num_verified_rows = 0
        self._pending.clear()

    def _close_segments(self) -> None:
        for segment in self.segments:
            segment.close()
        for _, tails in self._tails.values():
            tails.close()
        self._first, self._chain, self._tails, self._biased = {}, None, {}, {}
        self._captured_over = []

    def _picks(self, rows, head: tuple, bias):
        """The captured greedy picks after the verify step's ``rows`` [R, D] (a ``greedy_tail.Tail``): the
        head, the request's bias and each row's argmax into ``targets``, and the logits into the arena's.
        Captured again where the step's rows buffer is another (a step that was not kept)."""
        num_rows = rows.shape[0]
        rows_ref, tails = self._tails.get(num_rows, (None, None))
        if tails is None or rows_ref() is not rows:
            if tails is not None:
                tails.close()
            rows_ref = weakref.ref(rows)
            tails = GreedyTails(self.ops, lambda head, bias: self._pick_rows(rows_ref(), head, bias), self._capture)
            tails.is_kept = self.is_kept
            self._tails[num_rows] = (rows_ref, tails)
        tail = tails.for_request(head, 0 if bias is None else len(bias[0]))
        if self._biased.get(num_rows) is not tail:  # once a request, and again in a tail captured since
            tail.write_bias(self.ops, bias)
            self._biased[num_rows] = tail
        return tail

    def _pick_rows(self, rows, head: tuple, bias) -> tuple:
        num_rows, buffers, ops = rows.shape[0], self._buffers, self.ops
        ops.greedy_rows(rows, *head, bias, buffers.targets[:num_rows], logits=buffers.logits[:num_rows])
        ops.copy_array(buffers.h_in[:num_rows], rows)  # what the next draft reads (of them, the verified)
        ops.accept_drafts(buffers.drafts, buffers.targets, num_rows - 1, self.runner.spec.vocab_size,
                          self.runner.step_of(num_rows).inputs, buffers.inputs[:2 * self.max_rows], buffers.chain,
                          buffers.record)
        return ()

    def _reads(self) -> list:
        """What the segments read that a loan frees and uploads again: the arena (the buffers), the block's
        weights and the head its drafts come from."""
        return [self.arena.buffer, *self.mtp.weights.tensors.values(), *self.mtp.head()[:2]]

    def _is_current(self) -> bool:
        """Whether the segments were captured over the weights and buffers resident now."""
        reads = self._reads()
        return len(reads) == len(self._captured_over) and all(ref() is read
                                                               for ref, read in zip(self._captured_over, reads))

    def _check_segments(self) -> None:
        """Drop segments captured over weights or buffers that are no longer the ones resident."""
        if not self._is_current():
            self._close_segments()
            self._captured_over = [weakref.ref(read) for read in self._reads()]

    def _capture(self, fn, owner: str):
        """ops.capture, after trimming the allocator cache once in the request: nothing pooled may be freed
        while capturing (as ``DecodeStep._capture``)."""
        if not self._is_pool_trimmed:
            self.ops.trim_memory()
            self._is_pool_trimmed = True
        return self.ops.capture(fn, owner)

    @property
    def _owner(self) -> str:
        return DECODE_GRAPHS_OWNER if self.is_kept else ACTIVATIONS_OWNER

    def _allocated(self) -> _Buffers:
        if not self.arena.is_resident:
            raise EngineError("the verifier arena is not resident: a loan still holds it (speculation runs "
                              "only after the loan restores)")
        if self._buffers is None or self._carved_from() is not self.arena.buffer:
            ops, rows, spec = self.ops, self.max_rows, self.runner.spec
            layout = VerifierLayout(spec.hidden_size, spec.vocab_size, rows)
            self._buffers = _Buffers(**layout.carve(self.arena.buffer))
            self._carved_from = weakref.ref(self.arena.buffer)
            if self._host is None:
                self._host = ops.host_buffer(4 * (4 * rows + 3)).view(np.int32)
                self._windows = ops.host_buffer(4 * 4 * rows).view(np.int32).reshape(2, 2 * rows)
                self._readback = ops.readback()
        return self._buffers

    def _first_segment(self, num_rows: int):
        if num_rows not in self._first:
            self._allocated()
            self._first[num_rows] = self._capture(lambda: self._first_step(num_rows), self._owner)
        return self._first[num_rows]

    def _chain_segment(self):
        if self._chain is None:
            self._allocated()
            self._chain = self._capture(self._chain_step, self._owner)
        return self._chain

    def _first_step(self, num_rows: int):
        buffers, ops = self._buffers, self.ops
        x = self.mtp.hidden(buffers.h_in[:num_rows], buffers.tok_in[:num_rows], 0,
                            positions=buffers.pos_in[:num_rows])  # [R, D]
        ops.take_row(x, buffers.row_c, buffers.x_c)
        ops.greedy_token(buffers.x_c, *self.mtp.head(), None, buffers.tok_c)
        ops.take_draft(buffers.tok_c, buffers.window, buffers.place_c, buffers.row_c, buffers.drafts)
        return ()

    def _chain_step(self):
        buffers, ops = self._buffers, self.ops
        x = self.mtp.hidden(buffers.x_c, buffers.tok_c, 0, positions=buffers.pos_c)  # [1, D]
        ops.copy_array(buffers.x_c, x)
        ops.increment(buffers.pos_c)
        ops.greedy_token(buffers.x_c, *self.mtp.head(), None, buffers.tok_c)
        ops.take_draft(buffers.tok_c, buffers.window, buffers.place_c, buffers.row_c, buffers.drafts)
        return ()
