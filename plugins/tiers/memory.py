"""L2: KV blocks in host RAM, bounded by entry count and bytes; registers the "memory" tier."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from tierserve.cache.tier import CacheEntry, CacheTier, TierCapacity
from tierserve.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from tierserve.cache.eviction import EvictionPolicy
    from tierserve.core.tier_settings import TierSettings


SWEEP_ENTRIES = 256  # the oldest entries an expiry looks over for more past the TTL


class MemoryTierSettings(BaseModel):
    """A ``plugin = "memory"`` tier's own keys in its ``[[kv_cache.tiers]]`` entry."""

    model_config = ConfigDict(extra="forbid")

    capacity: int = Field(50000, ge=0, description="entries (KV blocks) held; 0 stores nothing")
    max_bytes: int = Field(1_000_000_000, ge=0, description="bytes of tensors held; 0: no byte bound")


class MemoryTier(CacheTier):
    """Holds ``CacheEntry`` objects as given (no copy, no encoding).

    Bounds: ``capacity`` entries (0 stores nothing) and ``max_bytes``
    bytes of tensors (0: no byte bound), from ``MemoryTierSettings``. The policy's capacity is
    in entries: ``capacity``, lowered to what ``max_bytes`` holds once the first entry's size is known. ``put`` evicts until both bounds
    hold and returns what it evicted, for demotion; an entry that cannot fit
    (bigger than the tier, or everything else is pinned) is returned without
    being kept.

    Entries older than ``ttl_seconds`` (None or 0: never) are deleted when a
    lookup sees them. Pinned entries are neither evicted nor expired (they are
    being read, or a named prefix); held ones (``hold``: they still have cached
    children) are not evicted but do expire: a child is never older than its parent,
    so an expired parent's children are past the TTL too.

    ``get`` returns a new ``CacheEntry`` around the stored ``kv`` tensor (not a
    copy of it): callers may reassign its fields but must not write into ``kv``.
    Access counts live in the stored entries (``accesses``), so they leave
    with them and an evicted entry carries its own; they do not outlive the process.
    """

    name = "memory"

    def __init__(
        self, tier: TierSettings, policy_factory: Callable[[int], EvictionPolicy], fingerprint: str
    ) -> None:
        super().__init__()
        options = tier.options_as(MemoryTierSettings)
        self.fingerprint = fingerprint
        self.max_entries = options.capacity
        self.max_bytes = options.max_bytes
        self.ttl = tier.ttl_seconds or None
        self._by_bytes = self.max_bytes > 0
        self.policy = policy_factory(max(self.max_entries, 1))
        self._sized_policy = not self._by_bytes
        self._entries: dict[bytes, CacheEntry] = {}
        self._held: set[bytes] = set()  # pinned in the policy by a hold, not by a pin: they still expire
        self._bytes = 0

    def contains(self, key: bytes) -> bool:
        with self.lock:
            entry = self._entries.get(key)
            return entry is not None and not self._expire_if_old(entry)

    def get(self, key: bytes) -> CacheEntry | None:
        start = time.perf_counter()
        with self.lock:
            entry = self._entries.get(key)
            if entry is None or self._expire_if_old(entry):
                self.stats.misses += 1
                entry = None
            else:
                self.policy.touch(key)
                self.stats.hits += 1
                entry.accesses += 1
                entry = replace(entry, accesses=0)
            self.stats.get_seconds += time.perf_counter() - start
            return entry

    def put(self, entry: CacheEntry) -> list[CacheEntry]:
        start = time.perf_counter()
        with self.lock:
            self.stats.puts += 1
            evicted = self._store(entry)
            self._sync_byte_stats()
            self.stats.put_seconds += time.perf_counter() - start
            return evicted

    def remove(self, key: bytes) -> None:
        with self.lock:
            if key in self._entries:
                self._forget(key)
                self.policy.remove(key)
                self._sync_byte_stats()

    def clear(self) -> int:
        with self.lock:
            removed = len(self._entries)
            for key in list(self._entries):
                self._forget(key)
                self.policy.remove(key)
            self._sync_byte_stats()
            return removed

    def keys(self) -> Iterator[bytes]:
        with self.lock:
            return iter(list(self._entries))

    def parent_of(self, key: bytes) -> bytes | None:
        """The parent hash of ``key``; ``None`` also when ``key`` is not stored."""
        with self.lock:
            entry = self._entries.get(key)
            return entry.parent if entry is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def access_count(self, key: bytes) -> int:
        with self.lock:
            entry = self._entries.get(key)
            return entry.accesses if entry is not None else 0

    def add_accesses(self, key: bytes, count: int) -> None:
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.accesses = max(0, entry.accesses + count)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    @property
    def capacity(self) -> TierCapacity:
        return TierCapacity(self.max_entries, self.max_bytes or None)

    def pin(self, key: bytes) -> None:
        """Protect ``key`` from eviction and expiry; a key not stored is ignored."""
        with self.lock:
            if key in self._entries:
                self._held.discard(key)
                self.policy.pin(key)

    def hold(self, key: bytes) -> None:
        """Protect ``key`` from eviction (it has cached children), not from expiry; replaces a pin."""
        with self.lock:
            if key in self._entries:
                self.policy.pin(key)
                self._held.add(key)

    def unpin(self, key: bytes) -> None:
        with self.lock:
            if key in self._entries:
                self._held.discard(key)
                self.policy.unpin(key)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless the entries, the policy and the counters agree."""
        with self.lock:
            problems = []
            if set(self.policy) != set(self._entries):
                problems.append("policy keys differ from stored keys")
            if self._bytes != sum(entry.nbytes for entry in self._entries.values()):
                problems.append(f"byte count {self._bytes} is not the sum of entry sizes")
            if self.policy.total_size != len(self._entries):
                problems.append("policy sizes differ from the entry count")
            if self.stats.stored_bytes != self._bytes or self.stats.raw_bytes != self._bytes:
                problems.append("stats bytes differ from bytes held")
            if any(entry.accesses < 0 for entry in self._entries.values()):
                problems.append("a negative access count")
            if problems:
                raise AssertionError(f"{self.name} tier: " + "; ".join(problems))

    # ---- internals (callers hold self.lock) --------------------------------

    def _store(self, entry: CacheEntry) -> list[CacheEntry]:
        if self.max_entries == 0 or (self._by_bytes and entry.nbytes > self.max_bytes):
            return [entry]
        key = entry.key
        if key in self._entries:
            entry.accesses += self._forget(key).accesses
        self._entries[key] = entry
        self._bytes += entry.nbytes
        if not self._sized_policy and entry.nbytes:
            # a KV block's size is the model's: the bound in bytes is a bound in entries
            self.policy.capacity = max(1, min(self.policy.capacity, self.max_bytes // entry.nbytes))
            self._sized_policy = True
        self.policy.insert(key)  # re-inserting a tracked key touches it

        evicted: list[CacheEntry] = []
        while self._over_bounds():
            victim = self.policy.evict()
            if victim is None:
                break
            evicted.append(self._forget(victim))
            self.stats.evictions += 1
        if self._over_bounds() and key in self._entries and not self.policy.is_pinned(key):
            # Everything else is pinned: the newcomer is the one that goes down a tier.
            self.policy.remove(key)
            evicted.append(self._forget(key))
            self.stats.evictions += 1
        return evicted

    def _over_bounds(self) -> bool:
        return len(self._entries) > self.max_entries or (self._by_bytes and self._bytes > self.max_bytes)

    def _forget(self, key: bytes) -> CacheEntry:
        """Drop the data of ``key``; the caller settles the policy."""
        entry = self._entries.pop(key)
        self._held.discard(key)
        self._bytes -= entry.nbytes
        return entry

    def _expire_if_old(self, entry: CacheEntry) -> bool:
        if not self._past_ttl(entry):
            return False
        self._expire(entry.key)
        # what was stored before it is likely past the TTL too, and no lookup reaches the children of an
        # expired parent: look over the oldest entries now rather than keep them until they are evicted
        for old in [e for e in itertools.islice(self._entries.values(), SWEEP_ENTRIES) if self._past_ttl(e)]:
            self._expire(old.key)
        self._sync_byte_stats()
        return True

    def _past_ttl(self, entry: CacheEntry) -> bool:
        if self.ttl is None or time.time() - entry.created <= self.ttl:
            return False
        return not self.policy.is_pinned(entry.key) or entry.key in self._held

    def _expire(self, key: bytes) -> None:
        self._forget(key)
        self.policy.remove(key)
        self.stats.expirations += 1
        self.note_removed(key)

    def _sync_byte_stats(self) -> None:
        self.stats.stored_bytes = self.stats.raw_bytes = self._bytes


@hookimpl
def register_cache_tiers(register):
    register("memory", MemoryTier, settings=MemoryTierSettings, description="host RAM, bounded by entries and bytes")
