"""The cache tier interface (L2 memory, L3 disk, and any plugin tier) and what tiers store.

A tier is a bounded map from block hash to ``CacheEntry``. It owns an eviction
policy (from the registry) that orders its keys; when a ``put`` needs room it
evicts and returns what it evicted, so the tiered store can demote those
entries to the next tier down. A corrupt, truncated or foreign value is never
returned: ``get`` deletes it, logs it, counts it and reports a miss.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    """

    key: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    kv: torch.Tensor
    created: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class TierStats:
    """Counters of one tier; read by ``/v1/cache/stats`` and Prometheus."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    expirations: int = 0
    corrupt: int = 0
    dropped_writes: int = 0
    write_errors: int = 0
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    stored_bytes: int = 0  # bytes as stored (compressed for disk)
    raw_bytes: int = 0  # bytes of the tensors they hold

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


class CacheTier(ABC):
    """A bounded store of ``CacheEntry`` values keyed by block hash. Thread-safe.

    Args (of every factory registered through ``register_cache_tiers``):
        settings: the ``[kv_cache]`` section.
        policy_factory: ``policy_factory(capacity)`` builds this tier's eviction
            policy; the tier picks the unit (entries for memory, bytes for disk).
        fingerprint: the model fingerprint; entries written under another one
            are foreign and never returned.
    """

    name: str = "tier"

    def __init__(self) -> None:
        self.stats = TierStats()
        self.lock = threading.RLock()
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

    @abstractmethod
    def put(self, entry: CacheEntry) -> list[CacheEntry]:
        """Store ``entry`` (replacing one with the same key) and return the entries
        evicted to make room, for demotion; entries the tier cannot return
        (disk) are dropped and only counted."""

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
        """The stored entry's parent hash, without reading its data (for the radix index)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of entries."""

    @property
    @abstractmethod
    def bytes_used(self) -> int:
        """Bytes held (as stored)."""

    def pin(self, key: bytes) -> None:
        """Keep ``key`` from being evicted (it is being read, or it has cached children)."""

    def unpin(self, key: bytes) -> None:
        """Undo ``pin``."""

    def flush(self, timeout: float | None = None) -> None:
        """Wait until queued background writes are on their medium."""

    def close(self) -> None:
        """Flush and release resources."""
