"""A decode token as captured segments: two per layer, recorded at a request's first token and
replayed for every token after it.

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
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._x = None  # [1, D] the residual stream
        self._positions = None  # [1] int32
        self._slot_ids = None  # [1, k] int32
        self._slot_rows = None  # [L, k] int32 in pinned host memory: each layer's slot ids, queued copies
        self._attention: list = []
        self._experts: list = []

    def forward(self, token: int, position: int, stats: StreamStats):
        """Hidden state [1, D] of ``token`` at ``position`` (before the output norm); appends its KV."""
        runner, ops, spec = self.runner, self.runner.ops, self.runner.spec
        if self._x is None:  # a request's first token: nothing pooled may be freed while capturing
            ops.trim_memory()
            self._allocate()
        ops.embed(runner.w.matrices["token_embd"], np.array([token]), out=self._x)
        ops.copy_in(self._positions, np.array([position], dtype=np.int32))
        for layer in range(spec.num_layers):
            if layer == len(self._attention):
                self._attention.append(ops.capture(lambda layer=layer: self._attention_and_route(layer)))
            self._attention[layer].replay()
            _, ids, _ = self._attention[layer].outputs
            host_ids = ops.to_host(ids)  # [1, k]: waits for the segment
            slot_of = runner.decode_slots(layer, host_ids, stats)  # [N]
            row = self._slot_rows[layer:layer + 1]  # [1, k] pinned; its last copy ran before the wait above
            row[:] = slot_of[host_ids]
            ops.copy_in(self._slot_ids, row, is_queued=True)  # behind the staged copies, host not waiting
            if layer == len(self._experts):
                self._experts.append(ops.capture(lambda layer=layer: self._experts_of(layer)))
            self._experts[layer].replay()
        return self._x

    def reset(self) -> None:
        """Drop the segments and their buffers."""
        for segment in self._attention + self._experts:
            segment.close()
        self._attention, self._experts = [], []
        for array in (self._x, self._positions, self._slot_ids):
            if array is not None:
                self.runner.ops.free(array)
        self._x = self._positions = self._slot_ids = self._slot_rows = None

    def _allocate(self) -> None:
        ops, spec = self.runner.ops, self.runner.spec
        self._x = ops.alloc(ACTIVATIONS_OWNER, (1, spec.hidden_size), np.float32)
        self._positions = ops.alloc(ACTIVATIONS_OWNER, (1,), np.int32)
        self._slot_ids = ops.alloc(ACTIVATIONS_OWNER, (1, spec.num_experts_used), np.int32)
        num_values = spec.num_layers * spec.num_experts_used
        self._slot_rows = ops.host_buffer(4 * num_values).view(np.int32).reshape(spec.num_layers, -1)  # [L, k]

    def _attention_and_route(self, layer: int):
        runner, ops, spec = self.runner, self.runner.ops, self.runner.spec
        runner.attention_block(layer, self._x, self._positions, start=0)  # the position is read on the device
        h = ops.rms_norm(self._x, runner.vector(layer, "ffn_norm"), spec.rms_norm_eps)  # [1, D]
        ids, weights = ops.route(h, runner.matrix(layer, "ffn_gate_inp"), spec.num_experts_used,
                                 spec.is_expert_weights_normalized)  # [1, k]
        return h, ids, weights

    def _experts_of(self, layer: int):
        runner = self.runner
        h, _, weights = self._attention[layer].outputs
        cache = runner.cache
        runner.ops.moe(self._x, h, self._slot_ids, weights, cache.storage, None, cache.layout)
        return ()
