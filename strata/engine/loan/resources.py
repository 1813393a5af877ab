"""Decode-only GPU resources the loan may release, and the elastic expert cache it grows.

A resource knows its size, can give its memory back to the ledger (``release``) and can take it
again and re-upload its contents from the host copy (``restore``). Both are atomic: on an
exception nothing changed. The engine owns the real ones (output head, verifier arena, MTP draft
head and routed experts); tests use fakes with the same shape.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Resource(Protocol):
    name: str
    num_bytes: int

    @property
    def is_resident(self) -> bool: ...

    def release(self) -> None:
        """Free the device memory; charges leave the ledger. A no-op when not resident."""

    def restore(self) -> None:
        """Allocate again and re-upload from the host copy. A no-op when resident."""


@runtime_checkable
class ElasticCache(Protocol):
    """The expert cache that grows into released memory during a loan and shrinks back after.

    ``base_bytes`` is the size it returns to; growth and shrink move whole segments and never move
    a resident expert that stays mapped.
    """

    @property
    def mapped_bytes(self) -> int: ...

    @property
    def base_bytes(self) -> int: ...

    @property
    def num_slots(self) -> int:
        """Expert slots mapped now."""

    @property
    def num_cached(self) -> int:
        """Experts resident in the cache now."""

    @property
    def segment_bytes(self) -> int:
        """What one segment maps: growth and shrink move whole ones."""

    def borrowable_bytes(self, grown_bytes: int = 0) -> int:
        """Cache storage the prompt workspace may borrow during prefill, now or once ``grown_bytes``
        more are mapped."""

    def growable_bytes(self, max_bytes: int) -> int:
        """What ``grow(max_bytes)`` would map."""

    def slots_after_growth(self, grown_bytes: int) -> int:
        """``num_slots`` once ``grown_bytes`` more are mapped."""

    def segments_for(self, num_slots: int) -> int:
        """Segments that map at least ``num_slots`` slots."""

    def grow(self, max_bytes: int) -> int:
        """Map up to ``max_bytes`` more (whole segments); return the bytes mapped."""

    def shrink_to(self, num_bytes: int) -> None:
        """Unmap segments (evicting their experts) down to ``num_bytes``."""
