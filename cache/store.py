"""The tiered KV store: L1 (the live block pool), L2 and L3 tiers, one radix index over all three.

    request prefix ─► match_prefix ─► L1 hit: share the block
                                   └► L2/L3 hit: load into free L1 blocks (promotion)
    full block computed ─► register in L1 (+ write through to L3 when persistence is on)
    L1 block evicted for reuse ─► demote to L2 ─► L2 eviction demotes to L3 ─► L3 drops leaves first

A hit never covers a prompt's last token (its logits are needed), and a block
is only reused if its stored tokens equal the request's (hash collisions can
never produce wrong output).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import structlog

from tierserve.cache.block_pool import Block, BlockPool
from tierserve.cache.hashing import extend_hashes, root_hash
from tierserve.cache.radix import L1, L2, L3, TIER_NAMES, RadixIndex
from tierserve.cache.tier import CacheEntry, CacheTier, TierStats

if TYPE_CHECKING:
    import torch

    from tierserve.core.sequence import Sequence

log = structlog.get_logger(__name__)


class KVTransfer(Protocol):
    """Copies blocks between the backend's arena and CPU tensors ``[n, layers, 2, block_size, kv_heads, head_dim]``."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None: ...


class PrefixMatch(NamedTuple):
    """One lookup's accounting: usable blocks, blocks served per tier name, seconds spent."""

    lookup_blocks: int
    hits: dict[str, int]
    seconds: float


@dataclass
class StoreStats:
    """Counters of the whole store (per-tier counters live on each tier)."""

    lookups: int = 0
    l1_hits: int = 0
    l1_misses: int = 0
    promotions: dict[str, int] = field(default_factory=lambda: {"l2": 0, "l3": 0})
    demotions: dict[str, int] = field(default_factory=lambda: {"l2": 0, "l3": 0})
    write_through: int = 0
    prefix_matches: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    token_mismatches: int = 0
    lookup_seconds: float = 0.0


