"""The staging ring of one prefill chunk: experts that are not cached stream through it in batches.

The ring's slots are split into two halves that batches use in turn, so that batch b+1 is copied
into one half while the kernels of batch b read the other (one half, no overlap, when the ring
has a single slot). Batches are staged in queue order, at most one half ahead of the kernels:

    stage(0) stage(1) | wait(0) kernels(0) stage(2) | wait(1) kernels(1) stage(3) | ...

``stage`` is ordered after every kernel issued before it, so a half is overwritten only once the
kernels of the batch before (the last to read it) are done; ``wait`` orders the kernels after
their batch's copies. The queue may run across layers: the first batch of layer l+1 is copied
while layer l computes.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from strata.backend.ops import ArenaStorage, Ops
from strata.engine.memory.expert_pack import ExpertPack


@dataclasses.dataclass
class RingBatch:
    layer: int
    experts: list[int]  # streamed, in ring-slot order
    slots: list[int]  # the ring slot of each
    table: Any = None  # [N] slot of each expert of the batch, -1 elsewhere (host, or a row of slot_tables)
    ticket: Any = None


class StagingRing:
    def __init__(self, ops: Ops, storage: ArenaStorage, pack: ExpertPack, first_slot: int, num_slots: int):
        self.ops = ops
        self.storage = storage
        self.pack = pack
        self.num_halves = 2 if num_slots >= 2 else 1
        self.slots_per_batch = num_slots // self.num_halves
        self.first_slot = first_slot
        self._num_planned = 0
        self._queued: deque[RingBatch] = deque()
        self._staged: deque[RingBatch] = deque()  # copies issued, kernels not yet

    def plan(self, layer: int, experts: list[int], num_experts: int) -> list[RingBatch]:
        """Split ``experts`` into batches over alternate halves (tables on the host)."""
        batches = []
        for first in range(0, len(experts), self.slots_per_batch):
            half = self._num_planned % self.num_halves
            self._num_planned += 1
            chunk = experts[first:first + self.slots_per_batch]
            base = self.first_slot + half * self.slots_per_batch
            slots = list(range(base, base + len(chunk)))
            table = np.full(num_experts, -1, dtype=np.int32)
            table[chunk] = slots
            batches.append(RingBatch(layer, chunk, slots, table))
        return batches

    def enqueue(self, batches: list[RingBatch]) -> None:
        self._queued.extend(batches)
        self._fill()

    def take(self, layer: int, waits: list | None = None) -> Iterator[RingBatch]:
        """The batches of ``layer``, each once its copies are ordered before what the caller issues
        next; the caller issues the kernels that read it before asking for the next one. waits: where
        each wait's timing marks go, (before, after), when given."""
        while self._staged and self._staged[0].layer == layer:
            batch = self._staged.popleft()
            before = self.ops.timing_mark() if waits is not None else None
            self.ops.wait_staged(batch.ticket)
            if waits is not None:
                waits.append((before, self.ops.timing_mark()))
            yield batch
            self._fill()

    def _fill(self) -> None:
        while self._queued and len(self._staged) < self.num_halves:
            batch = self._queued.popleft()
            hosts = [self.pack.slot(batch.layer, expert) for expert in batch.experts]
            batch.ticket = self.ops.stage_experts(self.storage, batch.slots, hosts)
            self._staged.append(batch)
