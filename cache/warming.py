"""Warming: promote the most used prefixes (``cache.frequency``) from the tiers below into the faster ones.

    for each prefix, best first, each block parents first:
        not in L1                  ─► read from the fastest tier below that holds it ─► a free L1 block
        only the last tier below   ─► also put into the first tier below (e.g. L3 → L2)

Blocks loaded into L1 are cached blocks no sequence uses once the warm is
over: the L1 policy may evict them as any other (they are not pinned). While
the warm runs it holds every block of the prefix it works on, so its own
allocations never evict what it just loaded; an allocation only takes free or
unpinned cached blocks, so pinned and in-use blocks are never evicted, and a
lower tier only ever evicts its unpinned entries. A read for warming is not a
use: the access count it adds is taken back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierserve.cache.frequency import ranked_prefixes
from tierserve.cache.placement import L1
from tierserve.cache.tier import CacheEntry

if TYPE_CHECKING:
    from tierserve.cache.store import TieredStore


@dataclass(slots=True)
class WarmReport:
    """What one ``TieredStore.warm_frequent`` did.

    Attributes:
        prefixes: prefixes at least one of whose blocks was promoted.
        blocks: blocks promoted, per target tier name (``"l1"``, and the first tier below when there are two or more).
        tokens: tokens of the blocks promoted into L1.
        skipped: blocks left where they were, by reason (``"no room in l1"``,
            ``"unreadable in l3"`` (expired or corrupt), ``"parent not warmed"``, ...).
    """

    prefixes: int = 0
    blocks: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str, blocks: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + blocks


class _Warm:
    """One warm: the blocks it holds in L1 and what it may still do."""

    def __init__(self, store: TieredStore, limit_blocks: int) -> None:
        self.store = store
        self.budget = limit_blocks
        self.second = 1 if len(store.tiers) >= 2 else None  # the first tier below, fed from the last
        self.report = WarmReport(blocks=dict.fromkeys(store.tier_names[: 2 if self.second else 1], 0))
        self.held: list[int] = []  # L1 blocks held until the end, in the order they were reached
        self.seen: set[bytes] = set()
        self.in_second: set[bytes] = set()  # blocks this warm put into the first tier below
        self.second_full = self.second is None

    def run(self) -> WarmReport:
        try:
            for chain in ranked_prefixes(self.store):
                if self.budget <= 0 or (self.second_full and not self.store.pool.num_free_blocks):
                    break  # nothing more can move: L1 only loses free blocks while a warm holds its own
                if self._warm_prefix(chain):
                    self.report.prefixes += 1
        finally:
            # the best prefix's first block is released last: the most recent use for the L1 policy
            self.store.pool.free(self.held[::-1])
        if self.second is not None:  # what is still there: L1's evictions may have pushed some on down
            self.store.placement.sync_removed()
            name = self.store.tier_names[self.second]
            kept = sum(1 for key in self.in_second if self.store.placement.holds(key, self.second))
            if kept < len(self.in_second):
                self.report.skip(f"no room in {name}", len(self.in_second) - kept)
            self.report.blocks[name] = kept
        self.report.tokens = self.report.blocks["l1"] * self.store.block_size
        return self.report

    def _warm_prefix(self, chain: list[bytes]) -> bool:
        """Into L1 block by block, parents first; then, the prefix's blocks wanted in the first tier
        below, after L1 has pushed its victims there (so they do not push these out)."""
        promoted = False
        for_second: list[CacheEntry] = []
        for step, key in enumerate(chain):
            if key in self.seen:
                continue
            if self.budget <= 0:
                break
            self.seen.add(key)
            outcome = self._warm_block(key, for_second)
            if outcome is None:  # this block could not be read: its descendants cannot be served from above it
                self.report.skip("parent not warmed", len(chain) - step - 1)
                break
            if outcome:
                promoted = True
                self.budget -= 1
        for entry in for_second:
            self._into_second(entry)
        return promoted

    def _warm_block(self, key: bytes, for_second: list[CacheEntry]) -> bool | None:
        """Promote one block into L1 where wanted, and queue it for the first tier below where wanted;
        True if it moves, False if not, None if it could not be read."""
        store, placement = self.store, self.store.placement
        pool = store.pool
        block_id = pool.cached.get(key)
        if block_id is not None:
            pool.share(block_id, hit=False)  # held, so this warm's allocations cannot evict it
            self.held.append(block_id)
        holders = [p for p in range(1, len(store.tiers) + 1) if placement.holds(key, p)]
        if not holders:
            return False
        to_l1 = block_id is None
        if to_l1 and not pool.num_free_blocks:
            self.report.skip("no room in l1")
            to_l1 = False
        to_second = self.second is not None and holders[0] == len(store.tiers)
        if to_second and self.second_full:
            self.report.skip(f"no room in {store.tier_names[self.second]}")
            to_second = False
        if not (to_l1 or to_second):
            return False
        source = holders[0]
        tier = store.tiers[source - 1].tier
        entry = tier.get(key)
        if entry is None:  # expired or corrupt: the tier dropped it
            placement.discard(key, source)
            self.report.skip(f"unreadable in {store.tier_names[source]}")
            return None
        tier.add_accesses(key, -1)  # a warming read is not a use
        if to_l1:
            self.held += store.promote([(source, entry)])
            self.report.blocks["l1"] += 1
        if to_second:
            for_second.append(CacheEntry(entry.key, entry.parent, entry.token_ids, entry.kv, entry.created))
        return True

    def _into_second(self, entry: CacheEntry) -> None:
        if self.second_full:
            self.report.skip(f"no room in {self.store.tier_names[self.second]}")
            return
        evicted = self.store.put_below(self.second, entry)
        if entry.key in evicted or self.in_second.intersection(evicted):
            # full of what this warm (or a pin) put there: stop before it pushes out more of its own work
            self.second_full = True
        if entry.key not in evicted:
            self.in_second.add(entry.key)
        else:
            self.report.skip(f"no room in {self.store.tier_names[self.second]}")


def warm_frequent(store: TieredStore, limit_blocks: int) -> WarmReport:
    """Promote the blocks of the most used prefixes, best first, up to ``limit_blocks`` blocks
    (a block promoted into L1 and into the first tier below counts once)."""
    if limit_blocks < 0:
        raise ValueError(f"limit_blocks must be >= 0, got {limit_blocks}")
    return _Warm(store, limit_blocks).run()
