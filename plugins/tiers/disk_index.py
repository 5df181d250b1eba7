"""The disk tier's index: what is on disk, by key, without reading it, and which entry goes first.

Sizes, parents, ages and access counts of the stored entries, the pinned and
held keys, the byte counts and the eviction policy, kept in step. Not
thread-safe on its own: the disk tier calls it with its lock held.

Room is made in two rounds, so the byte bound holds whatever the store pins:

    1. the policy's victims: entries neither pinned nor held
    2. held entries (a cached child needs them) with no stored child here, least
       recently used (or made such a leaf) first: a parent goes after its stored children
    pinned entries (named prefixes) never go; when only they are left, the newcomer is refused
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

    ``pinned`` and ``held`` may also name keys still queued for writing: they
    are pinned in the policy as soon as they are indexed (the policy never
    chooses either kind; held entries go in ``make_room``'s second round).
    Byte counts are mirrored into ``stats`` (``stored_bytes``, ``raw_bytes``)
    and evictions counted there.
    """

    def __init__(self, policy: EvictionPolicy, max_bytes: int, stats: TierStats) -> None:
        self.policy = policy
        self.max_bytes = max_bytes
        self.stats = stats
        self.pinned: set[bytes] = set()  # never evicted (named prefixes)
        self.held: set[bytes] = set()  # a cached child needs it: evicted only in the second round
        self.stored_bytes = 0
        self.raw_bytes = 0
        self._entries: dict[bytes, StoredEntry] = {}
        self._children: dict[bytes, int] = {}  # parent -> indexed entries naming it (the parent may not be indexed)
        self._entries_estimated = False
        self._bare: dict[bytes, None] = {}  # indexed, held, no indexed child: the second round, in order

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def get(self, key: bytes) -> StoredEntry | None:
        return self._entries.get(key)

    def add(self, key: bytes, stored: StoredEntry) -> None:
        """Index a stored entry (a pinned or held key stays so)."""
        self._entries[key] = stored
        if self.max_bytes and not self._entries_estimated and stored.size:
            # the policy counts entries: the byte bound over the first entry's size on disk estimates how many fit
            self.policy.capacity = max(1, self.max_bytes // stored.size)
            self._entries_estimated = True
        self.policy.insert(key)
        if key in self.pinned or key in self.held:
            self.policy.pin(key)
        if stored.parent is not None:
            self._children[stored.parent] = self._children.get(stored.parent, 0) + 1
            self._bare.pop(stored.parent, None)
        self._refresh(key)
        self._count(stored.size, stored.raw)

    def remove(self, key: bytes, keep_pin: bool = False) -> None:
        """Forget an indexed key (its file is the caller's to delete)."""
        self.policy.remove(key)
        self._forget(key)
        if not keep_pin:
            self.unpin(key)

    def touch(self, key: bytes) -> None:
        """A use of an indexed key: the policy hears of it, and a held leaf goes to the back of the second round."""
        self.policy.touch(key)
        if key in self._bare:
            self._bare[key] = self._bare.pop(key)

    def pin(self, key: bytes) -> None:
        """Never evict ``key`` (indexed, or queued: pinned once indexed); replaces a hold."""
        self.held.discard(key)
        self._bare.pop(key, None)
        self.pinned.add(key)
        if key in self._entries:
            self.policy.pin(key)

    def hold(self, key: bytes) -> None:
        """Evict ``key`` only in the second round (indexed, or queued: held once indexed); replaces a pin."""
        self.pinned.discard(key)
        self.held.add(key)
        if key in self._entries:
            self.policy.pin(key)
            self._refresh(key)

    def unpin(self, key: bytes) -> None:
        """End a pin or a hold of ``key``."""
        self.pinned.discard(key)
        self.held.discard(key)
        self._bare.pop(key, None)
        if key in self._entries:
            self.policy.unpin(key)

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
        self.held.clear()

    def read_back(self, stored: StoredEntry, raw: int, created: float) -> None:
        """An entry was read whole: its true tensor size and creation time replace the start-up estimates."""
        self._count(0, raw - stored.raw)
        stored.raw, stored.created = raw, created

    def has_room(self, size: int) -> bool:
        """Whether an entry of ``size`` bytes fits beside what is indexed."""
        return not self.max_bytes or self.stored_bytes + size <= self.max_bytes

    def make_room(self, size: int, parent: bytes | None = None) -> list[bytes]:
        """Drop victims from the index until an entry of ``size`` bytes fits (``has_room``), or
        nothing more may go; the caller deletes their files. ``parent``, the newcomer's, is
        spared: dropping it for its own child would leave that child unreachable."""
        victims = []
        while not self.has_room(size):
            victim = self.policy.evict()
            if victim is None:
                victim = next((key for key in self._bare if key != parent), None)
                if victim is None:
                    break
                self.held.discard(victim)
                self.policy.remove(victim)
            self._forget(victim)
            self.stats.evictions += 1
            victims.append(victim)
        return victims

    def problems(self, pending: set[bytes]) -> list[str]:
        """What disagrees among the entries, the policy and the counters (empty when all agree)."""
        problems = []
        if set(self.policy) != set(self._entries):
            problems.append("policy keys differ from indexed keys")
        sizes = sum(stored.size for stored in self._entries.values())
        if self.policy.total_size != len(self._entries) or self.stored_bytes != sizes:
            problems.append(f"sizes disagree: policy {self.policy.total_size} entries, index {sizes} bytes")
        if self.raw_bytes != sum(stored.raw for stored in self._entries.values()):
            problems.append("raw byte count is not the sum of raw sizes")
        if (self.stats.stored_bytes, self.stats.raw_bytes) != (self.stored_bytes, self.raw_bytes):
            problems.append("stats bytes differ from bytes held")
        if not (self.pinned | self.held) <= self._entries.keys() | pending:
            problems.append("a pinned or held key is not stored")
        if self.pinned & self.held:
            problems.append("a key both pinned and held")
        kept = (self.pinned | self.held) & self._entries.keys()
        if {key for key in self._entries if self.policy.is_pinned(key)} != kept:
            problems.append("the policy's pins differ from the pinned and held keys")
        children: dict[bytes, int] = {}
        for stored in self._entries.values():
            if stored.parent is not None:
                children[stored.parent] = children.get(stored.parent, 0) + 1
        if children != self._children:
            problems.append("child counts disagree with the parents of indexed entries")
        bare = {key for key in self.held & self._entries.keys() if key not in children}
        if set(self._bare) != bare:
            problems.append("held leaves differ from the held entries with no indexed child")
        if any(stored.accesses < 0 for stored in self._entries.values()):
            problems.append("a negative access count")
        return problems

    def _forget(self, key: bytes) -> None:
        """Drop an indexed key the policy no longer tracks, with its bytes and its parent's child count."""
        stored = self._entries.pop(key)
        self._bare.pop(key, None)
        parent = stored.parent
        if parent is not None:
            remaining = self._children[parent] - 1
            if remaining:
                self._children[parent] = remaining
            else:
                del self._children[parent]
                self._refresh(parent)
        self._count(-stored.size, -stored.raw)

    def _refresh(self, key: bytes) -> None:
        """Put ``key`` in the second round's order if it is an indexed, held leaf (at the back)."""
        if key in self._entries and key in self.held and key not in self._children:
            self._bare.setdefault(key)

    def _count(self, stored: int, raw: int) -> None:
        self.stored_bytes += stored
        self.raw_bytes += raw
        self.stats.stored_bytes, self.stats.raw_bytes = self.stored_bytes, self.raw_bytes
