"""The MTP (nextn) block on the backend: it drafts the token after next from the main model's hidden state.

At position i it takes the main model's hidden state h_i (before the output norm) and the token
x_{i+1} that follows, and predicts x_{i+2} (the NumPy reference's ``mtp_forward``):

    x = eh_proj [rms_norm(embed(x_{i+1}), enorm); rms_norm(h_i, hnorm)]      # [R, 2D] -> [R, D]
    x = decoder_layer(x)             # its own attention (a one-layer KV cache of its own) and experts
    logits = head(rms_norm(x))       # its shared head, or the model's output norm and head

A draft chain feeds each step's output x back as the next step's h (the verified rows of a step
go through the block together first, so its cache holds the main model's states where it has them).
Prefill writes the block's cache over each chunk too (``cache_prompt``: the keys and values its
attention would write, nothing after them), so drafts attend over the prompt. The tensors that pass
reads (its input projection and norms, Q, K, V: ``loading.mtp_prompt_sources``) stay resident, so it
runs under a loan as well; a block with an embedding table of its own keeps them in the loan's
resource, and a loan that holds the block during prefill (``loan_mtp``) then leaves its cache with
what earlier requests left at the prompt's positions, which costs acceptance, never correctness.
Its other weights are two loan resources, ``mtp_draft_head`` (dense) and ``mtp_experts`` (every
routed expert in a slot of their own arena); a request reads them only after the loan has put them back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from strata.engine.memory.decode_resources import ExpertsResource, TensorsResource
from strata.engine.stream_stats import StreamStats
from strata.errors import EngineError


class MtpDraft:
    def __init__(self, runner, weights: TensorsResource, experts: ExpertsResource | None, kv,
                 output_head: Callable[[], tuple], prompt_weights: TensorsResource | None = None):
        """runner: the ``ModelRunner`` (ops, spec, rope, the attention block); kv: the block's own
        one-layer cache; output_head(): (norm, head, eps) of the main model, the fallback head;
        prompt_weights: the tensors ``cache_prompt`` reads, resident outside the loan (or None: in ``weights``)."""
        self.runner = runner
        self.ops = runner.ops
        self.spec = runner.spec
        self.layer = self.spec.num_layers  # the first nextn block follows the main layers
        self.weights = weights  # the dense tensors (``mtp_draft_head``)
        self.experts = experts
        self.kv = kv
        self._output_head = output_head
        self.prompt_weights = prompt_weights

    @property
    def is_resident(self) -> bool:
        """Whether the block's weights are on the device (a loan may hold them during prefill)."""
        return self.weights.is_resident and (self.experts is None or self.experts.is_resident)

    @property
    def can_cache_prompt(self) -> bool:
        """Whether ``cache_prompt`` can run now: its tensors kept resident outside the loan, or the block resident."""
        return self.prompt_weights is not None or self.is_resident

    def tensor(self, name: str) -> Any:
        """The block's weight by its short name (``attn_q``, ``nextn.eh_proj``); None when absent."""
        full_name = f"blk.{self.layer}.{name}.weight"
        if self.prompt_weights is not None and full_name in self.prompt_weights.sources:
            return self.prompt_weights.tensors[full_name]
        if full_name not in self.weights.sources:
            return None
        if not self.is_resident:
            raise EngineError("the MTP block is not resident: a loan still holds it (the request must draft "
                              "only after the loan restores)")
        return self.weights.tensors.get(full_name)

    def cache_prompt(self, hidden, next_tokens, start: int) -> None:
        """The block's cache at positions ``start``.. for main-model states ``hidden`` [R, D] and the token after
        each, as ``hidden`` writes it, without the rest of the block (its attention's output, its experts): a
        prompt's rows, whose block output no draft reads."""
        positions = self.ops.positions(start, len(next_tokens))
        self.runner.write_kv(self.layer, self._input(hidden, next_tokens), positions, start, kv=self.kv,
                             tensor=self.tensor)

    def _input(self, hidden, next_tokens):
        """The block's input rows [R, D]: eh_proj of the normed embeddings of ``next_tokens`` beside the normed
        ``hidden`` [R, D]."""
        ops, eps = self.ops, self.spec.rms_norm_eps
        table = self.tensor("nextn.embed_tokens")
        if isinstance(next_tokens, (list, np.ndarray)):
            next_tokens = np.asarray(next_tokens, dtype=np.int64)
        embedded = ops.embed(self.runner.token_embedding if table is None else table, next_tokens)  # [R, D]
        joined = ops.concat_columns(ops.rms_norm(embedded, self.tensor("nextn.enorm"), eps),
                                    ops.rms_norm(hidden, self.tensor("nextn.hnorm"), eps))  # [R, 2D]
        return ops.matmul(joined, self.tensor("nextn.eh_proj"))

    def hidden(self, hidden, next_tokens, start: int, positions=None) -> Any:
        """The block's output [R, D] for main-model (or chained) states ``hidden`` [R, D] at positions
        ``start``.. and the token after each, ``next_tokens`` [R]; writes its cache at those positions.
        A captured step passes its device buffers: ``next_tokens`` int32 and ``positions`` [R]."""
        if not self.is_resident:  # before anything is written: part of the block stays resident outside the loan
            raise EngineError("the MTP block is not resident: a loan still holds it (the request must draft "
                              "only after the loan restores)")
        ops, spec, eps = self.ops, self.spec, self.spec.rms_norm_eps
        x = self._input(hidden, next_tokens)  # [R, D]
        positions = ops.positions(start, len(next_tokens)) if positions is None else positions
        self.runner.attention_block(self.layer, x, positions, start, kv=self.kv, tensor=self.tensor)
        h = ops.rms_norm(x, self.tensor("ffn_norm"), eps)  # [R, D]
        if not spec.is_moe:
            ops.add(x, ops.ffn(h, self.tensor("ffn_gate"), self.tensor("ffn_up"), self.tensor("ffn_down")))
            return x
        ids, weights = ops.route(h, self.tensor("ffn_gate_inp"), spec.num_experts_used,
                                 spec.is_expert_weights_normalized)  # [R, k]
        acc = ops.moe_accumulator(x)
        experts = self.experts
        ops.moe(acc, h, ids, weights, experts.storage, experts.slot_table, experts.layout)
        if spec.shared_expert_ffn_size:
            shared = ops.ffn(h, self.tensor("ffn_gate_shexp"), self.tensor("ffn_up_shexp"),
                             self.tensor("ffn_down_shexp"))
            ops.shared_expert_add(acc, shared, h, self.tensor("ffn_gate_inp_shexp"))
        ops.add(x, acc)
        return x

    def head(self) -> tuple:
        """(norm, head, eps) the block's drafts come from: its shared head, or the model's."""
        norm, head, eps = self._output_head()
        own_norm, own_head = self.tensor("nextn.shared_head_norm"), self.tensor("nextn.shared_head_head")
        return norm if own_norm is None else own_norm, head if own_head is None else own_head, eps

    def logits(self, x) -> np.ndarray:
        """Host logits [V] of the last row of the block's output ``x``."""
        return self.ops.logits(x, *self.head())

    def draft(self, hidden, next_tokens: np.ndarray, start: int, depth: int,
              pick: Callable[[int, np.ndarray], int], stats: StreamStats) -> list[int]:
        """``depth`` draft tokens after the rows ``hidden`` [R, D] at positions ``start``.. whose
        next tokens are ``next_tokens`` [R] (the last row: the newest verified position).
        pick(j, logits [V]) turns the j-th draft's logits into its token."""
        x = self.hidden(hidden, next_tokens, start)
        position = start + len(next_tokens) - 1
        drafts: list[int] = []
        for j in range(depth):
            x = x[x.shape[0] - 1:]  # [1, D]
            drafts.append(pick(j, self.logits(x)))
            if j + 1 < depth:
                position += 1
                x = self.hidden(x, np.array(drafts[-1:]), position)
        stats.spec_draft_steps += depth
        return drafts
