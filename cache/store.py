"""The tiered KV store: L1 (the live block pool) above an ordered list of tiers, one hash index over all.

    request prefix ─► match_prefix ─► L1 hit: share the block
                                   └► hit below (first tier in order): load into free L1 blocks (promotion)
    full block computed ─► register in L1 (+ write through to every write-through tier)
    L1 block evicted for reuse ─► demote to the first tier below ─► its evictions go to the next tier
        ─► ... ─► the last tier drops leaves first

A hit never covers a prompt's last token (its logits are needed), and a block
is only reused if its stored tokens equal the request's (hash collisions can
never produce wrong output). Tier names come from the caller (settings); the
index marks a block held by the tier at position ``i`` of ``tier_names`` with
bit ``1 << i`` (L1 is bit 0).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tierserve.cache.block_pool import Block, BlockPool
from tierserve.cache.hash_index import BlockHashIndex
from tierserve.cache.hashing import extend_hashes, root_hash
from tierserve.cache.stats import CacheSnapshot, PrefixMatch, StoreStats, TierSnapshot, TierStats
from tierserve.cache.tier import CacheEntry, CacheTier

if TYPE_CHECKING:
    import torch

    from tierserve.core.sequence import Sequence

L1 = 0  # position of the block pool in ``tier_names``
RESERVED_NAMES = ("l1", "all")


class KVTransfer(Protocol):
    """Copies blocks between the backend's arena and CPU tensors ``[n, layers, 2, block_size, kv_heads, head_dim]``."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None: ...


@dataclass(slots=True)
class StoreTier:
    """A tier below L1, as the store uses it.

    Attributes:
        name: how statistics and ``clear`` name it (from settings, e.g. ``"l2"``,
            ``"l3"``, ``"redis"``); ``"l1"`` and ``"all"`` are reserved.
        tier: the storage.
        write_through: also write every newly computed block here
            (persistence). Entries written through are views of one batched
            copy off the pool: a tier that keeps tensors as given keeps that
            batch alive, so write through to tiers that encode (disk).
    """

    name: str
    tier: CacheTier
    write_through: bool = False


