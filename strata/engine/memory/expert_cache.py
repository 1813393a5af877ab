"""The elastic expert cache: expert slots over one reserved range, mapped in segments.

Slots are numbered in address order over the range (on the GPU: each plane of the packed layout is
its own range, slot ``i`` at the same index in every plane), so kernels address every resident
expert by its slot. Growth maps segments at the end; shrink unmaps them and evicts the experts
whose slots lie beyond the new end: no resident expert ever moves.

During prefill the prompt workspace (staging ring and activations) borrows the top slots of the
mapped range (``lend``), evicting what they held; ``min_cache_slots`` stay for cached experts.
After prefill the request's transaction puts the residency back (``CacheResidency``): what the
ring evicted is staged again into the same slots before the first decoded token.

At load the cache is filled from the expert pack (``fill``, ``runtime.expert_preload``), an equal
share of every layer. Policy: decode inserts every streamed expert (least recently used evicted);
prefill streams misses through the ring without inserting them, since one prompt chunk touches
nearly every expert of a layer once and would only churn the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from strata.backend.ops import ExpertLayout, Ops

if TYPE_CHECKING:
    from strata.engine.memory.expert_pack import ExpertPack

Key = tuple[int, int]  # (layer, expert)
_FILL_BATCH = 256  # experts per staging call when filling the cache


class ExpertCache:
    def __init__(self, ops: Ops, layout: ExpertLayout, *, segment_bytes: int, reserved_bytes: int,
                 base_bytes: int, min_cache_slots: int = 0, owner: str = "expert_cache",
                 max_slots: int | None = None):
        """max_slots: more are never mapped (every expert of the model and a full staging ring);
        the memory beyond stays free for prefill activations and decode's segments."""
        self.ops = ops
        self.layout = layout
        self.segment_bytes = segment_bytes
        self.min_cache_slots = min_cache_slots
        reserved = max(segment_bytes, reserved_bytes // segment_bytes * segment_bytes)
        self.storage = ops.arena(owner, reserved, segment_bytes, layout)
        self.segment_bytes = self.storage.segment_bytes  # what one segment costs on this backend
        self._max_bytes = self.storage.reserved_bytes
        if max_slots is not None:
            self._max_bytes = min(self._max_bytes, self.storage.segments_for(max_slots) * self.segment_bytes)
        self.storage.map_segments(min(self._max_bytes, base_bytes // self.segment_bytes * self.segment_bytes))
        self.base_bytes = self.storage.mapped_bytes
        self._lru: OrderedDict[Key, int] = OrderedDict()  # key → slot, least recently used first
        self._key_of: dict[int, Key] = {}
        self._free: set[int] = set(range(self.num_slots))
        self._lent_slots = 0
        self.num_evictions = 0

    # --- the elastic range (ElasticCache protocol) ----------------------------------------

    @property
    def mapped_bytes(self) -> int:
        return self.storage.mapped_bytes

    @property
    def num_slots(self) -> int:
        return self.storage.num_slots

    def borrowable_bytes(self, grown_bytes: int = 0) -> int:
        """What the prompt workspace may borrow now, or once ``grown_bytes`` more are mapped."""
        free_slots = self.slots_after_growth(grown_bytes) - self._lent_slots - self.min_cache_slots
        return max(0, free_slots) * self.layout.slot_bytes

    def segments_for(self, num_slots: int) -> int:
        """Segments that map at least ``num_slots`` slots (a segment's planes round up to the device's
        mapping granularity, so it may cost more than its slots)."""
        return self.storage.segments_for(num_slots)

    def slots_after_growth(self, grown_bytes: int) -> int:
        """The slots mapped once ``grown_bytes`` more are (whole segments)."""
        return self.storage.slots_in(self.mapped_bytes + grown_bytes // self.segment_bytes * self.segment_bytes)

    def growable_bytes(self, max_bytes: int) -> int:
        """What ``grow(max_bytes)`` would map: whole segments, within the reserved range."""
        room = self._max_bytes - self.mapped_bytes
        return max(0, min(room, max_bytes)) // self.segment_bytes * self.segment_bytes

    def grow(self, max_bytes: int) -> int:
        num_bytes = self.growable_bytes(max_bytes)
        if num_bytes > 0:
            before = self.num_slots
            self.storage.map_segments(num_bytes)
            self._free.update(range(before, self.num_slots))
        return num_bytes

    def shrink_to(self, num_bytes: int) -> None:
        if self._lent_slots:
            raise RuntimeError("the expert cache cannot shrink while the workspace borrows its slots")
        self.storage.unmap_to(num_bytes)
        num_slots = self.num_slots
        for slot in [s for s in self._key_of if s >= num_slots]:
            del self._lru[self._key_of.pop(slot)]
        self._free = {s for s in self._free if s < num_slots}

    def unmap_top(self, num_bytes: int) -> int:
        """Unmap whole segments from the top covering ``num_bytes`` (evicting their experts), so their
        memory is free for a prefill's activations; never into the ``min_cache_slots``. Returns the
        bytes unmapped, 0 when that many cannot be."""
        before = self.mapped_bytes
        target = before - -(-num_bytes // self.segment_bytes) * self.segment_bytes
        slots_after = target * self.num_slots // before if before and target > 0 else 0
        if target < 0 or self.num_slots - slots_after > self.borrowable_bytes() // self.layout.slot_bytes:
            return 0
        self.shrink_to(target)
        return before - self.mapped_bytes

    # --- lending to the prompt workspace ---------------------------------------------------

    def lend(self, num_bytes: int) -> tuple[int, int]:
        """Lend the top slots covering ``num_bytes``; returns (first slot, byte offset) of the range."""
        num_slots = -(-num_bytes // self.layout.slot_bytes)
        if num_slots * self.layout.slot_bytes > self.borrowable_bytes():
            raise ValueError("lend beyond the borrowable slots")
        self._lent_slots += num_slots
        first = self.num_slots - self._lent_slots
        for slot in range(first, first + num_slots):
            self._evict_slot(slot)
            self._free.discard(slot)
        return first, first * self.layout.slot_bytes

    def take_back(self) -> None:
        self._free.update(range(self.num_slots - self._lent_slots, self.num_slots))
        self._lent_slots = 0

    # --- the cache --------------------------------------------------------------------------

    def lookup(self, layer: int, expert: int) -> int:
        """The expert's slot (marked recently used), or -1."""
        slot = self._lru.get((layer, expert), -1)
        if slot >= 0:
            self._lru.move_to_end((layer, expert))
        return slot

    def insert(self, layer: int, expert: int, protected: set[int]) -> int:
        """A slot for the expert: a free one, else the least recently used outside ``protected``."""
        if self._free:
            slot = self._free.pop()
        else:
            for victim, slot in self._lru.items():  # a loop, not a generator: ~6 inserts a decode layer
                if slot not in protected:
                    break
            else:
                return -1
            del self._lru[victim], self._key_of[slot]
            self.num_evictions += 1
        self._lru[(layer, expert)] = slot
        self._key_of[slot] = (layer, expert)
        return slot

    def fill(self, pack: ExpertPack, num_layers: int, num_experts: int) -> int:
        """Stage experts from ``pack`` into the lowest free slots, expert-major (expert 0 of every
        layer, then expert 1, ...), so each layer holds an equal share; returns how many were staged."""
        keys = [(layer, e) for e in range(num_experts) for layer in range(num_layers) if (layer, e) not in self._lru]
        keys = keys[:len(self._free)]
        lowest = sorted(self._free)[:len(keys)]  # when every expert fits, the workspace borrows free top slots
        for key, slot in zip(keys, lowest):
            self._free.discard(slot)
            self._lru[key] = slot
            self._key_of[slot] = key
        self.stage_from(pack, list(zip(keys, lowest)))
        self.ops.synchronize()
        return len(keys)

    def stage_from(self, pack: ExpertPack, placed: list[tuple[Key, int]]) -> None:
        """Stage the experts of ``placed`` (already in the cache's tables) from ``pack`` into their
        slots, a batch a driver call. On a failure the slots not yet filled are forgotten, so no
        kernel computes with them."""
        for first in range(0, len(placed), _FILL_BATCH):
            batch = placed[first:first + _FILL_BATCH]
            try:
                self.ops.wait_staged(self.ops.stage_experts(self.storage, [slot for _, slot in batch],
                                                            [pack.slot(*key) for key, _ in batch]))
            except BaseException:
                self.forget([slot for _, slot in placed[first:]])
                raise

    def clear(self) -> None:
        """Forget every cached expert (the mapped range stays as it is)."""
        if self._lent_slots:
            raise RuntimeError("the expert cache cannot be cleared while the workspace borrows its slots")
        self._lru.clear()
        self._key_of.clear()
        self._free = set(range(self.num_slots))
        self.num_evictions = 0

    def forget(self, slots) -> None:
        """Drop the experts of ``slots`` (inserted, but their bytes never arrived): the slots are free again."""
        for slot in slots:
            self._evict_slot(slot)

    def slot_table(self, num_layers: int, num_experts: int) -> np.ndarray:
        """[L, N] int32 slot of every expert, -1 where it is not cached; reads without marking use."""
        table = np.full((num_layers, num_experts), -1, dtype=np.int32)
        for (layer, expert), slot in self._lru.items():
            table[layer, expert] = slot
        return table

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    # --- residency: the runtime state a prefill changes (``RuntimeState``) ---------------------

    def residency(self) -> tuple[tuple[Key, int], ...]:
        """Every cached expert and its slot, least recently used first."""
        return tuple(self._lru.items())

    def restore_residency(self, snapshot: tuple[tuple[Key, int], ...]) -> list[tuple[Key, int]]:
        """Hold exactly ``snapshot`` again, in its recency order: experts cached since it was taken
        are dropped, and experts evicted since go back to the slots they had. Returns those
        (key, slot) pairs: the caller stages their bytes. Needs no slot lent and the snapshot's mapped."""
        if self._lent_slots:
            raise RuntimeError("the expert cache cannot restore its residency while the workspace borrows its slots")
        wanted = dict(snapshot)
        beyond = [slot for slot in wanted.values() if slot >= self.num_slots]
        if beyond:
            raise RuntimeError(f"slot {beyond[0]} of the residency to restore is not mapped ({self.num_slots} slots)")
        for slot, key in list(self._key_of.items()):
            if wanted.get(key) != slot:
                self._evict_slot(slot)
        missing = [(key, slot) for key, slot in snapshot if key not in self._lru]
        for key, slot in missing:
            self._free.discard(slot)
            self._key_of[slot] = key
        self._lru = OrderedDict(snapshot)
        return missing

    def _evict_slot(self, slot: int) -> None:
        key = self._key_of.pop(slot, None)
        if key is not None:
            del self._lru[key]
            self._free.add(slot)


class CacheResidency:
    """The cache's residency as runtime state (``strata.engine.loan.runtime_state.Residency``): restoring
    stages the experts evicted since the snapshot from the expert pack, into their old slots."""

    def __init__(self, cache: ExpertCache, pack: ExpertPack | None):
        self.cache = cache
        self.pack = pack

    def snapshot(self) -> tuple[tuple[Key, int], ...]:
        return self.cache.residency()

    def restore(self, snapshot: tuple[tuple[Key, int], ...]) -> int:
        cache = self.cache
        missing = cache.restore_residency(snapshot)
        if missing and self.pack is None:
            cache.forget([slot for _, slot in missing])
            raise RuntimeError("the expert cache lost experts and has no expert pack to stage them from")
        cache.stage_from(self.pack, missing)
        return len(missing) * cache.layout.slot_bytes