class TieredStore:
    """Prefix reuse across the block pool and the tiers below it.

    Args:
        pool: the L1 block pool (its ``on_evict`` is taken over for write-back).
        transfer: the backend's block copier.
        fingerprint: the model fingerprint; every hash is rooted in it.
        l2, l3: the tiers below L1, either may be ``None``.
        write_through: also write every newly computed block to L3 (persistence).
    """

    def __init__(
        self,
        pool: BlockPool,
        transfer: KVTransfer,
        fingerprint: str,
        l2: CacheTier | None = None,
        l3: CacheTier | None = None,
        write_through: bool = False,
    ) -> None:
        self.pool = pool
        self.transfer = transfer
        self.fingerprint = fingerprint
        self.block_size = pool.block_size
        self.tiers: dict[int, CacheTier] = {level: tier for level, tier in ((L2, l2), (L3, l3)) if tier is not None}
        self.write_through = write_through and l3 is not None
        self.index = RadixIndex()
        self.stats = StoreStats()
        self.l1_stats = TierStats()
        self._last_tier = max(self.tiers) if self.tiers else None
        self.tiers_by_name = {TIER_NAMES[level]: tier for level, tier in self.tiers.items()}
        pool.on_evict = self._demote_from_l1
        for level, tier in self.tiers.items():  # what survived a restart (L3 with persistence)
            for key in tier.keys():
                self._index_add(key, tier.parent_of(key), level)

    @property
    def tier_names(self) -> list[str]:
        return ["l1", *(TIER_NAMES[level] for level in sorted(self.tiers))]

    # ---- lookups ------------------------------------------------------------

    def root_for(self, cache_salt: str | None) -> bytes:
        return root_hash(self.fingerprint, self.block_size, cache_salt)

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Give a new (or preempted) sequence the longest cached prefix of its tokens.

        Fills ``seq.block_table`` with shared or promoted blocks and advances
        ``num_computed_tokens``/``num_cached_tokens``; only the rest is prefilled.
        """
        started = time.perf_counter()
        self._sync_removed()
        bs = self.block_size
        usable = (seq.num_tokens - 1) // bs  # never the last token: its logits are needed
        root = self.root_for(seq.cache_salt)
        extend_hashes(seq.block_hashes, root, seq.token_ids, bs, usable * bs)
        self.stats.lookups += 1

        plan: list[int | tuple[int, CacheEntry]] = []  # per block: an L1 block (shared) or (tier, entry) to promote
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
        for position, item in enumerate(plan):
            block_id = item if isinstance(item, int) else next(promoted, None)
            if block_id is None:  # the pool ran short: keep the prefix that fits
                self.pool.free([i for i in plan[position:] if isinstance(i, int)])
                break
            table.append(block_id)
        seq.block_table[:] = table
        cached = len(seq.block_table) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        seq.num_registered_blocks = len(seq.block_table)
        if cached:
            self.stats.prefix_matches += 1
        self.stats.cached_tokens += cached
        elapsed = time.perf_counter() - started
        self.stats.lookup_seconds += elapsed
        seq.cache_lookup_seconds += elapsed
        hits: dict[str, int] = {}
        for item in plan[: len(seq.block_table)]:
            name = "l1" if isinstance(item, int) else TIER_NAMES[item[0]]
            hits[name] = hits.get(name, 0) + 1
        return PrefixMatch(usable, hits, elapsed)

    def _fetch_below(self, key: bytes, tokens: tuple[int, ...]) -> tuple[int, CacheEntry] | None:
        tiers = self.index.tiers_of(key)
        for level in (L2, L3):
            if not tiers & level:
                continue
            entry = self.tiers[level].get(key)
            if entry is None:  # expired or corrupt: the tier removed it
                self._index_discard(key, level)
                continue
            if entry.token_ids != tokens:
                self.stats.token_mismatches += 1
                continue
            return level, entry
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
        for block_id, (level, entry) in zip(block_ids, found):
            self.stats.promotions[TIER_NAMES[level]] += 1
            if self.pool.register(block_id, entry.key, entry.parent, entry.token_ids):
                self._index_add(entry.key, entry.parent, L1)
        return block_ids

    # ---- publishing computed blocks ----------------------------------------------

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed blocks (and write them through to L3)."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks or not seq.use_prefix_cache:
            return
        self._sync_removed()
        bs = self.block_size
        extend_hashes(seq.block_hashes, self.root_for(seq.cache_salt), seq.token_ids, bs, full * bs)
        fresh: list[tuple[int, bytes, bytes | None, tuple[int, ...]]] = []
        for index in range(seq.num_registered_blocks, full):
            key = seq.block_hashes[index]
            parent = seq.block_hashes[index - 1] if index else None
            tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            block_id = seq.block_table[index]
            if self.pool.register(block_id, key, parent, tokens):
                self._index_add(key, parent, L1)
                if self.write_through and not self.index.tiers_of(key) & L3:
                    fresh.append((block_id, key, parent, tokens))
        self.stats.computed_tokens += (full - seq.num_registered_blocks) * bs
        seq.num_registered_blocks = full
        if fresh:
            # one copy off the pool; each entry is a view of it, so the batch is freed once all are written
            data = self.transfer.read_blocks([block_id for block_id, *_ in fresh])
            for (_, key, parent, tokens), kv in zip(fresh, data):
                self._put(L3, CacheEntry(key, parent, tokens, kv))
                self.stats.write_through += 1

    # ---- demotion -------------------------------------------------------------------

    def _demote_from_l1(self, block: Block) -> None:
        key, parent, tokens = block.block_hash, block.parent_hash, block.token_ids
        self._index_discard(key, L1)
        held = self.index.tiers_of(key)
        target = next((level for level in (L2, L3) if level in self.tiers and not held & level), None)
        if target is None or (target == L3 and held & L2):
            return
        kv = self.transfer.read_blocks([block.block_id])[0]  # a fresh copy already, exactly one block
        self._put(target, CacheEntry(key, parent, tokens, kv))
        self.stats.demotions[TIER_NAMES[target]] += 1

    def _put(self, level: int, entry: CacheEntry) -> None:
        tier = self.tiers[level]
        evicted = tier.put(entry)
        if tier.contains(entry.key):
            self._index_add(entry.key, entry.parent, level)
        for gone in evicted:
            if gone.key != entry.key:
                self._index_discard(gone.key, level)
            if level == L2 and L3 in self.tiers and not self.index.tiers_of(gone.key) & L3:
                self._put(L3, gone)
                self.stats.demotions["l3"] += 1

    # ---- index upkeep (leaves first in the last tier) -----------------------------------

    def _sync_removed(self) -> None:
        """Follow what tiers dropped by themselves (disk evictions and failed writes happen on their threads)."""
        for level, tier in self.tiers.items():
            for key in tier.drain_removed():
                if not tier.contains(key):
                    self._index_discard(key, level)

    def _index_add(self, key: bytes, parent: bytes | None, level: int) -> None:
        new = self.index.add(key, parent, level)
        last = self._last_tier
        if last is None:
            return
        if new and parent is not None and self.index.num_children(parent) == 1:
            if self.index.tiers_of(parent) & last:
                self.tiers[last].pin(parent)  # a cached child needs it: not a victim any more
        if level == last and self.index.num_children(key):
            self.tiers[last].pin(key)

    def _index_discard(self, key: bytes, level: int) -> None:
        parent = self.index.parent_of(key)
        gone = self.index.discard(key, level)
        last = self._last_tier
        if gone and last is not None and parent is not None and not self.index.num_children(parent):
            if self.index.tiers_of(parent) & last:
                self.tiers[last].unpin(parent)

    # ---- management ---------------------------------------------------------------------

    def clear(self, tier: str = "all") -> dict[str, int]:
        """Drop cached blocks of one tier (``l1``, ``l2``, ``l3``) or ``all``; blocks in use keep their data."""
        allowed = {"l1", "l2", "l3", "all"}
        if tier not in allowed:
            raise ValueError(f"tier: got {tier!r}, allowed: {', '.join(sorted(allowed))}")
        removed: dict[str, int] = {}
        if tier in ("l1", "all"):
            keys = [key for key in list(self.pool.cached)]
            for key in keys:
                self.pool.uncache(key)
                self._index_discard(key, L1)
            removed["l1"] = len(keys)
        for level, name in ((L2, "l2"), (L3, "l3")):
            if tier in (name, "all") and level in self.tiers:
                removed[name] = self.tiers[level].clear()
                for key in [k for k, node in self.index.nodes.items() if node.tiers & level]:
                    self._index_discard(key, level)
        return removed

    def offload(self) -> int:
        """Move L1's unreferenced cached blocks to the tier below (L2, else L3) and free them in L1.

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

    def snapshot(self) -> dict[str, object]:
        """Statistics of every tier and of the index, as plain data."""

        def tier_stats(stats: TierStats, entries: int, stored: int) -> dict[str, object]:
            return {
                "hits": stats.hits,
                "misses": stats.misses,
                "hit_rate": round(stats.hit_rate, 4),
                "entries": entries,
                "bytes": stored,
                "evictions": stats.evictions,
                "expirations": stats.expirations,
                "corrupt": stats.corrupt,
                "dropped_writes": stats.dropped_writes,
                "write_errors": stats.write_errors,
                "get_seconds": round(stats.get_seconds, 6),
                "put_seconds": round(stats.put_seconds, 6),
                "compression_ratio": round(stats.compression_ratio, 3),
            }

        self._sync_removed()
        self.l1_stats.evictions = self.pool.evictions
        tiers = {"l1": tier_stats(self.l1_stats, len(self.pool.cached), 0)}
        tiers["l1"]["blocks_total"] = self.pool.num_blocks
        tiers["l1"]["blocks_free"] = self.pool.num_free_blocks
        for level, tier in self.tiers.items():
            tiers[TIER_NAMES[level]] = tier_stats(tier.stats, len(tier), tier.bytes_used)
        s = self.stats
        return {
            "tiers": tiers,
            "index": self.index.stats(self.block_size),
            "lookups": s.lookups,
            "prefix_matches": s.prefix_matches,
            "promotions": dict(s.promotions),
            "demotions": dict(s.demotions),
            "write_through": s.write_through,
            "cached_tokens": s.cached_tokens,
            "computed_tokens": s.computed_tokens,
            "token_mismatches": s.token_mismatches,
            "lookup_seconds": round(s.lookup_seconds, 6),
        }

    def check_integrity(self) -> None:
        """The pool's and the index's invariants, and that they agree with every tier
        (queued background writes are settled first: a check is about a quiet store)."""
        self.flush()
        self._sync_removed()
        self.pool.check_integrity()
        self.index.check_integrity()
        in_l1 = {key for key, node in self.index.nodes.items() if node.tiers & L1}
        assert in_l1 == set(self.pool.cached), "radix index and block pool disagree about L1"
        for level, tier in self.tiers.items():
            indexed = {key for key, node in self.index.nodes.items() if node.tiers & level}
            assert indexed == set(tier.keys()), f"radix index and {TIER_NAMES[level]} disagree"

    def flush(self) -> None:
        for tier in self.tiers.values():
            tier.flush()

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