class TieredStore:
    """Prefix reuse across the block pool and the tiers below it.

    Args:
        pool: the L1 block pool (its ``on_evict`` is taken over for write-back).
        transfer: the backend's block copier; may be ``None`` only without lower tiers.
        fingerprint: the model fingerprint; every hash is rooted in it.
        tiers: the tiers below L1, in the order data moves down.

    Attributes:
        tier_names: ``"l1"`` then the names of ``tiers`` in order; the index
            marks a block held at position ``i`` with bit ``1 << i``.
    """

    def __init__(
        self, pool: BlockPool, transfer: KVTransfer | None, fingerprint: str, tiers: Seq[StoreTier] = ()
    ) -> None:
        names = [t.name for t in tiers]
        for name in names:
            if not name or name in RESERVED_NAMES or names.count(name) > 1:
                raise ValueError(
                    f"cache tier name {name!r}: names must be non-empty and distinct, "
                    f"and {' and '.join(RESERVED_NAMES)} are reserved; got {names}"
                )
        if tiers and transfer is None:
            raise ValueError("a store with tiers below L1 needs a transfer to copy blocks to and from the pool")
        self.pool = pool
        self.transfer = transfer
        self.fingerprint = fingerprint
        self.block_size = pool.block_size
        self.tiers = list(tiers)
        self.tier_names = ["l1", *names]
        self.index = BlockHashIndex()
        self.stats = StoreStats.for_tiers(names)
        self.l1_stats = TierStats()
        self._last = len(self.tiers) or None  # where eviction means loss: leaves go first
        self._write_through = [position for position, t in enumerate(self.tiers, 1) if t.write_through]
        pool.on_evict = self._demote_from_l1
        for position, store_tier in enumerate(self.tiers, 1):  # what survived a restart (persistent tiers)
            for key in store_tier.tier.keys():
                self._index_add(key, store_tier.tier.parent_of(key), position)

    # ---- lookups ------------------------------------------------------------

    def root_for(self, cache_salt: str | None) -> bytes:
        """The hash every prompt's first block chains from, for this model and tenant."""
        return root_hash(self.fingerprint, self.block_size, cache_salt)

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Give a new (or preempted) sequence the longest cached prefix of its tokens.

        Fills ``seq.block_table`` with shared or promoted blocks and advances
        ``num_computed_tokens``/``num_cached_tokens``; only the rest is prefilled.
        Returns where the blocks came from (all zero when the sequence opted out).
        """
        hits = dict.fromkeys(self.tier_names, 0)
        if not seq.use_prefix_cache:
            return PrefixMatch(0, hits, 0.0)
        started = time.perf_counter()
        self._sync_removed()
        bs = self.block_size
        usable = (seq.num_tokens - 1) // bs  # never the last token: its logits are needed
        extend_hashes(seq.block_hashes, self.root_for(seq.cache_salt), seq.token_ids, bs, usable * bs)
        self.stats.lookups += 1

        plan: list[int | tuple[int, CacheEntry]] = []  # per block: an L1 block (shared) or (position, entry) to promote
        for index in range(usable):
            key = seq.block_hashes[index]
            tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            block_id = self.pool.lookup(key, tokens)
            if block_id is not None:
                self.pool.share(block_id)
                plan.append(block_id)
                continue
            found = self._fetch_below(key, tokens)
            if found is None:
                break
            plan.append(found)
        shared = sum(1 for item in plan if isinstance(item, int))
        self.l1_stats.hits += shared
        self.l1_stats.misses += usable - shared

        promoted = iter(self._promote([item for item in plan if isinstance(item, tuple)]))
        table: list[int] = []
        for step, item in enumerate(plan):
            block_id, position = (item, L1) if isinstance(item, int) else (next(promoted, None), item[0])
            if block_id is None:  # the pool ran short: keep the prefix that fits
                self.pool.free([i for i in plan[step:] if isinstance(i, int)])
                break
            table.append(block_id)
            hits[self.tier_names[position]] += 1
        seq.block_table[:] = table
        cached = len(table) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        seq.num_registered_blocks = len(table)
        if cached:
            self.stats.prefix_matches += 1
        self.stats.cached_tokens += cached
        elapsed = time.perf_counter() - started
        self.stats.lookup_seconds += elapsed
        seq.cache_lookup_seconds += elapsed
        return PrefixMatch(usable, hits, elapsed)

    def _fetch_below(self, key: bytes, tokens: tuple[int, ...]) -> tuple[int, CacheEntry] | None:
        held = self.index.tiers_of(key)
        for position, store_tier in enumerate(self.tiers, 1):
            if not held & (1 << position):
                continue
            entry = store_tier.tier.get(key)
            if entry is None:  # expired or corrupt: the tier removed it
                self._index_discard(key, position)
                continue
            if entry.token_ids != tokens:
                self.stats.token_mismatches += 1
                continue
            return position, entry
        return None

    def _promote(self, found: list[tuple[int, CacheEntry]]) -> list[int]:
        """Load entries into free L1 blocks in one copy; fewer if the pool is short."""
        count = min(len(found), self.pool.num_free_blocks)
        if not count:
            return []
        import torch

        found = found[:count]
        block_ids = self.pool.allocate(count)
        self.transfer.write_blocks(block_ids, torch.stack([entry.kv for _, entry in found]))
        for block_id, (position, entry) in zip(block_ids, found):
            self.stats.promotions[self.tier_names[position]] += 1
            if self.pool.register(block_id, entry.key, entry.parent, entry.token_ids):
                self._index_add(entry.key, entry.parent, L1)
        return block_ids

    # ---- publishing computed blocks ----------------------------------------------

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed blocks (and write them through where asked)."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks or not seq.use_prefix_cache:
            return
        self._sync_removed()
        bs = self.block_size
        extend_hashes(seq.block_hashes, self.root_for(seq.cache_salt), seq.token_ids, bs, full * bs)
        fresh: list[tuple[int, bytes, bytes | None, tuple[int, ...], list[int]]] = []  # ..., tiers to write
        for index in range(seq.num_registered_blocks, full):
            key = seq.block_hashes[index]
            parent = seq.block_hashes[index - 1] if index else None
            tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            block_id = seq.block_table[index]
            if self.pool.register(block_id, key, parent, tokens):
                self._index_add(key, parent, L1)
                held = self.index.tiers_of(key)
                targets = [position for position in self._write_through if not held & (1 << position)]
                if targets:
                    fresh.append((block_id, key, parent, tokens, targets))
        self.stats.computed_tokens += (full - seq.num_registered_blocks) * bs
        seq.num_registered_blocks = full
        if fresh:
            # one copy off the pool; each entry is a view of it, so the batch is freed once all are written
            data = self.transfer.read_blocks([block_id for block_id, *_ in fresh])
            for (_, key, parent, tokens, targets), kv in zip(fresh, data):
                for position in targets:
                    self._put(position, CacheEntry(key, parent, tokens, kv))
                    self.stats.write_through += 1

    # ---- demotion -------------------------------------------------------------------

    def _demote_from_l1(self, block: Block) -> None:
        """Write an evicted L1 block to the first tier below, unless that tier holds it already."""
        key, parent, tokens = block.block_hash, block.parent_hash, block.token_ids
        self._index_discard(key, L1)
        if not self.tiers or self.index.tiers_of(key) & (1 << 1):
            return
        kv = self.transfer.read_blocks([block.block_id])[0]  # a fresh copy already, exactly one block
        self._put(1, CacheEntry(key, parent, tokens, kv))
        self.stats.demotions[self.tier_names[1]] += 1

    def _put(self, position: int, entry: CacheEntry) -> None:
        """Store ``entry`` in the tier at ``position``; what it evicts goes to the next tier down."""
        tier = self.tiers[position - 1].tier
        evicted = tier.put(entry)
        if tier.contains(entry.key):
            self._index_add(entry.key, entry.parent, position)
        below = position + 1
        for gone in evicted:
            if gone.key != entry.key:
                self._index_discard(gone.key, position)
            if below <= len(self.tiers) and not self.index.tiers_of(gone.key) & (1 << below):
                self._put(below, gone)
                self.stats.demotions[self.tier_names[below]] += 1

    # ---- index upkeep (leaves first in the last tier) -----------------------------------

    def _sync_removed(self) -> None:
        """Follow what tiers dropped by themselves (disk evictions and failed writes happen on their threads)."""
        for position, store_tier in enumerate(self.tiers, 1):
            for key in store_tier.tier.drain_removed():
                if not store_tier.tier.contains(key):
                    self._index_discard(key, position)

    def _index_add(self, key: bytes, parent: bytes | None, position: int) -> None:
        new = self.index.add(key, parent, 1 << position)
        last = self._last
        if last is None:
            return
        last_tier = self.tiers[last - 1].tier
        if new and parent is not None and self.index.num_children(parent) == 1:
            if self.index.tiers_of(parent) & (1 << last):
                last_tier.pin(parent)  # a cached child needs it: not a victim any more
        if position == last and self.index.num_children(key):
            last_tier.pin(key)

    def _index_discard(self, key: bytes, position: int) -> None:
        parent = self.index.parent_of(key)
        gone = self.index.discard(key, 1 << position)
        last = self._last
        if gone and last is not None and parent is not None and not self.index.num_children(parent):
            if self.index.tiers_of(parent) & (1 << last):
                self.tiers[last - 1].tier.unpin(parent)

    # ---- management ---------------------------------------------------------------------

    def clear(self, tier: str = "all") -> dict[str, int]:
        """Drop the cached blocks of one tier (a name in ``tier_names``) or ``all``; blocks in
        use keep their data. Returns the blocks removed per tier name."""
        allowed = [*self.tier_names, "all"]
        if tier not in allowed:
            raise ValueError(f"tier: got {tier!r}, allowed: {', '.join(allowed)}")
        removed: dict[str, int] = {}
        if tier in ("l1", "all"):
            keys = list(self.pool.cached)
            for key in keys:
                self.pool.uncache(key)
                self._index_discard(key, L1)
            removed["l1"] = len(keys)
        for position, store_tier in enumerate(self.tiers, 1):
            if tier in (store_tier.name, "all"):
                removed[store_tier.name] = store_tier.tier.clear()
                for key in self.index.keys_held_by(1 << position):
                    self._index_discard(key, position)
        return removed

    def offload(self) -> int:
        """Move L1's unreferenced cached blocks to the first tier below and free them in L1.

        The prefixes stay servable (a later hit promotes them back); blocks in
        use by running sequences stay where they are. Returns the blocks moved.
        """
        if not self.tiers:
            return 0
        # registration order puts parents before children; children go first so a
        # full lower tier evicts leaves before the prefixes they extend
        idle = [key for key, block_id in self.pool.cached.items() if self.pool.blocks[block_id].ref_count == 0]
        for key in reversed(idle):
            self._demote_from_l1(self.pool.blocks[self.pool.cached[key]])
            self.pool.uncache(key)
        return len(idle)

    def snapshot(self) -> CacheSnapshot:
        """Statistics of every tier and of the index; O(number of tiers), no walk over entries."""
        self._sync_removed()
        pool = self.pool
        self.l1_stats.evictions = pool.evictions
        tiers = {
            "l1": TierSnapshot.of(
                "l1", self.l1_stats, len(pool.cached), 0, pool.num_blocks, pool.num_free_blocks, medium="arena"
            )
        }
        for store_tier in self.tiers:
            tier = store_tier.tier
            tiers[store_tier.name] = TierSnapshot.of(
                store_tier.name, tier.stats, len(tier), tier.bytes_used, medium=tier.medium
            )
        s = self.stats
        return CacheSnapshot(
            tiers=tiers,
            index=self.index.stats(self.block_size),
            lookups=s.lookups,
            prefix_matches=s.prefix_matches,
            promotions=dict(s.promotions),
            demotions=dict(s.demotions),
            write_through=s.write_through,
            cached_tokens=s.cached_tokens,
            computed_tokens=s.computed_tokens,
            token_mismatches=s.token_mismatches,
            lookup_seconds=s.lookup_seconds,
        )

    def check_integrity(self) -> None:
        """The pool's and the index's invariants, and that they agree with every tier
        (queued background writes are settled first: a check is about a quiet store)."""
        self.flush()
        self._sync_removed()
        self.pool.check_integrity()
        self.index.check_integrity()
        in_l1 = set(self.index.keys_held_by(1 << L1))
        assert in_l1 == set(self.pool.cached), "hash index and block pool disagree about l1"
        for position, store_tier in enumerate(self.tiers, 1):
            indexed = set(self.index.keys_held_by(1 << position))
            assert indexed == set(store_tier.tier.keys()), f"hash index and tier {store_tier.name} disagree"

    def flush(self) -> None:
        """Wait until every tier's queued background writes are on their medium."""
        for store_tier in self.tiers:
            store_tier.tier.flush()

    def close(self) -> None:
        """Flush and release every tier."""
        for store_tier in self.tiers:
            store_tier.tier.close()
