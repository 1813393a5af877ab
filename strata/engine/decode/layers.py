"""What a decode step needs of the model, layer by layer (``DecodeLayers``): the model runner
implements it, and ``DecodeStep`` sees the model only through it.

A step calls these while it captures its segments (the attention block, the layer's weights and
the model-wide state they share) and, between segments, on the host (``decode_slots`` and
``prefetch``, the expert cache's bookkeeping for a layer's routed ids).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from strata.backend.ops import Ops, QTensor
from strata.engine.memory.expert_cache import ExpertCache
from strata.engine.memory.expert_pack import ExpertPack
from strata.engine.stream_stats import StreamStats
from strata.model.spec import ModelSpec


class DecodeLayers(Protocol):
    """One layer's attention, weights and routed-expert slots, and the few model-wide things they share."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def ops(self) -> Ops: ...

    @property
    def kv(self) -> Any:
        """The KV cache (``Ops.kv_cache``) the attention blocks write and read."""

    @property
    def cache(self) -> ExpertCache | None:
        """The expert cache the routed experts' slots point into; decode is built only where there is one."""

    @property
    def pack(self) -> ExpertPack | None:
        """The pinned expert pack: where a miss is staged from, or read in place (``expert_addresses``)."""

    @property
    def token_embedding(self) -> QTensor:
        """[V, D] the table a step's token id is embedded from."""

    def attention_block(self, layer: int, x: Any, positions: Any, start: int, split_scratch: Any = None,
                        kv: Any = None, tensor: Any = None) -> None:
        """x += ``layer``'s attention of ``x``'s tokens at ``positions`` (KV written at ``start``..);
        ``split_scratch``: a decode token's attention scratch (``Ops.decode_attention_scratch``);
        ``kv`` and ``tensor(name)``: another block's one-layer cache and weights (the MTP block's)."""

    def matrix(self, layer: int, name: str) -> QTensor:
        """``layer``'s matrix ``name`` (``ffn_gate_inp``, ...)."""

    def vector(self, layer: int, name: str) -> Any:
        """``layer``'s float32 vector ``name`` (``ffn_norm``, ...) on the backend."""

    def decode_slots(self, layer: int, host_ids: np.ndarray, stats: StreamStats,
                     is_after_compute: bool = True) -> np.ndarray:
        """[N] slots of ``layer``'s routed experts ``host_ids`` [1, k]: misses are inserted into the
        cache and staged before the kernels issued next read them."""

    def prefetch(self, layer: int, host_ids: np.ndarray, in_use: set[int], stats: StreamStats,
                 is_after_compute: bool = True) -> tuple[Any, list[int]]:
        """Insert and stage ``layer``'s experts ``host_ids`` that are not cached, evicting outside the
        slots ``in_use``; the copies' ticket (None: nothing staged) and the experts staged."""
