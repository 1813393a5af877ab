"""A decode token as captured segments: one per layer and one more (a few for the whole token when
every expert is cached), recorded once and replayed for every token. A step of ``num_rows`` tokens
at once (the rows of a speculative verify step, up to ``DECODE_MAX_ROWS``) is the same segments
over [R, ...] buffers: the backend computes each row as it computes a one-token step.

Per layer l (the operations of ``ModelRunner.forward`` with one token, but for the routing, one launch
here, ``ops.decode_route``, whose router logits are its own sums: where two experts' logits nearly tie,
a step may pick another expert than an uncaptured forward of the same row):

    A_l:   x += attention block;  h, ids, w = decode_route(x)   (norm, router, top-k)
    host:  ids → slots: hits looked up, misses inserted and staged (copy stream, events)
    B_l:   x += sum_k w * expert_slot_k(h)

The host must see the routing before it can stage the misses, so a layer cannot be one graph.
Nothing of the host's comes between B_l and A_{l+1}, so they are one segment (a graph launch a
layer: each costs the host a driver call): the token is segment 0 = A_0, then segment l + 1 =
B_l A_{l+1} (the last only B_{L-1}), and between two segments the host's cache bookkeeping and
one small upload of [1, k] slot ids. A segment's inputs are buffers of this object (x, the
position, the slot ids), refreshed before the replay; its kernels read the position on the device
(``ops.attention`` at one token), so one capture serves every position. Segments hold their memory until ``reset``.
The step sees the model only through ``DecodeLayers`` (``layers.py``), which the runner implements.

Capturing a token's ~600 launches takes ~170 ms of host time, so the engine captures them at load
(``prepare``) and keeps them, and their buffers, across requests, charged to ``decode_graphs`` (the
engine's idle ledger counts them). What they reference does not move while the engine lives
(weights, KV cache, the expert arena's address range, this object's buffers); what a request may
change is checked at its first step. The slot tables of a resident token are rewritten. A kept
greedy tail captured over another output head tensor (a loan uploads the head again) is captured
again, at the same size. A bias longer than the kept tail holds gets a tail for the request alone.
A model that became, or stopped being, fully cached needs the other kind of segments: the kept
ones are dropped and from then on every request captures its own. Without ``prepare`` (no
warm-up) a request captures what it replays, charged to its ``activations``, and ``end_request``
drops it.

Prefetch (``is_prefetching``): A_l (in segment l) also runs layer l+1's router on layer l's
stream (its input differs from the real one only by this layer's experts and the next attention,
so in deep layers it mostly picks the same experts); the host stages the predicted misses right
behind this layer's, and they copy while layer l's experts and layer l+1's attention compute. A
prediction changes which experts are cached, never what is computed.

When the cache holds every expert of every layer at a request's first token (a budget the whole
model fits in), nothing can miss: the slots of all experts go to the device once as [L, N] tables,
each layer maps its routed ids through its table on the device, and the whole token is a few graphs
of TOKEN_PART_LAYERS layers with no host round trip (``kind`` RESIDENT). Nothing is inserted or
evicted during decode, so the tables stay true until the request ends. Where misses are read in
place (``is_reading_in_place``, ``expert_addresses.py``), a token of a model that does not fit is
such graphs too (``kind`` ADDRESSED): each layer's experts are read through a table of plane
addresses, cache slots or the pinned expert pack (``token_tables.py``), and the host reads back
only how many pairs were read from host memory.

Greedy decode (``greedy_tokens``) ends each step on the device: the output head, the request's
logit bias and the argmax write the next token's id, the position steps, and the id is embedded
for the next step (``_greedy_tail``, a segment replayed after the layers; ``greedy_tail.py`` says
which captured tail a request gets). The host reads the id back (4 bytes) only to stream it and
to decide when to stop; a resident model queues the next step before it reads, so the GPU runs on.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator

import numpy as np

from strata.backend.ops import host_tier_bytes
from strata.engine.decode.greedy_tail import GreedyTails
from strata.engine.decode.layers import DecodeLayers
from strata.engine.decode.token_tables import ADDRESSED, LAYERS, RESIDENT, TokenTables
from strata.engine.stream_stats import StreamStats
from strata.errors import EngineError, NonFiniteLogitsError
from strata.gpu.ledger import ACTIVATIONS_OWNER, DECODE_GRAPHS_OWNER

log = logging.getLogger("strata.engine")
# a whole token's layers a segment: the device waited ~0.5 ms between a verify step's embedding and its first layer
# while the host launched the one graph of 48 layers (device_trace, H200); a verify step is launched after its draft,
# which the device runs in ~0.3 ms, so the device idled. In parts, it starts on the first while the host launches
# the rest (a plain step, launched a step ahead, does not wait either way)
TOKEN_PART_LAYERS = 12


def can_use_segments(model: DecodeLayers) -> bool:
    """Graph decode covers MoE layers without a shared expert (Qwen3-MoE); others run plain launches."""
    spec = model.spec
    return bool(getattr(model.ops, "can_capture", False)) and spec.is_moe and not spec.shared_expert_ffn_size \
        and model.cache is not None


class DecodeStep:
    def __init__(self, model: DecodeLayers, is_prefetching: bool = False, num_rows: int = 1,
                 is_reading_in_place: bool = False):
        self.model = model
        self.is_prefetching = is_prefetching
        # misses read from the pinned pack: the caller checked that the backend can (``can_read_in_place``)
        self.is_reading_in_place = is_reading_in_place
        self.num_rows = num_rows  # tokens a step computes (consecutive positions)
        self.is_kept = False  # segments and buffers kept across requests (``prepare``)
        self._is_request_start = True
        self._is_pool_trimmed = False  # this request's first capture trimmed the allocator cache
        self._x = None  # [R, D] the residual stream
        self._inputs = None  # [2R] int32: the tokens, then their positions (one queued copy)
        self._token_id = None  # [R] int32, a view of _inputs
        self._positions = None  # [R] int32, a view of _inputs
        # [is after a one-row step] (weakrefs to what it reads, segment): the drafts copied in, the tokens embedded
        self._drafts_in: dict[bool, tuple] = {}
        self._step_row = None  # [2R] int32 in pinned host memory: the tokens and positions, queued copies
        self._slot_ids = None  # [R, k] int32
        self._route_counters = None  # [R] int32, zero between launches (``ops.decode_route``'s)
        self._attention_scratch: tuple | None = None  # every layer's (ops.decode_attention_scratch)
        self._slot_rows = None  # [L, R * k] int32 in pinned host memory: each layer's slot ids, queued copies
        self._segments: list = []  # [L + 1]: A_0, then B_l A_{l+1} (``_segment``)
        self.kind: str | None = None  # RESIDENT, ADDRESSED or LAYERS, decided at a request's first token
        self._prefetched = None  # (ticket, experts): the copies of the next layer's predicted experts
        self._tables = TokenTables(model)  # what a whole-token step reads its experts through
        self._num_uncounted_steps = 0  # whole-token ``forward`` steps whose hits and misses are not counted yet
        self._token_parts: list = []  # a whole token's layers (resident or addressed), TOKEN_PART_LAYERS a segment
        self._tails = GreedyTails(model.ops, self._greedy_tail, self._capture)
        self._readback = None  # Readback, kept across requests (its pinned slots and events)

    @property
    def rows(self):
        """The residual stream [R, D] that ``forward`` returns (None until a request or ``prepare`` allocates it)."""
        return self._x

    @property
    def inputs(self):
        """[2R] int32 on the device: the step's tokens, then their positions (None until allocated). A captured
        verify step's acceptance writes the next step's here (``forward_queued``)."""
        return self._inputs

    @property
    def is_host_free(self) -> bool:
        """Whether a step runs its layers as whole-token segments, the host not between them (``kind`` RESIDENT or
        ADDRESSED), as the request's first step decides it (or would, from the cache as it is now)."""
        kind = self._kind_now() if self._is_request_start or self.kind is None else self.kind
        return kind != LAYERS

    @property
    def is_resident(self) -> bool | None:
        """Whether every expert is cached (None until a request's first token decides)."""
        return None if self.kind is None else self.kind == RESIDENT

    def prepare(self, head: tuple | None) -> None:
        """Capture the segments the next request's decode replays, now (the engine's load), and keep
        them across requests. head: as ``greedy_tokens`` takes it, or None where greedy decode on
        the device is off or the head is not resident (the tail is then captured by the first
        greedy request). Captures only: nothing runs, the KV cache is untouched."""
        self.is_kept, self._tails.is_kept = True, head is not None
        self._start_request()
        if self.kind != LAYERS:
            self._token_segments()
        else:
            for index in range(self.model.spec.num_layers + 1):
                self._segment(index)
        if head is not None:
            self._tails.for_request(head, 0)
        self._is_request_start = True  # the first request still checks what its prefill changed

    def prepare_drafts(self, drafts, after=None) -> None:
        """Capture now the segment that takes the tokens after the first from ``drafts`` (``forward``'s), and
        where ``after`` (a one-row step) is given, the one that also takes the first token and the positions from
        its inputs (``forward_queued``'s after it), kept as the step's other segments are."""
        self._drafts_segment(drafts)
        if after is not None:
            self._drafts_segment(drafts, after.inputs)

    def forward(self, tokens, position: int, stats: StreamStats, drafts=None):
        """Hidden states [R, D] of ``tokens`` [R] at ``position``.. (before the output norm); appends their KV.
        drafts: int32 on the device whose first R - 1 are the tokens after the first (the host's are then
        ignored); one buffer for every step, so that copying them in and embedding is one captured segment."""
        self._begin(tokens, position, drafts)
        stats.kv_host_bytes += host_tier_bytes(self.model.kv, position, position + self.num_rows)
        if self.kind != LAYERS:
            self._replay_whole_token()
        else:
            self._layers(stats)
        return self._x

    @property
    def is_started(self) -> bool:
        """Whether the request has run a step of these rows (its tables written, its kind decided)."""
        return not self._is_request_start

    def forward_queued(self, stats: StreamStats, drafts, after=None):
        """``forward`` of the tokens and positions that work queued before it writes into ``inputs`` on the device
        (the first token there, the rest from ``drafts``), the host never knowing them: a whole-token step of a
        request that has run a ``forward`` already. after: a one-row step whose ``inputs`` that work wrote
        instead (its token is this step's first, its position this step's first). The caller counts its
        host-tier KV bytes once it knows the position."""
        if self._is_request_start or self.kind == LAYERS:
            raise EngineError("a step from the device's inputs follows a whole-token step of the same request")
        self._drafts_segment(drafts, None if after is None else after.inputs).replay()
        self._replay_whole_token()
        return self._x

    def forward_picked(self, stats: StreamStats):
        """``forward`` of the token the greedy step queued last picked and embedded on the device, at the
        position it stepped to (``_greedy_tail``), queued behind it: the rows [1, D]. The caller counts its
        host-tier KV bytes once it knows the position."""
        if self.num_rows != 1 or self._is_request_start or self.kind == LAYERS:
            raise EngineError("a step of the token a greedy step picked follows a whole-token greedy step of the "
                              "same request")
        self._replay_whole_token()
        return self._x

    def _replay_whole_token(self) -> None:
        for part in self._token_segments():
            part.replay()
        self._num_uncounted_steps += 1  # counted at the end of decode (``count_reads``): no wait here

    def greedy_tokens(self, token: int, position: int, num_steps: int, head: tuple, bias: tuple | None,
                      stats: StreamStats, then: Callable[[], None] | None = None) -> Iterator[int]:
        """The greedy continuation of ``token`` at ``position``: the id each of ``num_steps`` steps
        picks on the device (``ops.greedy_token``), which the next step embeds there too; the host
        reads 4 bytes a token. head: (output norm, head QTensor, eps). bias: host (ids [n] int32,
        values [n] float32) added to the logits, ids checked by the caller, or None.

        A whole-token step (every expert cached, or misses read in place) runs one step ahead: step s+1
        is queued before step s's id is read, so the GPU does not wait for the host between tokens. A
        caller that stops early leaves that step's KV cell written past the tokens it keeps; a later
        token or request writes it again. then: launched once, right after the last step and before its
        token is read (work queued behind the run: ``forward_picked``'s step)."""
        if self.num_rows != 1:
            raise EngineError("greedy decode on the device runs one token a step")
        self._begin([token], position)
        tail = self._tails.for_request(head, 0 if bias is None else len(bias[0]))
        tail.write_bias(self.model.ops, bias)
        readback, error, num_launched, num_read = self._readback, None, 0, 0
        is_then_launched = is_done = False  # is_done: every step read and its token taken
        try:
            if self.kind != LAYERS:
                layers = self._token_segments()
                ahead = _launch(layers, tail.segment, readback, self._token_id) if num_steps else None
                num_launched = min(num_steps, 1)
                for step in range(num_steps):
                    pending = ahead
                    ahead = _launch(layers, tail.segment, readback, self._token_id) if step + 1 < num_steps else None
                    num_launched += ahead is not None
                    if ahead is None and step + 1 == num_steps and then is not None:
                        then()
                        is_then_launched = True
                    stats.kv_host_bytes += host_tier_bytes(self.model.kv, position + step, position + step + 1)
                    token = self._checked(stats.waited(readback.read, pending))
                    num_read += 1
                    yield token
                is_done = True
                return
            for step in range(num_steps):
                self._layers(stats)
                stats.kv_host_bytes += host_tier_bytes(self.model.kv, position + step, position + step + 1)
                ticket = _launch(None, tail.segment, readback, self._token_id)
                if step + 1 == num_steps and then is not None:
                    then()
                    is_then_launched = True
                yield self._checked(stats.waited(readback.read, ticket))
            is_done = True
        except Exception as exc:
            error = exc
            raise
        finally:
            # the step running ahead finishes before the request's buffers are dropped; after an
            # error, that error is the one to see
            if error is None:
                if num_read < num_launched or (is_then_launched and not is_done):  # the caller stopped early
                    self.model.ops.synchronize()
                if is_then_launched:  # counted at the end of decode: a count now could wait for what it queued
                    self._num_uncounted_steps += num_launched
                elif num_launched:
                    self._count_token_reads(stats, num_launched)
            else:
                with contextlib.suppress(Exception):
                    self.model.ops.synchronize()

    def count_reads(self, stats: StreamStats) -> None:
        """Add the hits and misses of the whole-token ``forward`` steps since the last count to ``stats``
        (one readback: the host waits for those steps)."""
        if self._num_uncounted_steps and self.kind in (RESIDENT, ADDRESSED):
            self._count_token_reads(stats, self._num_uncounted_steps)
        self._num_uncounted_steps = 0

    def _checked(self, token: int) -> int:
        if not 0 <= token < self.model.spec.vocab_size:  # the argmax found no finite logit
            raise NonFiniteLogitsError(f"the device picked token id {token}, outside the vocabulary: the logits "
                                       "were not finite (NaN); check the model file, or decode with "
                                       "runtime.greedy_on_device = false")
        return token

    def _begin(self, tokens, position: int, drafts=None) -> None:
        """Upload and embed a step's tokens [R] (the first from the host and the rest from ``drafts``
        on the device, when given); at a request's first step, check the kept segments."""
        model, ops, spec, num_rows = self.model, self.model.ops, self.model.spec, self.num_rows
        if self._is_request_start:
            self._start_request()
        if len(tokens) != num_rows:
            raise ValueError(f"a step of {num_rows} rows got {len(tokens)} tokens")
        for token in tokens:
            if not 0 <= token < spec.vocab_size:  # the embedding reads the id on the device, unchecked
                raise ValueError(f"token id {token} is outside the vocabulary [0, {spec.vocab_size})")
        # tokens and positions go up by copies queued from pinned memory: the host does not wait; the
        # row is rewritten only at the next step, after the caller has read this step's result
        self._step_row[:num_rows] = tokens
        self._step_row[num_rows:] = np.arange(position, position + num_rows)
        ops.copy_in(self._inputs, self._step_row, is_queued=True)
        if drafts is None:
            ops.embed(model.token_embedding, self._token_id, out=self._x)
        else:  # ids an argmax wrote on the device: inside the vocabulary
            self._drafts_segment(drafts).replay()

    def _start_request(self) -> None:
        """Allocate the buffers (once), decide how experts are read (``kind``), and drop the segments
        of another kind; a whole token's tables are written again (the prefill may have moved experts)."""
        kind = self._kind_now()
        # only kept segments outlive a request (end_request resets the others)
        if self.is_kept and self.kind is not None and kind != self.kind:
            log.info("decode reads experts as %s, no longer as %s: its segments are captured per request from now on",
                     kind, self.kind)
            self.reset()  # what load kept no longer serves
        self._is_pool_trimmed = False
        if self._x is None:
            self._allocate()
        else:  # a launch that died between a count and its reset would name the wrong block last ever after
            self.model.ops.copy_in(self._route_counters, np.zeros(self.num_rows, np.int32))
        self.kind = kind
        self._tables.write(kind, self._owner)
        self._is_request_start = False

    def _kind_now(self) -> str:
        """How a step would read its experts with the cache as it is: all cached, read in place, or layer by layer."""
        spec = self.model.spec
        if self.model.cache.num_cached == spec.num_layers * spec.num_experts:
            return RESIDENT
        return ADDRESSED if self.is_reading_in_place else LAYERS

    def _count_token_reads(self, stats: StreamStats, num_steps: int) -> None:
        """Hits and misses of ``num_steps`` whole-token steps, once they have run (``TokenTables.count``)."""
        spec = self.model.spec
        num_pairs = num_steps * self.num_rows * spec.num_layers * spec.num_experts_used
        self._tables.count(self.kind, stats, num_pairs, lambda array: stats.waited(self._readback.now, array))

    @property
    def _owner(self) -> str:
        """Who is charged for segments and buffers: ``decode_graphs`` while kept, else the request's
        ``activations`` (a block lives until its last reference goes, which may be after the request)."""
        return DECODE_GRAPHS_OWNER if self.is_kept else ACTIVATIONS_OWNER

    def _capture(self, fn, owner: str):
        """ops.capture, after trimming the allocator cache once in the request: nothing pooled may
        be freed while capturing (a request that replays kept segments only does not trim)."""
        if not self._is_pool_trimmed:
            self.model.ops.trim_memory()
            self._is_pool_trimmed = True
        return self.model.ops.capture(fn, owner)

    def _drafts_segment(self, drafts, after_inputs=None):
        """The tokens after the first from ``drafts`` into the token buffer, and the step's tokens embedded
        (two launches as one segment: as two, the host's launch cost was the device's idle time between a
        draft and its verify step); after_inputs: a one-row step's inputs [2], whose token and position are
        this step's first, spread into its inputs first (``ops.spread_inputs``). Captured again for another
        buffer."""
        reads = (drafts,) if after_inputs is None else (drafts, after_inputs)
        refs, segment = self._drafts_in.get(after_inputs is not None, ((), None))
        if segment is None or any(ref() is not read for ref, read in zip(refs, reads)):
            if segment is not None:
                segment.close()
            num_rows, ops, table = self.num_rows, self.model.ops, self.model.token_embedding

            def record():
                if after_inputs is not None:
                    ops.spread_inputs(after_inputs, self._inputs)
                ops.copy_array(self._token_id[1:], drafts[:num_rows - 1])
                ops.embed(table, self._token_id, out=self._x)
                return ()
            segment = self._capture(record, self._owner)
            self._drafts_in[after_inputs is not None] = (tuple(weakref.ref(read) for read in reads), segment)
        return segment

    def _token_segments(self) -> list:
        """A whole token's layers (resident or addressed) as segments of TOKEN_PART_LAYERS layers, captured at
        their first use."""
        if not self._token_parts:
            num_layers, parts = self.model.spec.num_layers, []
            try:
                for first in range(0, num_layers, TOKEN_PART_LAYERS):
                    stop = min(first + TOKEN_PART_LAYERS, num_layers)
                    parts.append(self._capture(lambda first=first, stop=stop: self._whole_token(first, stop),
                                               self._owner))
            except BaseException:  # no token of some layers: the parts captured so far go
                for part in parts:
                    part.close()
                raise
            self._token_parts = parts
        return self._token_parts

    def _segment(self, index: int):
        """Segment 0: layer 0's attention and routing; segment l + 1: layer l's experts, then layer
        l + 1's attention and routing (none after the last layer). Segment l's outputs are layer l's
        routing (``_attention_and_route``)."""
        if index == len(self._segments):
            def record():
                if index > 0:
                    self._experts_of(index - 1)
                return self._attention_and_route(index) if index < self.model.spec.num_layers else ()
            self._segments.append(self._capture(record, self._owner))
        return self._segments[index]

    def _layers(self, stats: StreamStats) -> None:
        """Every layer of a step whose experts may miss: a segment a layer, the host between.

        After layer l's routing is read back, the host stages its misses, replays its experts and
        layer l+1's attention (one segment), and only then stages layer l+1's predicted experts, so
        that this staging overlaps the GPU's work instead of preceding it. No staging waits for the kernels:
        each follows a readback issued after every kernel that could read the slots it overwrites,
        except this layer's experts, whose slots it protects (``in_use``)."""
        model, ops, spec = self.model, self.model.ops, self.model.spec
        self._segment(0).replay()
        for layer in range(spec.num_layers):
            _, ids, _, predicted = self._segment(layer).outputs
            # [R, k] each, read at once after the segment and before anything queued makes the
            # default stream wait for copies
            host_ids, host_predicted = stats.waited(self._readback.now, ids, predicted)
            slot_of = model.decode_slots(layer, host_ids, stats, is_after_compute=False)  # [N]
            if self._prefetched is not None:  # this layer's experts staged ahead, maybe still in flight
                ticket, experts = self._prefetched
                ops.wait_staged(ticket)
                stats.prefetched_used += len(set(experts).intersection(host_ids.ravel().tolist()))
                self._prefetched = None
            # [R, k] pinned; its last copy ran before the wait above
            row = self._slot_rows[layer].reshape(host_ids.shape)
            row[:] = slot_of[host_ids]
            ops.copy_in(self._slot_ids, row, is_queued=True)  # behind the staged copies, host not waiting
            self._segment(layer + 1).replay()  # this layer's experts, then the next layer's attention
            if host_predicted is not None:  # behind this layer's misses on the copy stream, beside the kernels
                in_use = set(row.ravel().tolist())  # this layer's slots
                ticket, experts = model.prefetch(layer + 1, host_predicted, in_use, stats, is_after_compute=False)
                self._prefetched = (ticket, experts) if experts else None

    def compile_resident(self, token: int, position: int) -> None:
        """Run a resident token's launches once, uncaptured, over tables of no slots (every routed
        expert skipped), so a warm-up compiles the kernels only that path launches. Writes the KV
        of ``position``; the caller resets after."""
        ops, spec = self.model.ops, self.model.spec
        if self._x is None:
            self._allocate()
        self._tables.write_slots(np.full((spec.num_layers, spec.num_experts), -1, np.int32), self._owner)
        ops.embed(self.model.token_embedding, np.full(self.num_rows, token), out=self._x)
        ops.copy_in(self._positions, np.arange(position, position + self.num_rows, dtype=np.int32))
        kind, self.kind = self.kind, RESIDENT
        try:
            self._whole_token()
        finally:
            self.kind = kind

    def compile_greedy(self, head: tuple) -> None:
        """Run the greedy tail once, uncaptured, with a one-token bias, so a warm-up compiles its
        kernels. Needs a step run before it (the buffers); overwrites the residual stream and the
        token and position buffers; the caller resets after."""
        ops = self.model.ops
        bias = (ops.upload(ACTIVATIONS_OWNER, np.zeros(1, np.int32)),
                ops.upload(ACTIVATIONS_OWNER, np.zeros(1, np.float32)))
        self._greedy_tail(head, bias)
        ops.synchronize()
        for array in bias:
            ops.free(array)

    def end_request(self) -> None:
        """A request's decode is over: kept segments wait for the next one, others are dropped."""
        self._prefetched = None
        self._num_uncounted_steps = 0
        self._is_request_start = True
        self._tails.end_request()
        if not self.is_kept:
            self.reset()

    def reset(self) -> None:
        """Drop every segment and buffer (a later request captures again)."""
        self._close_layers()
        self._tails.close()
        self._tables.free()
        for array in (self._x, self._inputs, self._slot_ids, self._route_counters, *(self._attention_scratch or ())):
            if array is not None:
                self.model.ops.free(array)
        self._x = self._inputs = self._token_id = self._positions = self._slot_ids = self._route_counters = None
        self._attention_scratch = None
        self.kind = self._prefetched = None
        self._num_uncounted_steps = 0
        self.is_kept = False
        self._is_request_start = True

    def _close_layers(self) -> None:
        drafts_in = [segment for _, segment in self._drafts_in.values()]
        for segment in self._segments + self._token_parts + drafts_in:
            segment.close()
        self._segments, self._token_parts, self._drafts_in = [], [], {}

    def _greedy_tail(self, head: tuple, bias) -> tuple:
        """After a step's layers: pick the next token into the token buffer, step the position, and
        embed the token into the residual stream for the next step."""
        ops, model = self.model.ops, self.model
        norm, head_tensor, eps = head
        ops.greedy_token(self._x, norm, head_tensor, eps, bias, self._token_id)
        ops.increment(self._positions)
        ops.embed(model.token_embedding, self._token_id, out=self._x)
        return ()

    def _allocate(self) -> None:
        ops, spec = self.model.ops, self.model.spec
        owner, num_rows = self._owner, self.num_rows
        self._x = ops.alloc(owner, (num_rows, spec.hidden_size), np.float32)
        self._inputs = ops.alloc(owner, (2 * num_rows,), np.int32)
        self._token_id, self._positions = self._inputs[:num_rows], self._inputs[num_rows:]
        self._slot_ids = ops.alloc(owner, (num_rows, spec.num_experts_used), np.int32)
        self._route_counters = ops.upload(owner, np.zeros(num_rows, np.int32))
        self._attention_scratch = ops.decode_attention_scratch(owner, self.model.kv, spec.num_heads, num_rows)
        if self._slot_rows is None:  # kept across requests: a queued copy may still read them at a reset
            num_values = spec.num_layers * num_rows * spec.num_experts_used
            self._slot_rows = ops.host_buffer(4 * num_values).view(np.int32).reshape(spec.num_layers, -1)  # [L, R * k]
            self._step_row = ops.host_buffer(8 * num_rows).view(np.int32)  # [2R]: tokens, positions
            self._readback = ops.readback()

    def _attention_and_route(self, layer: int):
        """(h, ids, weights, predicted): predicted [R, k] is the next layer's router on this layer's
        stream (None for the last layer, or without prefetching)."""
        model, spec = self.model, self.model.spec
        # the position is read on the device
        model.attention_block(layer, self._x, self._positions, start=0, split_scratch=self._attention_scratch)
        h, ids, weights, _ = self._route(layer)
        predicted = None
        if self.is_prefetching and layer + 1 < spec.num_layers:
            _, predicted, _, _ = self._route(layer + 1)
        return h, ids, weights, predicted

    def _route(self, layer: int, slot_table=None):
        """(h [R, D], ids [R, k], weights [R, k], slots [R, k] or None): ``layer``'s norm and routing of the
        residual stream, the picks mapped through ``slot_table`` [N] when given (``ops.decode_route``)."""
        model, spec = self.model, self.model.spec
        return model.ops.decode_route(self._x, model.vector(layer, "ffn_norm"), spec.rms_norm_eps,
                                      model.matrix(layer, "ffn_gate_inp"), spec.num_experts_used,
                                      spec.is_expert_weights_normalized, self._route_counters, slot_table)

    def _experts_of(self, layer: int):
        model = self.model
        h, _, weights, _ = self._segments[layer].outputs
        cache = model.cache
        model.ops.moe(self._x, h, self._slot_ids, weights, cache.storage, None, cache.layout.at_layer(layer))

    def _whole_token(self, first: int = 0, stop: int | None = None):
        """Layers first .. stop - 1 (default: every layer) of a whole-token step."""
        model = self.model
        for layer in range(first, model.spec.num_layers if stop is None else stop):
            model.attention_block(layer, self._x, self._positions, start=0, split_scratch=self._attention_scratch)
            h, ids, weights, slots = self._route(layer, self._tables.slot_table(self.kind, layer))
            self._tables.moe(self.kind, layer, self._x, h, ids, weights, slots)
        return ()


def _launch(layers, tail, readback, token) -> int:
    """Replay a greedy step (the resident layers' segments, when given, then the tail) and queue its token's
    readback; the ticket for ``readback.read``."""
    for part in layers or ():
        part.replay()
    tail.replay()
    return readback.queue(token)
