"""The cache tier interface (the memory and disk tiers, and any plugin tier) and what tiers store.

A tier is a bounded map from block hash to ``CacheEntry``. It owns an eviction
policy (from the registry) that orders its keys; when a ``put`` needs room it
evicts and returns what it evicted, so the tiered store can demote those
entries to the next tier down. A corrupt, truncated or foreign value is never
returned: ``get`` deletes it, logs it, counts it and reports a miss.

Each stored entry also has an access count (``get`` hits, plus uses credited
from the tier above when the store demotes a block), so the store can rank
the prefixes used most (``TieredStore.frequent_prefixes``); a count leaves
with its entry.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierserve.cache.stats import TierStats
from tierserve.cache.figures import Figures

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class CacheEntry:
    """One full KV block of one prefix.

    Attributes:
        key: the block's chained hash (``cache.hashing``).
        parent: the previous block's hash, ``None`` for a prompt's first block.
        token_ids: the block's tokens; a hit is only used if they match.
        kv: CPU tensor ``[num_layers, 2, block_size, num_kv_heads, head_dim]``.
        created: ``time.time()`` when first stored (for TTL).
        accesses: uses counted for the block where it was before: a tier's
            ``put`` adds them to the block's access count there, and an entry
            a tier evicts (``put``'s return value) carries the count it had
            there, so hits follow a block down the tiers. 0 in what ``get`` returns.
    """

    key: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    kv: torch.Tensor
    created: float = field(default_factory=time.time)
    accesses: int = 0

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True, slots=True)
class TierCapacity:
    """A tier's bounds: entries (KV blocks) and bytes as stored; ``None`` where it has none (or
    does not know it: a remote server evicts by its own policy)."""

    entries: int | None = None
    bytes: int | None = None


@dataclass(slots=True)
class WriteTally:
    """What became of the writes one caller waits for (a prompt warm's write-through), in one tier.

    Attributes:
        written: entries the tier stored (or already held).
        dropped: entries it gave up: no room in its write queue by the deadline, too large,
            a disk error, or no room under its bound that is not pinned.
        pending: entries accepted and not yet stored or given up (flush the tier, then read).
    """

    written: int = 0
    dropped: int = 0
    pending: int = 0


class CacheTier(ABC):
    """A bounded store of ``CacheEntry`` values keyed by block hash. Thread-safe.

    A subclass's constructor is what ``register_cache_tiers`` registers; it is called as
    ``factory(tier, policy_factory, fingerprint)`` and must call ``super().__init__()``.

    Args (of every factory registered through ``register_cache_tiers``):
        tier: the tier's ``[[kv_cache.tiers]]`` entry (``TierSettings``): ``name``, ``ttl_seconds``
            (seconds from ``entry.created``; None or 0: never), and the plugin's own keys as
            ``tier.options_as(MySettings)``.
        policy_factory: ``policy_factory(capacity)`` builds this tier's eviction policy; ``capacity``
            is in entries, and each entry is inserted with size 1.
        fingerprint: the model fingerprint (a string); entries written under another one
            are foreign and never returned.

    What the base class gives a subclass:
        stats: a ``TierStats``; count ``hits``, ``misses``, ``puts``, ``evictions``, ``expirations``,
            ``corrupt``, ``write_errors`` and ``get_seconds``/``put_seconds`` (time spent in ``get`` and
            ``put``), and keep ``stored_bytes`` (as stored) and ``raw_bytes`` (the tensors' own bytes,
            ``kv.nbytes``) up to date. ``/v1/cache/stats`` and ``/metrics`` show them per tier.
            ``errors`` is tierserve's: the calls into the tier that raised (each is contained, answered as a
            miss or a dropped write, logged, and the tier left alone for a back-off).
        lock: a ``threading.RLock``. The store calls ``put``/``put_many`` from the engine thread and its
            writer, and ``get``/``get_many`` from its loader thread, so every method may run on any
            thread: hold ``self.lock`` around the tier's own state.
        note_removed(key): call it for every entry that leaves on the tier's own initiative (evicted
            without being returned by ``put``, expired, found corrupt), so the store's index follows;
            not for ``remove``/``clear``, which the store asked for, nor for entries ``put`` returns.
        figures: counters and gauges of the tier's own (``Figures``); they appear under the tier's name
            in ``/v1/cache/stats`` (``plugin_figures``) and in ``/metrics``.

    Class attributes: ``medium`` (``"memory"``, ``"disk"`` or ``"remote"``: statistics sum bytes by it) and
    ``shared`` (other processes write into the same store: it is then asked on every lookup and written
    through).

    ``entry.kv`` may be a view of a larger tensor (the store copies several blocks off the arena at once):
    a tier may keep the reference (nothing writes into it), and one that serializes it writes the view's own
    bytes (``torch.save(kv.clone())`` or ``kv.numpy().tobytes()``: ``torch.save(kv)`` writes the whole buffer).

    ``tierserve.testing.check_cache_tier(factory)`` runs the rules below over a tier.
    """

    name: str = "tier"
    medium: str = "memory"  # where entries live: "memory", "disk" or "remote" (statistics group bytes by it)
    # Other processes write entries into a shared tier (a remote server), so the store asks it on a
    # lookup even for keys its own index does not hold; ``keys`` then lists only what this process knows.
    # A shared tier is written through unless its [[kv_cache.tiers]] entry sets write_through = false.
    shared: bool = False

    def __init__(self) -> None:
        self.stats = TierStats()
        self.lock = threading.RLock()
        self.figures = Figures()
        self._removed: deque[bytes] = deque()

    def note_removed(self, key: bytes) -> None:
        """Record that ``key`` left on the tier's own initiative (evicted, expired,
        corrupt, or a queued write that failed or was dropped). Any thread may call it."""
        self._removed.append(key)

    def drain_removed(self) -> list[bytes]:
        """Keys that left since the last call, so the owner's index can follow."""
        drained = []
        while self._removed:
            drained.append(self._removed.popleft())
        return drained

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored (cheap: no data is read)."""

    @abstractmethod
    def get(self, key: bytes) -> CacheEntry | None:
        """The entry, or ``None`` on a miss (absent, expired, corrupt or foreign; the
        bad ones are deleted and counted). A hit counts as a use for the policy."""

    def get_many(self, keys: list[bytes]) -> list[CacheEntry]:
        """The entries of ``keys`` in order, up to the first one that misses (a prompt's blocks past a gap are of
        no use): a list shorter than ``keys`` means ``keys[len(result)]`` missed. Hits and that one miss count
        as ``get`` counts them; nothing after the miss is counted or touched. The store's loader thread reads a
        prompt's blocks through it. The default is a ``get`` each; a tier that can read several in one trip
        (one Redis round trip, one pass over a file) overrides it."""
        return read_until_miss(keys, self.get)

    @abstractmethod
    def put(self, entry: CacheEntry) -> list[CacheEntry]:
        """Store ``entry`` (replacing one with the same key) and return the entries
        evicted to make room, for demotion; entries the tier cannot return
        (disk) are dropped and only counted.

        ``entry.accesses`` is added to the key's access count (a replaced
        entry's count is kept); each returned entry's ``accesses`` is the count
        it had here (a newcomer handed back keeps the one it came with)."""

    def put_many(self, entries: list[CacheEntry]) -> list[CacheEntry]:
        """``put`` of each entry, in order, and everything they evicted (or handed back), as ``put`` returns it.
        The store hands a step's demotions and write-throughs to a tier through it; the default is a ``put``
        each, and a tier that can store several at once overrides it."""
        evicted: list[CacheEntry] = []
        for entry in entries:
            evicted.extend(self.put(entry))
        return evicted

    def put_waiting(self, entry: CacheEntry, tally: WriteTally, deadline: float) -> list[CacheEntry]:
        """``put`` for a caller that waits for the write: a tier that queues writes waits for room
        in its queue until ``deadline`` (``time.monotonic()``) instead of dropping the entry, and
        counts it in ``tally`` once it is stored (``written``) or given up (``dropped``).

        The default puts at once and counts what ``put`` did.
        """
        evicted = self.put(entry)
        if self.contains(entry.key) and all(gone.key != entry.key for gone in evicted):
            tally.written += 1
        else:
            tally.dropped += 1
        return evicted

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Delete ``key`` if present."""

    @abstractmethod
    def clear(self) -> int:
        """Delete everything; returns how many entries were removed."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """A snapshot of the stored keys."""

    @abstractmethod
    def parent_of(self, key: bytes) -> bytes | None:
        """The stored entry's parent hash, without reading its data (for the store's hash index)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of entries."""

    @property
    @abstractmethod
    def bytes_used(self) -> int:
        """Bytes held (as stored)."""

    @property
    def capacity(self) -> TierCapacity:
        """The bounds the tier keeps to (statistics show occupancy against them); the default: none known."""
        return TierCapacity()

    @abstractmethod
    def access_count(self, key: bytes) -> int:
        """How often the stored ``key`` was used: its ``get`` hits here plus the uses
        credited to it (``CacheEntry.accesses`` on ``put``, ``add_accesses``); 0 when not stored.

        The count leaves with the entry (evicted, expired, removed, corrupt,
        cleared). A tier that survives a restart keeps its counts too.
        """

    @abstractmethod
    def add_accesses(self, key: bytes, count: int) -> None:
        """Add ``count`` (may be negative; the result never goes below 0) to the access count
        of the stored ``key``; a key not stored is ignored. The store credits a block
        demoted onto a copy this tier already holds with the uses it had above."""

    @abstractmethod
    def pin(self, key: bytes) -> None:
        """Keep ``key`` from being evicted or expired until ``unpin``.

        The tiered store pins every block of a named prefix (a block that
        cached children need is ``hold``-ed instead). The store counts its
        pins and calls this once per key, so pins here need not nest:
        pinning twice and unpinning once leaves ``key`` evictable. A key not
        stored is ignored (the store pins it again when it arrives);
        ``remove`` and ``clear`` drop the pins of what they delete. A tier
        whose other entries are all pinned keeps them: a ``put`` that needs
        room then gives up the newcomer (returned, or dropped and counted by
        a tier that cannot return entries), so a pinned entry is never evicted.
        """

    @abstractmethod
    def unpin(self, key: bytes) -> None:
        """Make ``key`` evictable again (ending a ``pin`` or a ``hold``); a key not stored or not pinned is ignored."""

    def hold(self, key: bytes) -> None:
        """Keep ``key`` because a cached block extends it: the store holds parents in its last
        tier so that leaves go first. Replaces a ``pin`` of ``key``; ``unpin`` ends it.

        Unlike a pin, a hold gives way to the tier's bound: a tier that would
        otherwise exceed it may evict held entries once nothing else is left,
        leaves first (an entry whose stored children are gone). The default
        treats a hold as a pin.
        """
        self.pin(key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until queued background writes are on their medium."""

    def close(self) -> None:
        """Flush and release resources."""

    def writes_pending(self) -> int:
        """Writes accepted and not yet on the medium (0 for a tier that writes as it is asked)."""
        return 0

    def release_thread(self) -> None:
        """Release what the calling thread opened in this tier (a per-thread connection); called on the store's
        loader thread before it ends (``get`` may run there: ``TieredStore.start_load``). Default: nothing."""


def read_until_miss(keys: list[bytes], read: Callable[[bytes], CacheEntry | None]) -> list[CacheEntry]:
    """``read`` of each key in order, up to the first that gives ``None`` (``CacheTier.get_many``'s default)."""
    found: list[CacheEntry] = []
    for key in keys:
        entry = read(key)
        if entry is None:
            break
        found.append(entry)
    return found
