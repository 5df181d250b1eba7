"""The eviction policy interface every cache tier uses.

A tier owns the data; its policy only orders keys. The tier calls
``insert`` when it stores an entry, ``touch`` on every hit, ``remove`` when
it deletes an entry for its own reasons (TTL, clear, corruption), and
``evict`` when it needs room: the policy picks a victim, forgets it and
returns its key, and the tier deletes the data. Pinned entries (in use, or
being read) are never chosen.

Subclasses implement the ``_on_*`` and ``_choose_victim`` hooks; this base
class does the bookkeeping and argument checks so every policy, built-in or
from a plugin, behaves the same at the edges. Each hook must run in O(1) or
amortised O(log n).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator

Key = Hashable


class EvictionPolicy(ABC):
    """Orders cache entries for eviction.

    Args:
        capacity: how much the owning tier holds, in the units of the sizes
            passed to ``insert`` (blocks, entries or bytes). Adaptive policies
            use it to size their history; simple ones ignore it.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._sizes: dict[Key, int] = {}
        self._pinned: set[Key] = set()
        self._total_size = 0

    # ---- public interface -------------------------------------------------

    def insert(self, key: Key, size: int = 1) -> None:
        """Start tracking ``key`` with ``size`` units; re-inserting a tracked
        key updates its size and counts as a use."""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if key in self._sizes:
            old = self._sizes[key]
            if size != old:
                self._on_resize(key, old, size)
                self._total_size += size - old
                self._sizes[key] = size
            self.touch(key)
            return
        self._sizes[key] = size
        self._total_size += size
        self._on_insert(key, size)

    def touch(self, key: Key) -> None:
        """Record a use (a cache hit) of a tracked key."""
        self._require(key)
        self._on_touch(key, key in self._pinned)

    def remove(self, key: Key) -> None:
        """Stop tracking ``key`` (deleted by the owner, not evicted)."""
        self._require(key)
        pinned = key in self._pinned
        self._on_remove(key, pinned)
        self._pinned.discard(key)
        self._total_size -= self._sizes.pop(key)

    def evict(self) -> Key | None:
        """Choose a victim among unpinned keys, stop tracking it and return it.

        Returns ``None`` when every tracked key is pinned or none is tracked.
        """
        if len(self._pinned) == len(self._sizes):
            return None
        key = self._choose_victim()
        self._total_size -= self._sizes.pop(key)
        return key

    def pin(self, key: Key) -> None:
        """Make ``key`` ineligible for eviction until ``unpin``."""
        self._require(key)
        if key not in self._pinned:
            self._pinned.add(key)
            self._on_pin(key)

    def unpin(self, key: Key) -> None:
        """Make ``key`` evictable again; unpinning counts as its latest use."""
        self._require(key)
        if key in self._pinned:
            self._pinned.discard(key)
            self._on_unpin(key)

    def is_pinned(self, key: Key) -> bool:
        return key in self._pinned

    def size_of(self, key: Key) -> int:
        self._require(key)
        return self._sizes[key]

    @property
    def total_size(self) -> int:
        """Sum of the sizes of tracked keys, pinned included."""
        return self._total_size

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._sizes)

    def _require(self, key: Key) -> None:
        if key not in self._sizes:
            raise KeyError(key)

    # ---- what a policy implements ----------------------------------------

    @abstractmethod
    def _on_insert(self, key: Key, size: int) -> None:
        """A new, unpinned key was added."""

    def _on_resize(self, key: Key, old_size: int, new_size: int) -> None:
        """A tracked key's size is changing (before ``_sizes`` is updated).

        Policies that keep their own size totals adjust them here."""

    @abstractmethod
    def _on_touch(self, key: Key, pinned: bool) -> None:
        """A tracked key was used."""

    @abstractmethod
    def _on_remove(self, key: Key, pinned: bool) -> None:
        """A key is being removed by the owner; drop it from the ordering.

        Called before the key leaves ``_sizes``, so its size is still there."""

    @abstractmethod
    def _choose_victim(self) -> Key:
        """Pick an unpinned key (one exists), drop it from the ordering, return it.

        The key is still in ``_sizes`` while this runs."""

    @abstractmethod
    def _on_pin(self, key: Key) -> None:
        """Take ``key`` out of the eviction order."""

    @abstractmethod
    def _on_unpin(self, key: Key) -> None:
        """Put ``key`` back into the eviction order as just used."""
