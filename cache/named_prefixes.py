"""Named, pinned prompt prefixes: what a request's ``cache_key`` means.

A request may name its prompt's cached prefix. The registry pins that
prefix's blocks in every tier of the store (``TieredStore.pin``), so a later
request with the same prompt prefix hits, within bounds:

    register ─► pin the new blocks, unpin the old ones ─► over max_keys or max_pinned_bytes:
                unpin and forget the least recently registered or used keys first
    use      ─► count the request (and its hit), refresh recency and TTL
    expire   ─► unpin keys idle past ttl_seconds
    delete   ─► unpin, then evict from every tier the blocks no other key pins

A key is ``(namespace, name)``: the same name in two namespaces (tenants) is
two keys, and a block both pin is counted once against the byte cap and
stays pinned while either does. Keep ``max_pinned_bytes`` well below L1's
size: pinned blocks are taken from the blocks running requests can use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierserve.cache.store import TieredStore

Key = tuple[str, str]  # (namespace, name)


@dataclass(slots=True)
class PrefixPlacement:
    """Where a named prefix's blocks are now (from the store's index).

    Attributes:
        complete: the tier names (``"l1"`` first, in store order) that hold every block.
        blocks: blocks held per tier name (every tier of the store, 0 included).
    """

    complete: list[str]
    blocks: dict[str, int]


@dataclass(slots=True)
class NamedPrefix:
    """One named prefix, as ``get`` and ``list`` report it.

    Attributes:
        namespace, name: the key.
        block_hashes: the pinned blocks, first block first (the store's chained hashes).
        prefix_tokens: tokens those blocks cover.
        pinned_bytes: bytes of KV those blocks take in one tier.
        hits: requests with this key that reused cached blocks (``use``).
        requests: requests with this key (the registering one, then every ``use``).
        created, last_used: when first registered, and last registered or used (the caller's clock).
        expires_at: when it expires if unused (``last_used + ttl_seconds``); ``None``: never.
        tiers: where its blocks are now; filled in by ``get`` and ``list``.
    """

    namespace: str
    name: str
    block_hashes: tuple[bytes, ...]
    prefix_tokens: int
    pinned_bytes: int
    hits: int = 0
    requests: int = 1
    created: float = 0.0
    last_used: float = 0.0
    expires_at: float | None = None
    tiers: PrefixPlacement = field(default_factory=lambda: PrefixPlacement([], {}))


class NamedPrefixes:
    """A bounded registry of named prefixes over a ``TieredStore``; used on the engine core's thread only.

    Args:
        store: the tiered store whose blocks are pinned.
        max_keys: keys kept at most (the registry's own memory is bounded by it).
        max_pinned_bytes: bytes of distinct pinned blocks at most (a block pinned by two keys counts once).
        ttl_seconds: a key idle this long is unpinned and forgotten by ``expire``; ``None``: never.
        block_bytes: bytes of KV one block takes (``KVSpec.block_bytes``).
    """

    def __init__(
        self, store: TieredStore, *, max_keys: int, max_pinned_bytes: int, ttl_seconds: float | None, block_bytes: int
    ) -> None:
        bounds = {"max_keys": max_keys, "max_pinned_bytes": max_pinned_bytes, "block_bytes": block_bytes}
        for what, value in bounds.items():
            if value <= 0:
                raise ValueError(f"{what} must be positive, got {value}")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive or None (never expire), got {ttl_seconds}")
        self.store = store
        self.max_keys = max_keys
        self.max_pinned_bytes = max_pinned_bytes
        self.ttl_seconds = ttl_seconds
        self.block_bytes = block_bytes
        self._keys: OrderedDict[Key, NamedPrefix] = OrderedDict()  # least recently registered or used first
        self._pins: dict[bytes, int] = {}  # block -> keys that pin it

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the distinct blocks pinned by all keys."""
        return len(self._pins) * self.block_bytes

    def __len__(self) -> int:
        return len(self._keys)

    def register(self, namespace: str, name: str, block_hashes: Sequence[bytes], now: float) -> NamedPrefix:
        """Pin ``block_hashes`` (the keyed request's full prompt blocks) under the key, replacing
        the blocks it pinned before; counts a request when the key is new.

        Then, while over ``max_keys`` or ``max_pinned_bytes``, the least recently
        registered or used other keys are unpinned and forgotten. ``ValueError``
        (nothing changes) when this prefix alone is over the byte cap or the name is empty.
        """
        if not name:
            raise ValueError("a cache key name must not be empty")
        blocks = tuple(dict.fromkeys(block_hashes))
        needed = len(blocks) * self.block_bytes
        if needed > self.max_pinned_bytes:
            raise ValueError(
                f"cache key {name!r}: its prefix takes {needed} bytes ({len(blocks)} blocks), more than the cap "
                f"on pinned bytes, max_pinned_bytes = {self.max_pinned_bytes}; use a shorter prefix or raise the cap"
            )
        key = (namespace, name)
        old = self._keys.get(key)
        self._pin(blocks)  # before the old blocks are released, so shared blocks never drop to no pin
        if old is None:
            entry = NamedPrefix(namespace, name, blocks, 0, 0, created=now)
        else:
            self._unpin(old.block_hashes)
            entry = old
        entry.block_hashes = blocks
        entry.prefix_tokens = len(blocks) * self.store.block_size
        entry.pinned_bytes = needed
        self._keys[key] = entry
        self._refresh(key, now)
        while len(self._keys) > self.max_keys or self.pinned_bytes > self.max_pinned_bytes:
            oldest = next(iter(self._keys))
            self._forget(oldest)
        return self._report(entry)

    def use(self, namespace: str, name: str, hit_blocks: int, now: float) -> NamedPrefix | None:
        """A later request with this key: count it (a hit when it reused ``hit_blocks`` > 0 cached
        blocks) and refresh its recency and TTL. ``None`` for an unknown key."""
        key = (namespace, name)
        entry = self._keys.get(key)
        if entry is None:
            return None
        entry.requests += 1
        if hit_blocks > 0:
            entry.hits += 1
        self._refresh(key, now)
        return self._report(entry)

    def get(self, namespace: str, name: str) -> NamedPrefix | None:
        """The key with where its blocks are now, or ``None``."""
        entry = self._keys.get((namespace, name))
        return self._report(entry) if entry is not None else None

    def list(self, namespace: str | None = None) -> list[NamedPrefix]:
        """The keys of ``namespace`` (``None``: of every namespace), by namespace then name."""
        keys = sorted(key for key in self._keys if namespace is None or key[0] == namespace)
        return [self._report(self._keys[key]) for key in keys]

    def delete(self, namespace: str, name: str) -> bool:
        """Unpin the key and evict its blocks from every tier, except those another key still pins
        (and L1 blocks a running request uses); False for an unknown key."""
        entry = self._forget((namespace, name))
        if entry is None:
            return False
        self.store.evict_keys([block for block in entry.block_hashes if block not in self._pins])
        return True

    def expire(self, now: float) -> int:
        """Unpin and forget the keys idle past ``ttl_seconds``; returns how many."""
        if self.ttl_seconds is None:
            return 0
        idle = [key for key, entry in self._keys.items() if entry.expires_at is not None and entry.expires_at <= now]
        for key in idle:
            self._forget(key)
        return len(idle)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the bounds hold and the per-block key counts match the keys."""
        assert len(self._keys) <= self.max_keys, f"{len(self._keys)} keys, max_keys {self.max_keys}"
        assert self.pinned_bytes <= self.max_pinned_bytes, f"{self.pinned_bytes} bytes pinned"
        counts: dict[bytes, int] = {}
        for entry in self._keys.values():
            for block in entry.block_hashes:
                counts[block] = counts.get(block, 0) + 1
        assert counts == self._pins, "per-block key counts differ from the keys' blocks"
        for block, count in counts.items():
            assert self.store.pins.count(block) >= count, f"block {block.hex()} has fewer store pins than keys"

    # ---- internals ---------------------------------------------------------------------------

    def _refresh(self, key: Key, now: float) -> None:
        entry = self._keys[key]
        entry.last_used = now
        entry.expires_at = now + self.ttl_seconds if self.ttl_seconds is not None else None
        self._keys.move_to_end(key)

    def _forget(self, key: Key) -> NamedPrefix | None:
        entry = self._keys.pop(key, None)
        if entry is not None:
            self._unpin(entry.block_hashes)
        return entry

    def _pin(self, blocks: Sequence[bytes]) -> None:
        self.store.pin(blocks)
        for block in blocks:
            self._pins[block] = self._pins.get(block, 0) + 1

    def _unpin(self, blocks: Sequence[bytes]) -> None:
        self.store.unpin(blocks)
        for block in blocks:
            if self._pins[block] == 1:
                del self._pins[block]
            else:
                self._pins[block] -= 1

    def _report(self, entry: NamedPrefix) -> NamedPrefix:
        """A copy of ``entry`` with where its blocks are now (the caller cannot change the registry through it)."""
        names, index = self.store.tier_names, self.store.index
        counts = dict.fromkeys(names, 0)
        for block in entry.block_hashes:
            held = index.tiers_of(block)
            for position, name in enumerate(names):
                if held & (1 << position):
                    counts[name] += 1
        complete = [name for name in names if entry.block_hashes and counts[name] == len(entry.block_hashes)]
        return replace(entry, tiers=PrefixPlacement(complete, counts))
