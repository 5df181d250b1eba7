"""The disk tier's index: what is on disk, by key, without reading it, and which entry goes first.

Sizes, parents, ages and access counts of the stored entries, the pinned
keys, the byte counts and the eviction policy, kept in step. Not thread-safe on its own:
the disk tier calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tierserve.cache.eviction import EvictionPolicy
from tierserve.cache.stats import TierStats


@dataclass(slots=True)
class StoredEntry:
    """What the index knows of one entry on disk."""

    size: int  # bytes on disk
    raw: int  # tensor bytes; after a restart, the on-disk size until the entry is first read
    parent: bytes | None
    created: float  # entry.created; after a restart, diskcache's store time until first read
    accesses: int = 0  # hits here plus uses credited from above; saved in the directory's counts record


class DiskIndex:
    """Stored entries by key, bounded by ``max_bytes`` (0: no bound), ordered by ``policy``.

    ``pinned`` may also hold keys still queued for writing: they are pinned
    in the policy as soon as they are indexed. Byte counts are mirrored into
    ``stats`` (``stored_bytes``, ``raw_bytes``) and evictions counted there.
    """

    def __init__(self, policy: EvictionPolicy, max_bytes: int, stats: TierStats) -> None:
        self.policy = policy
        self.max_bytes = max_bytes
        self.stats = stats
        self.pinned: set[bytes] = set()
        self.stored_bytes = 0
        self.raw_bytes = 0
        self._entries: dict[bytes, StoredEntry] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def get(self, key: bytes) -> StoredEntry | None:
        return self._entries.get(key)

    def add(self, key: bytes, stored: StoredEntry) -> None:
        """Index a stored entry (a pinned key stays pinned)."""
        self._entries[key] = stored
        self.policy.insert(key, stored.size)
        if key in self.pinned:
            self.policy.pin(key)
        self._count(stored.size, stored.raw)

    def remove(self, key: bytes, keep_pin: bool = False) -> None:
        """Forget an indexed key (its file is the caller's to delete)."""
        stored = self._entries.pop(key)
        self.policy.remove(key)
        if not keep_pin:
            self.pinned.discard(key)
        self._count(-stored.size, -stored.raw)

    def access_counts(self) -> dict[bytes, int]:
        """The non-zero access counts of the stored entries, by key."""
        return {key: stored.accesses for key, stored in self._entries.items() if stored.accesses}

    def restore_access_counts(self, counts: dict[bytes, int]) -> None:
        """Set the access counts a previous run saved, for the keys indexed now."""
        for key, count in counts.items():
            stored = self._entries.get(key)
            if stored is not None:
                stored.accesses = count

    def clear(self) -> None:
        for key in list(self._entries):
            self.remove(key)
        self.pinned.clear()

    def read_back(self, stored: StoredEntry, raw: int, created: float) -> None:
        """An entry was read whole: its true tensor size and creation time replace the start-up estimates."""
        self._count(0, raw - stored.raw)
        stored.raw, stored.created = raw, created

    @property
    def over_bound(self) -> bool:
        return bool(self.max_bytes) and self.stored_bytes > self.max_bytes

    def evict_over_bound(self) -> list[bytes]:
        """Drop victims from the index until the bound holds; the caller deletes their files."""
        victims = []
        while self.over_bound:
            victim = self.policy.evict()
            if victim is None:
                break
            stored = self._entries.pop(victim)
            self._count(-stored.size, -stored.raw)
            self.stats.evictions += 1
            victims.append(victim)
        return victims

    def problems(self, pending: set[bytes]) -> list[str]:
        """What disagrees among the entries, the policy and the counters (empty when all agree)."""
        problems = []
        if set(self.policy) != set(self._entries):
            problems.append("policy keys differ from indexed keys")
        sizes = sum(stored.size for stored in self._entries.values())
        if self.policy.total_size != sizes or self.stored_bytes != sizes:
            problems.append(f"sizes disagree: policy {self.policy.total_size}, index {sizes}")
        if self.raw_bytes != sum(stored.raw for stored in self._entries.values()):
            problems.append("raw byte count is not the sum of raw sizes")
        if (self.stats.stored_bytes, self.stats.raw_bytes) != (self.stored_bytes, self.raw_bytes):
            problems.append("stats bytes differ from bytes held")
        if not self.pinned <= self._entries.keys() | pending:
            problems.append("a pinned key is not stored")
        if any(stored.accesses < 0 for stored in self._entries.values()):
            problems.append("a negative access count")
        return problems

    def _count(self, stored: int, raw: int) -> None:
        self.stored_bytes += stored
        self.raw_bytes += raw
        self.stats.stored_bytes, self.stats.raw_bytes = self.stored_bytes, self.raw_bytes
