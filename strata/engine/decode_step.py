"""A decode token as captured segments: two per layer (one for the whole token when every expert
is cached), recorded at a request's first token and replayed for every token after it.

Per layer l (the same sums as ``ModelRunner.forward`` with one token):

    segment A_l:  x += attention block;  h = rms_norm(x);  ids, w = route(h)        (captured)
    host:         ids → slots: hits looked up, misses inserted and staged (copy stream, events)
    segment B_l:  x += sum_k w * expert_slot_k(h)                                     (captured)

The host must see the routing before it can stage the misses, so a layer cannot be one graph; it
is two, and everything between them is the host's cache bookkeeping and one small upload of
[1, k] slot ids. A segment's inputs are buffers of this object (x, the position, the slot ids),
refreshed before the replay; its kernels read the position on the device (``ops.attention`` at
one token), so one capture serves every position. Segments hold their memory until ``reset``,
which the engine calls when a request ends (the expert storage or the KV cache may move between
requests; within one they do not).

Prefetch (``is_prefetching``): segment A_l also runs layer l+1's router on layer l's stream (its
input differs from the real one only by this layer's experts and the next attention, so in deep
layers it mostly picks the same experts); the host stages the predicted misses right behind this
layer's, and they copy while layer l's experts and layer l+1's attention compute. A prediction
changes which experts are cached, never what is computed.

When the cache holds every expert of every layer at a request's first token (a budget the whole
model fits in), nothing can miss: the slots of all experts go to the device once as [L, N] tables,
each layer maps its routed ids through its table on the device, and the whole token is one graph
with no host round trip (``is_resident``). Nothing is inserted or evicted during decode, so the
tables stay true until the request ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strata.gpu.ledger import ACTIVATIONS_OWNER

if TYPE_CHECKING:
    from strata.engine.runner import ModelRunner, StreamStats


def can_use_segments(runner: ModelRunner) -> bool:
    """Graph decode covers MoE layers without a shared expert (Qwen3-MoE); others run plain launches."""
    spec = runner.spec
    return bool(getattr(runner.ops, "can_capture", False)) and spec.is_moe and not spec.shared_expert_ffn_size \
        and runner.cache is not None


class DecodeStep:
    def __init__(self, runner: ModelRunner, is_prefetching: bool = False):
        self.runner = runner
        self.is_prefetching = is_prefetching
        self._x = None  # [1, D] the residual stream
        self._token_id = None  # [1] int32
        self._positions = None  # [1] int32
        self._step_row = None  # [2] int32 in pinned host memory: the token and position, queued copies
        self._slot_ids = None  # [1, k] int32
        self._slot_rows = None  # [L, k] int32 in pinned host memory: each layer's slot ids, queued copies
        self._attention: list = []
        self._experts: list = []
        self.is_resident: bool | None = None  # decided at a request's first token
        self._prefetched = None  # the copies of the next layer's predicted experts
        self._tables = None  # [L, N] int32 slot of every expert (resident)
        self._token = None  # the whole token as one segment (resident)

    def forward(self, token: int, position: int, stats: StreamStats):
        """Hidden state [1, D] of ``token`` at ``position`` (before the output norm); appends its KV."""
        runner, ops, spec = self.runner, self.runner.ops, self.runner.spec
        if self._x is None:  # a request's first token: nothing pooled may be freed while capturing
            ops.trim_memory()
            self._allocate()
            self.is_resident = runner.cache.num_cached == spec.num_layers * spec.num_experts
        if not 0 <= token < spec.vocab_size:  # the embedding reads the id on the device, unchecked
            raise ValueError(f"token id {token} is outside the vocabulary [0, {spec.vocab_size})")
        # token and position go up by copies queued from pinned memory: the host does not wait; the
        # row is rewritten only at the next token, after the caller has read this token's logits
        self._step_row[:] = (token, position)
        ops.copy_in(self._token_id, self._step_row[:1], is_queued=True)
        ops.copy_in(self._positions, self._step_row[1:], is_queued=True)
        ops.embed(runner.w.matrices["token_embd"], self._token_id, out=self._x)
        if self.is_resident:
            if self._token is None:
                cache = runner.cache
                self._tables = ops.slot_tables(np.array([[cache.lookup(layer, e) for e in range(spec.num_experts)]
                                                         for layer in range(spec.num_layers)], dtype=np.int32))
                self._token = ops.capture(self._resident_token)
            self._token.replay()
            stats.hits += spec.num_layers * spec.num_experts_used  # one token's top-k ids are distinct
            return self._x
        for layer in range(spec.num_layers):
            if layer == len(self._attention):
                self._attention.append(ops.capture(lambda layer=layer: self._attention_and_route(layer)))
            self._attention[layer].replay()
            _, ids, _, predicted = self._attention[layer].outputs
            host_ids = ops.to_host(ids)  # [1, k]: waits for the segment
            # read before anything queued makes the default stream wait for copies
            host_predicted = ops.to_host(predicted) if predicted is not None else None
            slot_of = runner.decode_slots(layer, host_ids, stats)  # [N]
            if self._prefetched is not None:  # this layer's experts staged ahead, maybe still in flight
                ops.wait_staged(self._prefetched)
                self._prefetched = None
            if host_predicted is not None:  # behind this layer's misses on the copy stream, beside its kernels
                in_use = {int(s) for s in slot_of[host_ids[0]]}
                self._prefetched = runner.prefetch(layer + 1, host_predicted, in_use, stats)
            row = self._slot_rows[layer:layer + 1]  # [1, k] pinned; its last copy ran before the wait above
            row[:] = slot_of[host_ids]
            ops.copy_in(self._slot_ids, row, is_queued=True)  # behind the staged copies, host not waiting
            if layer == len(self._experts):
                self._experts.append(ops.capture(lambda layer=layer: self._experts_of(layer)))
            self._experts[layer].replay()
        return self._x

    def compile_resident(self, token: int, position: int) -> None:
        """Run a resident token's launches once, uncaptured, over tables of no slots (every routed
        expert skipped), so a warm-up compiles the kernels only that path launches. Writes the KV
        of ``position``; the caller resets the request after."""
        ops, spec = self.runner.ops, self.runner.spec
        if self._x is None:
            self._allocate()
        self._tables = ops.slot_tables(np.full((spec.num_layers, spec.num_experts), -1, dtype=np.int32))
        ops.embed(self.runner.w.matrices["token_embd"], np.array([token]), out=self._x)
        ops.copy_in(self._positions, np.array([position], dtype=np.int32))
        self._resident_token()

    def reset(self) -> None:
        """Drop the segments and their buffers."""
        for segment in self._attention + self._experts + ([self._token] if self._token else []):
            segment.close()
        self._attention, self._experts, self._token = [], [], None
        for array in (self._x, self._token_id, self._positions, self._slot_ids, self._tables):
            if array is not None:
                self.runner.ops.free(array)
        self._x = self._token_id = self._positions = self._slot_ids = self._tables = None
        self.is_resident = self._prefetched = None

    def _allocate(self) -> None:
        ops, spec = self.runner.ops, self.runner.spec
        self._x = ops.alloc(ACTIVATIONS_OWNER, (1, spec.hidden_size), np.float32)
        self._token_id = ops.alloc(ACTIVATIONS_OWNER, (1,), np.int32)
        self._positions = ops.alloc(ACTIVATIONS_OWNER, (1,), np.int32)
        self._slot_ids = ops.alloc(ACTIVATIONS_OWNER, (1, spec.num_experts_used), np.int32)
        if self._slot_rows is None:  # kept across requests: a queued copy may still read them at a reset
            num_values = spec.num_layers * spec.num_experts_used
            self._slot_rows = ops.host_buffer(4 * num_values).view(np.int32).reshape(spec.num_layers, -1)  # [L, k]
            self._step_row = ops.host_buffer(8).view(np.int32)  # [2]: token, position

    def _attention_and_route(self, layer: int):
        """(h, ids, weights, predicted): predicted [1, k] is the next layer's router on this layer's
        stream (None for the last layer, or without prefetching)."""
        runner, spec = self.runner, self.runner.spec
        runner.attention_block(layer, self._x, self._positions, start=0)  # the position is read on the device
        h, ids, weights = self._route(layer)
        predicted = None
        if self.is_prefetching and layer + 1 < spec.num_layers:
            _, predicted, _ = self._route(layer + 1)
        return h, ids, weights, predicted

    def _route(self, layer: int):
        runner, ops, spec = self.runner, self.runner.ops, self.runner.spec
        h = ops.rms_norm(self._x, runner.vector(layer, "ffn_norm"), spec.rms_norm_eps)  # [1, D]
        ids, weights = ops.route(h, runner.matrix(layer, "ffn_gate_inp"), spec.num_experts_used,
                                 spec.is_expert_weights_normalized)  # [1, k]
        return h, ids, weights

    def _experts_of(self, layer: int):
        runner = self.runner
        h, _, weights, _ = self._attention[layer].outputs
        cache = runner.cache
        runner.ops.moe(self._x, h, self._slot_ids, weights, cache.storage, None, cache.layout)
        return ()

    def _resident_token(self):
        runner, ops = self.runner, self.runner.ops
        cache = runner.cache
        for layer in range(runner.spec.num_layers):
            runner.attention_block(layer, self._x, self._positions, start=0)
            h, ids, weights = self._route(layer)
            # the routed ids go through the layer's table to slots on the device
            ops.moe(self._x, h, ids, weights, cache.storage, self._tables[layer], cache.layout)
        return ()
