"""The eviction policy interface every cache tier uses.

A tier owns the data; its policy only orders keys. The tier calls
``insert`` when it stores an entry, ``touch`` on every hit, ``remove`` when
it deletes an entry for its own reasons (TTL, clear, corruption), and
``evict`` when it needs room: the policy picks a victim, forgets it and
returns its key, and the tier deletes the data. Pinned entries (in use, or
being read) are never chosen.

Subclasses implement the hooks ``on_insert``, ``on_touch``, ``on_remove``,
``choose_victim``, ``on_pin`` and ``on_unpin`` (and optionally ``on_resize``);
this base class does the bookkeeping and argument checks so every policy,
built-in or from a plugin, behaves the same at the edges. Each hook must run
in O(1) or amortised O(log n). ``tierserve.testing.check_eviction_policy``
runs the rules below over a policy class.

The rules every policy keeps (the base class enforces the first four):

* ``insert`` of a tracked key updates its size and counts as a use (``on_touch``).
* ``touch``, ``remove``, ``pin``, ``unpin`` and ``size_of`` of a key not
  tracked raise ``KeyError`` and change nothing.
* ``evict`` returns ``None`` exactly when no key or only pinned keys are
  tracked, and never a pinned key; the key it returns is no longer tracked.
* ``touch`` of a pinned key is a use, but the key stays ineligible until
  ``unpin``, which puts it back as the most recently used.
* every key inserted and not removed is evicted exactly once if ``evict``
  is called until it returns ``None`` (nothing is lost or returned twice).

Hooks named as before 0.2 (``_on_insert``, ``_choose_victim``, ...) still
work: a subclass that defines only the old name gets it under the new one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator

Key = Hashable


class EvictionPolicy(ABC):
    """Orders cache entries for eviction.

    Args:
        capacity: how many entries the owning tier holds at most, for every
            policy and every tier (the L1 pool's blocks, a memory tier's
            entries). A tier bound by bytes estimates it from its entries'
            size and may lower ``policy.capacity`` once it knows that size.
            Adaptive policies use it to size their history; simple ones
            ignore it. Sizes given to ``insert`` are weights in the same unit:
            every built-in tier inserts each entry with size 1.
    """

    # the hooks' names before 0.2, each with its current name
    OLD_HOOK_NAMES = {
        "_on_insert": "on_insert",
        "_on_resize": "on_resize",
        "_on_touch": "on_touch",
        "_on_remove": "on_remove",
        "_choose_victim": "choose_victim",
        "_on_pin": "on_pin",
        "_on_unpin": "on_unpin",
    }

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in cls.OLD_HOOK_NAMES.items():
            if old in cls.__dict__ and new not in cls.__dict__:
                setattr(cls, new, cls.__dict__[old])

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
                self.on_resize(key, old, size)
                self._total_size += size - old
                self._sizes[key] = size
            self.touch(key)
            return
        self._sizes[key] = size
        self._total_size += size
        self.on_insert(key, size)

    def touch(self, key: Key) -> None:
        """Record a use (a cache hit) of a tracked key."""
        self._require(key)
        self.on_touch(key, key in self._pinned)

    def remove(self, key: Key) -> None:
        """Stop tracking ``key`` (deleted by the owner, not evicted)."""
        self._require(key)
        pinned = key in self._pinned
        self.on_remove(key, pinned)
        self._pinned.discard(key)
        self._total_size -= self._sizes.pop(key)

    def evict(self) -> Key | None:
        """Choose a victim among unpinned keys, stop tracking it and return it.

        Returns ``None`` when every tracked key is pinned or none is tracked.
        """
        if len(self._pinned) == len(self._sizes):
            return None
        key = self.choose_victim()
        self._total_size -= self._sizes.pop(key)
        return key

    def pin(self, key: Key) -> None:
        """Make ``key`` ineligible for eviction until ``unpin``."""
        self._require(key)
        if key not in self._pinned:
            self._pinned.add(key)
            self.on_pin(key)

    def unpin(self, key: Key) -> None:
        """Make ``key`` evictable again; unpinning counts as its latest use."""
        self._require(key)
        if key in self._pinned:
            self._pinned.discard(key)
            self.on_unpin(key)

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

    # ---- what a policy implements (its hooks) ------------------------------

    @abstractmethod
    def on_insert(self, key: Key, size: int) -> None:
        """A new, unpinned key was added."""

    def on_resize(self, key: Key, old_size: int, new_size: int) -> None:
        """A tracked key's size is changing (``size_of(key)`` still gives ``old_size``).

        Policies that keep their own size totals adjust them here."""

    @abstractmethod
    def on_touch(self, key: Key, pinned: bool) -> None:
        """A tracked key was used."""

    @abstractmethod
    def on_remove(self, key: Key, pinned: bool) -> None:
        """A key is being removed by the owner; drop it from the ordering.

        Called before the key is forgotten, so ``size_of(key)`` still answers."""

    @abstractmethod
    def choose_victim(self) -> Key:
        """Pick an unpinned key (one exists), drop it from the ordering, return it.

        The key is still tracked while this runs (``size_of`` answers)."""

    @abstractmethod
    def on_pin(self, key: Key) -> None:
        """Take ``key`` out of the eviction order."""

    @abstractmethod
    def on_unpin(self, key: Key) -> None:
        """Put ``key`` back into the eviction order as just used."""
