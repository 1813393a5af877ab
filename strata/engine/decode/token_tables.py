"""What a whole-token decode step (graphs of whole layers, no host between them) reads its routed experts through.

``RESIDENT``: every expert is cached; [L, N] int32 slot tables map each layer's routed ids to slots on
the device (in the routing's launch, ``ops.decode_route``). ``ADDRESSED``: misses are read in place
(``expert_addresses.py``); [L, N, C] uint64 tables give every expert's plane addresses, a cache slot's or
the pinned pack's, and a [1] int32 counter adds the routed pairs read from host memory. Either is written
at a request's first step, into buffers made once and kept with the step's segments (the graph reads them
by address), and stays true to the request's end: nothing is staged while such a step decodes. ``LAYERS``
(a graph a layer, the host staging misses between) reads no table.
"""

from __future__ import annotations

import numpy as np

from strata.engine.decode.expert_addresses import address_tables
from strata.engine.decode.layers import DecodeLayers
from strata.engine.stream_stats import StreamStats

RESIDENT, ADDRESSED, LAYERS = "resident", "addressed", "layers"  # DecodeStep.kind


class TokenTables:
    def __init__(self, model: DecodeLayers):
        self.model = model
        self._slots = None  # [L, N] int32 slot of every expert (RESIDENT)
        self._addresses = None  # [L, N, C] uint64 plane addresses of every expert (ADDRESSED)
        self._host_reads = None  # [1] int32 routed pairs read from host memory since the last count

    def write(self, kind: str, owner: str) -> None:
        """The tables of ``kind`` as the cache holds the experts now (buffers charged to ``owner``, made once)."""
        spec, cache = self.model.spec, self.model.cache
        if kind == RESIDENT:
            self.write_slots(cache.slot_table(spec.num_layers, spec.num_experts), owner)
        elif kind == ADDRESSED:
            self._addresses = self._written(self._addresses, address_tables(self.model), owner)
            self._host_reads = self._written(self._host_reads, np.zeros(1, np.int32), owner)

    def write_slots(self, slots: np.ndarray, owner: str) -> None:
        """[L, N] slot of every expert (-1: none), as ``RESIDENT`` reads them."""
        self._slots = self._written(self._slots, slots, owner)

    def slot_table(self, kind: str, layer: int):
        """[N] the slot of each of ``layer``'s experts on the device (``RESIDENT``), which routing maps its picks
        through (``ops.decode_route``); None for the other kinds."""
        return self._slots[layer] if kind == RESIDENT else None

    def moe(self, kind: str, layer: int, x, h, ids, weights, slots) -> None:
        """Inside the token's graph: x += layer ``layer``'s routed experts ``ids`` [R, k] (expert ids on the
        device), read where they lie (``ADDRESSED``) or from their cache ``slots`` [R, k] (``RESIDENT``: the
        routing mapped them through ``slot_table``)."""
        ops, cache = self.model.ops, self.model.cache
        layout = cache.layout.at_layer(layer)
        if kind == ADDRESSED:
            ops.moe_addressed(x, h, ids, weights, self._addresses[layer], cache.storage, layout, self._host_reads)
        else:
            ops.moe(x, h, slots, weights, cache.storage, None, layout)

    def count(self, kind: str, stats: StreamStats, num_pairs: int, read_now) -> None:
        """Hits and misses of ``num_pairs`` routed pairs once their steps have run: all hits, but the pairs
        read from host memory (the device's count, read with ``read_now`` and zeroed)."""
        num_host = 0
        if kind == ADDRESSED:
            (count,) = read_now(self._host_reads)
            num_host = int(count[0])
            self.model.ops.copy_in(self._host_reads, np.zeros(1, np.int32))
            stats.streamed_bytes += num_host * self.model.cache.layout.slot_bytes
        stats.hits += num_pairs - num_host
        stats.misses += num_host

    def free(self) -> None:
        for array in (self._slots, self._addresses, self._host_reads):
            if array is not None:
                self.model.ops.free(array)
        self._slots = self._addresses = self._host_reads = None

    def _written(self, buffer, host: np.ndarray, owner: str):
        """``host`` in ``buffer`` (made on first use, charged to ``owner``): the same device address every time."""
        if buffer is None:
            return self.model.ops.upload(owner, host)
        self.model.ops.copy_in(buffer, host)
        return buffer
