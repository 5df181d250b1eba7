"""The tiered KV store: L1 (the live block pool) above an ordered list of tiers, one hash index over all.

    request prefix ─► match_prefix ─► L1 hit: share the block
                                   └► hit below (first tier in order): load into free L1 blocks (promotion)
    waiting prompt ─► start_load ─► loader thread reads its blocks below L1 ─► match_prefix(loaded) promotes them
                      (the scheduler runs others meanwhile; a load past ``load_timeout`` is computed instead)
    full block computed ─► register in L1 (+ write through to every write-through tier)
    L1 block evicted for reuse ─► demote to the first tier below ─► its evictions go to the next tier
        ─► ... ─► the last tier drops leaves first

A hit never covers a prompt's last token (its logits are needed), and a block
is only reused if its stored tokens equal the request's (hash collisions can
never produce wrong output). Tier names come from the caller (settings); the
index marks a block held by the tier at position ``i`` of ``tier_names`` with
bit ``1 << i`` (L1 is bit 0).

Pins are counted per block (``cache.pins``): a named prefix pins its blocks
in every tier, and the last tier pins a block that cached children need.
Access counts follow a block down: a demoted block carries the uses it had
above to the tier that takes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from tierserve.cache import frequency, warming
from tierserve.cache.block_pool import Block, BlockPool
from tierserve.cache.hashing import extend_hashes, root_hash
from tierserve.cache.kv_events import KVEventLog
from tierserve.cache.placement import L1, Placement
from tierserve.cache.stats import CacheSnapshot, PrefixMatch, StoreStats, TierSnapshot, TierStats
from tierserve.cache.store_tier import KVTransfer, StoreTier
from tierserve.cache.tier import CacheEntry
from tierserve.cache.warm_writes import WarmWrites
from tierserve.cache.warming import WarmReport

if TYPE_CHECKING:
    from tierserve.core.sequence import Sequence

log = structlog.get_logger(__name__)

RESERVED_NAMES = ("l1", "all")
LOAD_TIMEOUT_SECONDS = 5.0
QUEUED_LIMITS = 4  # a read waits in the loader's queue at most this many time limits


@dataclass(slots=True)
class PrefixLoad:
    """A waiting prompt's blocks below L1, read on the store's loader thread (``TieredStore.start_load``):
    ``(position, entry)`` per block, in prompt order, up to the first one no tier had.

    The time limit runs from when the loader starts the read (loads queue behind each other on its one thread:
    eight prompts arriving together must not time out for their place in the queue), and a read still queued
    after ``QUEUED_LIMITS`` limits is given up too (a read ahead of it hung)."""

    future: Future
    timeout: float
    queued: float = 0.0  # time.monotonic() when it was submitted
    started: float | None = None  # when the loader began it

    @property
    def settled(self) -> bool:
        """Read, failed, or past its time limit: the prompt can be matched now."""
        if self.future.done():
            return True
        now = time.monotonic()
        if self.started is not None:
            return now >= self.started + self.timeout
        return now >= self.queued + QUEUED_LIMITS * self.timeout

    def entries(self, stats: StoreStats) -> list[tuple[int, CacheEntry]]:
        """What was read (none when the read failed or is late: those tokens are computed, and counted)."""
        if not self.future.done():
            stats.load_timeouts += 1
            self.future.cancel()
            return []
        try:
            return self.future.result()
        except Exception as exc:  # a tier's error: the prompt computes what it would have read
            stats.load_failures += 1
            log.warning("prefix_load_failed", error=f"{type(exc).__name__}: {exc}")
            return []


class TieredStore:
    """Prefix reuse across the block pool and the tiers below it.

    Args:
        pool: the L1 block pool (its ``on_evict`` is taken over for write-back).
        transfer: the backend's block copier; may be ``None`` only without lower tiers.
        fingerprint: the model fingerprint; every hash is rooted in it.
        tiers: the tiers below L1, in the order data moves down.
        block_bytes: bytes one L1 block takes across all layers (L1's bytes and byte capacity in
            statistics; 0: unknown, reported as 0 bytes and no byte bound).
        reuse_partial_blocks: where a prompt's whole blocks end inside a block L1 holds (one that
            follows the same prefix and starts with some of the prompt's next tokens), copy that
            block into a new one of the sequence's and reuse those tokens too (``match_prefix``).
        partial_min_tokens: the fewest tokens worth that copy (where recomputing a few tokens costs less
            than moving a block through ``transfer``, as on a GPU).
        l1_ttl_seconds: an L1 block cached longer ago than this (computed here, or promoted from a tier that
            still held it) is no longer a hit: a lookup that meets it withdraws it (counted in L1's
            ``expirations``), unless a sequence uses it or it is pinned (``[kv_cache] ttl_seconds``); None or 0:
            never. A block demoted passes down when it was computed, which the tiers' own TTLs count from.

    Attributes:
        tier_names: ``"l1"`` then the names of ``tiers`` in order; the index
            marks a block held at position ``i`` with bit ``1 << i``.
    """

    def __init__(
        self,
        pool: BlockPool,
        transfer: KVTransfer | None,
        fingerprint: str,
        tiers: Seq[StoreTier] = (),
        block_bytes: int = 0,
        reuse_partial_blocks: bool = True,
        partial_min_tokens: int = 1,
        load_timeout: float = LOAD_TIMEOUT_SECONDS,
        l1_ttl_seconds: float | None = None,
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
        self.block_bytes = block_bytes
        self.reuse_partial_blocks = reuse_partial_blocks and transfer is not None
        self.partial_min_tokens = max(1, partial_min_tokens)
        self.tiers = list(tiers)
        self.tier_names = ["l1", *names]
        self.placement = Placement(pool, [t.tier for t in self.tiers], self.tier_names)
        private = {p: name for p, name in enumerate(self.tier_names) if p == L1 or not self.tiers[p - 1].tier.shared}
        # what a fleet's router follows: L1 and the tiers only this engine reads (a shared tier is everyone's)
        self.events = self.placement.events = KVEventLog(private, lambda p: self.index.keys_held_by(1 << p))
        self.index = self.placement.index
        self.pins = self.placement.pins
        self.stats = StoreStats.for_tiers(names)
        self.l1_stats = TierStats()
        self.l1_ttl = l1_ttl_seconds or None
        self._write_through = [position for position, t in enumerate(self.tiers, 1) if t.write_through]
        self.load_timeout = load_timeout
        self._loader: ThreadPoolExecutor | None = None  # one thread: reads below L1 for waiting prompts
        pool.on_evict = self._demote_from_l1
        for position, store_tier in enumerate(self.tiers, 1):  # what survived a restart (persistent tiers)
            for key in store_tier.tier.keys():
                self.placement.add(key, store_tier.tier.parent_of(key), position)

    # ---- lookups ------------------------------------------------------------

    def root_for(self, cache_salt: str | None) -> bytes:
        """The hash every prompt's first block chains from, for this model and tenant."""
        return root_hash(self.fingerprint, self.block_size, cache_salt)

    def l1_prefix(self, seq: Sequence) -> tuple[int, int]:
        """``(blocks, revived)``: how many leading full blocks of ``seq``'s prompt L1 holds, and how many of them no
        sequence holds now (sharing takes them off the free count). Nothing is touched: no policy, no statistics,
        no tier asked; only ``seq.block_hashes`` is extended (a cache of the prompt's hashes)."""
        if not seq.use_prefix_cache:
            return 0, 0
        bs = self.block_size
        usable = (seq.num_tokens - 1) // bs
        extend_hashes(seq.block_hashes, self.root_for(seq.cache_salt), seq.token_ids, bs, usable * bs)
        found = revived = 0
        pool = self.pool
        for index in range(usable):
            block_id = self._l1_lookup(seq.block_hashes[index], tuple(seq.token_ids[index * bs : (index + 1) * bs]))
            if block_id is None:
                break
            found += 1
            block = pool.blocks[block_id]
            revived += block.ref_count == 0 and block.block_hash not in pool.pinned
        return found, revived

    def _l1_lookup(self, key: bytes, tokens: tuple[int, ...], *, expire: bool = False) -> int | None:
        """The L1 block holding ``key`` with these tokens, unless it is past ``l1_ttl`` (a block a sequence uses,
        or a pinned one, is not); ``expire``: withdraw such a block from L1 (else it is only not found)."""
        block_id = self.pool.lookup(key, tokens)
        if block_id is None or not self._l1_expired(key, block_id):
            return block_id
        if expire:
            self._expire_l1(key)
        return None

    def _l1_aged(self, block: Block) -> bool:
        """Whether ``block`` entered L1 longer than ``l1_ttl`` ago."""
        return self.l1_ttl is not None and time.time() - block.cached_at > self.l1_ttl

    def _l1_expired(self, key: bytes, block_id: int) -> bool:
        """Past ``l1_ttl``, and neither used by a sequence nor pinned: no longer served."""
        block = self.pool.blocks[block_id]
        return self._l1_aged(block) and not block.ref_count and not self.pins.count(key)

    def _expire_l1(self, key: bytes) -> None:
        self.pool.uncache(key)
        self.placement.discard(key, L1)
        self.l1_stats.expirations += 1

    def start_load(self, seq: Sequence) -> PrefixLoad | None:
        """Read, on the loader thread, the blocks of ``seq``'s prompt that follow its L1 prefix and may sit below
        (the index says a tier holds them, or a tier is shared by processes), when one of them would come from
        a tier off host memory (disk, a remote server); None otherwise: reading host memory takes microseconds,
        so ``match_prefix`` reads such blocks itself. The step thread meanwhile runs other sequences;
        ``match_prefix(seq, loaded)`` then promotes what was read without asking a tier. Nothing but the tiers'
        own reads happens off the step thread."""
        if not self.tiers or not seq.use_prefix_cache:
            return None
        self.placement.sync_removed()
        bs, pool = self.block_size, self.pool
        usable = (seq.num_tokens - 1) // bs
        extend_hashes(seq.block_hashes, self.root_for(seq.cache_salt), seq.token_ids, bs, usable * bs)
        slow = sum(1 << position for position, t in enumerate(self.tiers, 1) if t.tier.medium != "memory" or t.tier.shared)
        # key, tokens, the tiers the index says hold it, the tier its read goes to first
        wanted: list[tuple[bytes, tuple[int, ...], int, int]] = []
        off_memory = False
        for index in range(usable):
            key, tokens = seq.block_hashes[index], tuple(seq.token_ids[index * bs : (index + 1) * bs])
            if not wanted and pool.lookup(key, tokens) is not None:
                continue  # the L1 prefix: shared at the match
            held = self.index.tiers_of(key) & ~(1 << L1)
            first = self._first_reader(held, after=0)
            if first is None:  # no tier holds it, and none is shared
                break
            wanted.append((key, tokens, held, first))
            off_memory = off_memory or bool(slow & (1 << first))
        if not wanted or not off_memory:
            return None
        if self._loader is None:
            # at the step's priority: a niced loader (tried at +10, as the tier writers) got so little of two busy
            # cores that reads of 128 blocks took over the 5 s limit and their prompts were computed instead
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="tierserve-kv-load")
        self.stats.loads += 1
        load = PrefixLoad(Future(), self.load_timeout, time.monotonic())

        def read() -> list[tuple[int, CacheEntry]]:
            load.started = time.monotonic()
            return self._read_below(wanted)

        load.future = self._loader.submit(read)
        return load

    def _read_below(self, wanted: list[tuple[bytes, tuple[int, ...], int, int]]) -> list[tuple[int, CacheEntry]]:
        """The loader thread's work: each block from the first tier (in order) that has it, until one none has.
        The blocks that go to the same tier are read in one ``get_many`` (one Redis round trip), which stops at
        the first miss as the match would; a block that tier lacks is then asked of the others one by one.
        Only tier reads: the pool, the index and the store's counters belong to the step thread."""
        found: list[tuple[int, CacheEntry]] = []
        while len(found) < len(wanted):
            start = len(found)
            position = wanted[start][3]
            end = start + 1
            while end < len(wanted) and wanted[end][3] == position:
                end += 1
            run = wanted[start:end]
            for (_, tokens, *_), entry in zip(run, self.tiers[position - 1].tier.get_many([key for key, *_ in run])):
                if entry.token_ids != tokens:
                    break
                found.append((position, entry))
            if len(found) == end:
                continue
            key, tokens, held, _ = wanted[len(found)]  # missed where it was first asked: the tiers after that one
            hit = None
            while hit is None and (position := self._first_reader(held, after=position)) is not None:
                entry = self.tiers[position - 1].tier.get(key)
                if entry is not None and entry.token_ids == tokens:
                    hit = (position, entry)
            if hit is None:
                break
            found.append(hit)
        return found

    def _first_reader(self, held: int, after: int) -> int | None:
        """The position of the first tier after ``after`` that a block with index bits ``held`` is asked of: one
        the index says holds it, or a shared tier (another process may have written it)."""
        for position in range(after + 1, len(self.tiers) + 1):
            if held & (1 << position) or self.tiers[position - 1].tier.shared:
                return position
        return None

    def match_prefix(self, seq: Sequence, loaded: list[tuple[int, CacheEntry]] | None = None) -> PrefixMatch:
        """Give a new (or preempted) sequence the longest cached prefix of its tokens.

        Fills ``seq.block_table`` with shared or promoted blocks and advances
        ``num_computed_tokens``/``num_cached_tokens``; only the rest is prefilled.
        ``loaded``: what ``start_load`` read for it; below L1 only those blocks are used (no tier is asked on
        the step thread). Returns where the blocks came from (all zero when the sequence opted out).
        """
        hits = dict.fromkeys(self.tier_names, 0)
        if not seq.use_prefix_cache:
            return PrefixMatch(0, hits, 0.0)
        started = time.perf_counter()
        self.placement.sync_removed()
        bs = self.block_size
        usable = (seq.num_tokens - 1) // bs  # never the last token: its logits are needed
        extend_hashes(seq.block_hashes, self.root_for(seq.cache_salt), seq.token_ids, bs, usable * bs)
        self.stats.lookups += 1

        by_key = None if loaded is None else {entry.key: (position, entry) for position, entry in loaded}
        plan: list[int | tuple[int, CacheEntry]] = []  # per block: an L1 block (shared) or (position, entry) to promote
        try:
            self._plan_match(seq, usable, by_key, plan)
        except BaseException:  # the L1 blocks shared so far are the step's to give back, or they stay in use
            self.pool.free([item for item in plan if isinstance(item, int)])
            raise
        shared = sum(1 for item in plan if isinstance(item, int))
        self.l1_stats.hits += shared
        self.l1_stats.misses += usable - shared

        promoted = iter(self.promote([item for item in plan if isinstance(item, tuple)]))
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
        seq.num_registered_blocks = len(table)
        if len(table) == len(plan) and self.reuse_partial_blocks:
            partial = self._copy_partial_block(seq, len(table))
            cached += partial
            self.stats.partial_block_tokens += partial
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        if cached:
            self.stats.prefix_matches += 1
        self.stats.cached_tokens += cached
        elapsed = time.perf_counter() - started
        self.stats.lookup_seconds += elapsed
        seq.cache_lookup_seconds += elapsed
        return PrefixMatch(usable, hits, elapsed)

    def _plan_match(
        self, seq: Sequence, usable: int, by_key: dict[bytes, tuple[int, CacheEntry]] | None,
        plan: list[int | tuple[int, CacheEntry]],
    ) -> None:
        """``match``'s plan, appended to ``plan`` as it goes: per block an L1 block (shared here) or
        ``(position, entry)`` to promote, up to the first block no tier has."""
        bs = self.block_size
        for index in range(usable):
            key = seq.block_hashes[index]
            tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            block_id = self._l1_lookup(key, tokens, expire=True)
            if block_id is not None:
                self.pool.share(block_id)
                plan.append(block_id)
                continue
            if by_key is None:
                found = self._fetch_below(key, tokens)
            else:
                found = by_key.get(key)
                if found is not None and found[1].token_ids != tokens:
                    found = None
                position = found[0] if found is not None else 0
                if position and not self.index.tiers_of(key) & (1 << position):
                    # read in a shared tier another process wrote it to: indexed while the tier still holds it (a
                    # tier of this process that dropped it since the read is not told it holds it again)
                    tier = self.tiers[position - 1].tier
                    if tier.shared and tier.contains(key):
                        self.placement.add(key, found[1].parent, position)
            if found is None:
                self._expire_l1_after(seq, index, usable)
                break
            plan.append(found)

    def _expire_l1_after(self, seq: Sequence, index: int, usable: int) -> None:
        """Withdraw the L1 blocks of ``seq``'s prompt after block ``index`` (where its lookup ended) that are past
        ``l1_ttl``: no lookup reaches them now, and the blocks the prompt computes next replace them."""
        if self.l1_ttl is None:
            return
        bs = self.block_size
        for later in range(index + 1, usable):
            key = seq.block_hashes[later]
            block_id = self.pool.lookup(key, tuple(seq.token_ids[later * bs : (later + 1) * bs]))
            if block_id is None:
                return
            if self._l1_expired(key, block_id):
                self._expire_l1(key)

    def _copy_partial_block(self, seq: Sequence, whole: int) -> int:
        """After ``whole`` matched blocks (maybe none), reuse the start of an L1 block that follows the same
        prefix and begins with at least ``partial_min_tokens`` of the prompt's next tokens (a conversation's
        next turn ends the last turn's block differently: the reply the model gave is not the one the client
        sends back). The block is shared and immutable, so its content is copied into a new block of the
        sequence's, which computes the rest; returns the tokens reused. Never the prompt's last token, and
        only where the pool can also hold the rest of the prompt (else the admission would fail and the copy
        be made again every step); a failed copy is logged and reuses nothing."""
        bs = self.block_size
        start = whole * bs
        wanted = tuple(seq.token_ids[start : min(start + bs - 1, seq.num_tokens - 1)])
        if len(wanted) < self.partial_min_tokens:
            return 0
        after = seq.block_hashes[whole - 1] if whole else self.root_for(seq.cache_salt)
        found = self.pool.longest_child(after, wanted)
        if found is None or found[1] < self.partial_min_tokens:
            return 0
        source, tokens = found
        pool = self.pool
        blocks = pool.blocks
        if self._l1_aged(blocks[source]):
            return 0  # past the TTL: not served, in part or whole
        idle = blocks[source].ref_count == 0 and blocks[source].block_hash not in pool.pinned
        needed = -(-seq.num_tokens // bs) - whole  # the copy and every block after it
        if pool.num_free_blocks - idle < needed:  # holding the source takes it out of the free count
            return 0
        pool.share(source, hit=False)  # held so the allocation below cannot evict it
        [copy] = pool.allocate(1)
        try:
            self.transfer.write_blocks([copy], self.transfer.read_blocks([source]))
        except Exception as exc:  # the whole blocks still serve; this prompt computes the rest
            pool.free([copy])
            log.warning("partial_block_copy_failed", error=str(exc))
            return 0
        finally:
            pool.free([source])
        seq.block_table.append(copy)
        return tokens

    def _fetch_below(self, key: bytes, tokens: tuple[int, ...]) -> tuple[int, CacheEntry] | None:
        held = self.index.tiers_of(key)
        for position, store_tier in enumerate(self.tiers, 1):
            indexed = bool(held & (1 << position))
            if not indexed and not store_tier.tier.shared:
                continue
            entry = store_tier.tier.get(key)
            if entry is None:  # expired, corrupt or evicted (the tier removed it), or a remote tier unreachable now
                if indexed and not store_tier.tier.contains(key):
                    self.placement.discard(key, position)
                continue
            if entry.token_ids != tokens:
                self.stats.token_mismatches += 1
                continue
            if not indexed:  # another process wrote it into a shared tier
                self.placement.add(key, entry.parent, position)
            return position, entry
        return None

    def promote(self, found: list[tuple[int, CacheEntry]]) -> list[int]:
        """Load entries found at ``(position, entry)`` into free L1 blocks in one copy; fewer if the
        pool is short. The blocks are the caller's (ref 1): a sequence's table, or held while warming."""
        count = min(len(found), self.pool.num_free_blocks)
        if not count:
            return []
        import torch

        found = found[:count]
        block_ids = self.pool.allocate(count)
        try:
            self.transfer.write_blocks(block_ids, torch.stack([entry.kv for _, entry in found]))
        except Exception as exc:  # noqa: BLE001 - an entry a tier plugin returned that the arena cannot take
            self.pool.free(block_ids)  # they were the step's to lose: once leaked, a block stayed in use for good
            log.warning("promote_failed", error=repr(exc), tiers=sorted({self.tier_names[p] for p, _ in found}),
                        action="the prompt computes these blocks")  # fmt: skip
            return []
        for block_id, (position, entry) in zip(block_ids, found):
            self.stats.promotions[self.tier_names[position]] += 1
            if self.pool.register(block_id, entry.key, entry.parent, entry.token_ids, created=entry.created):
                self.placement.add(entry.key, entry.parent, L1)
        return block_ids

    # ---- publishing computed blocks ----------------------------------------------

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed blocks (and write them through where asked; a
        warm's writes wait for room in write queues, ``seq.warm_writes``)."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks or not seq.use_prefix_cache:
            return
        self.placement.sync_removed()
        bs = self.block_size
        root = self.root_for(seq.cache_salt)
        extend_hashes(seq.block_hashes, root, seq.token_ids, bs, full * bs)
        fresh: list[tuple[int, bytes, bytes | None, tuple[int, ...], list[int]]] = []  # ..., tiers to write
        for index in range(seq.num_registered_blocks, full):
            key = seq.block_hashes[index]
            parent = seq.block_hashes[index - 1] if index else None
            tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            block_id = seq.block_table[index]
            if self.pool.register(block_id, key, parent, tokens, root=root):
                self.placement.add(key, parent, L1)
                held = self.index.tiers_of(key)
                targets = [position for position in self._write_through if not held & (1 << position)]
                if targets:
                    fresh.append((block_id, key, parent, tokens, targets))
        self.stats.computed_tokens += (full - seq.num_registered_blocks) * bs
        seq.num_registered_blocks = full
        if fresh:
            # one copy off the pool; each entry is a view of it, so the batch is freed once all are written
            data = self.transfer.read_blocks([block_id for block_id, *_ in fresh])
            writes: dict[int, list[CacheEntry]] = {}  # tier position -> its entries, handed over together
            for (_, key, parent, tokens, targets), kv in zip(fresh, data):
                for position in targets:
                    writes.setdefault(position, []).append(CacheEntry(key, parent, tokens, kv))
            for position, entries in writes.items():
                self.stats.write_through += len(entries)
                if seq.warm_writes is None:
                    self.put_below_many(position, entries)
                else:
                    for entry in entries:
                        self.put_below(position, entry, seq.warm_writes)

    # ---- demotion -------------------------------------------------------------------

    def _demote_from_l1(self, blocks: list[Block]) -> None:
        """Write the L1 blocks one allocation evicted to the first tier below, their data read in one copy and
        handed over in one ``put_many``; a block that tier holds already only has its uses in L1 credited there."""
        for block in blocks:
            self.placement.discard(block.block_hash, L1)
        if not self.tiers:
            return
        written = []
        for block in blocks:
            if self.index.tiers_of(block.block_hash) & (1 << 1):
                self.tiers[0].tier.add_accesses(block.block_hash, block.accesses)
            else:
                written.append(block)
        if not written:
            return
        data = self.transfer.read_blocks([block.block_id for block in written])  # one copy off the arena
        # a tier that keeps tensors as given would keep the whole batch alive through one view: its own copy each
        keeps = self.tiers[0].tier.medium == "memory" and len(written) > 1
        entries = [
            CacheEntry(block.block_hash, block.parent_hash, block.token_ids, kv.clone() if keeps else kv,
                       created=block.created or time.time(), accesses=block.accesses)
            for block, kv in zip(written, data)
        ]  # fmt: skip
        self.put_below_many(1, entries)
        self.stats.demotions[self.tier_names[1]] += len(entries)

    def put_below(self, position: int, entry: CacheEntry, warm: WarmWrites | None = None) -> list[bytes]:
        """Store ``entry`` in the tier at ``position`` (1 or more); what it evicts goes to the next
        tier down, carrying its access count. Returns the keys that tier evicted (or handed back).
        ``warm``: the write is a warm's, which waits for room and is counted there."""
        if warm is None:
            return self.put_below_many(position, [entry])
        tier = self.tiers[position - 1].tier
        evicted = warm.put(self.tier_names[position], tier, entry)
        self._placed(position, [entry], evicted)
        return [gone.key for gone in evicted]

    def put_below_many(self, position: int, entries: list[CacheEntry]) -> list[bytes]:
        """``put_below`` of several entries in one ``put_many`` (a step's demotions or write-throughs)."""
        evicted = self.tiers[position - 1].tier.put_many(entries)
        self._placed(position, entries, evicted)
        return [gone.key for gone in evicted]

    def _placed(self, position: int, entries: list[CacheEntry], evicted: list[CacheEntry]) -> None:
        """The index after a put at ``position``: the entries it holds added, what it evicted removed and passed
        to the next tier down (or, where that tier holds it already, only its access count)."""
        tier = self.tiers[position - 1].tier
        for entry in entries:
            if tier.contains(entry.key):
                self.placement.add(entry.key, entry.parent, position)
        below = position + 1
        passed: list[CacheEntry] = []
        for gone in evicted:
            if not tier.contains(gone.key):
                self.placement.discard(gone.key, position)
            if below > len(self.tiers):
                continue
            if self.index.tiers_of(gone.key) & (1 << below):
                self.tiers[below - 1].tier.add_accesses(gone.key, gone.accesses)
            else:
                passed.append(gone)
        if passed:
            self.put_below_many(below, passed)
            self.stats.demotions[self.tier_names[below]] += len(passed)

    # ---- pins and removal by key ------------------------------------------------------------

    def pin(self, keys: Seq[bytes]) -> None:
        """Keep these blocks from eviction in every tier that holds them now or receives them later.

        Pins are counted per key and nest: each ``pin`` needs one ``unpin``.
        A block not cached anywhere is pinned when it arrives. In L1 a pinned
        block stays cached with no sequence holding it and is not free; a
        tier whose other entries are all pinned gives up newcomers instead.
        """
        for key in keys:
            self.pins.pin(key)

    def unpin(self, keys: Seq[bytes]) -> None:
        """Release one ``pin`` of each key; ``ValueError`` (and no change) if a key has fewer pins."""
        self.pins.unpin_all(keys)

    def evict_keys(self, keys: Seq[bytes]) -> int:
        """Remove these blocks from every tier where nothing holds them: a block still pinned
        stays everywhere, and an L1 block a running sequence uses stays in L1.

        Returns the tier entries removed (a block held by two tiers counts twice).
        """
        self.placement.sync_removed()
        removed = 0
        for key in reversed(keys):  # children before their parents
            if self.pins.count(key):
                continue
            block_id = self.pool.cached.get(key)
            if block_id is not None and self.pool.blocks[block_id].ref_count == 0:
                self.pool.uncache(key)
                self.placement.discard(key, L1)
                removed += 1
            for position, store_tier in enumerate(self.tiers, 1):
                if self.index.tiers_of(key) & (1 << position):
                    store_tier.tier.remove(key)
                    self.placement.discard(key, position)
                    removed += 1
        return removed

    # ---- access counts ------------------------------------------------------------------------

    def frequent_prefixes(self, limit: int) -> list[list[bytes]]:
        """Up to ``limit`` cached prefixes (block hashes, first block first) used most, best first:
        ranked by the access count, in the tiers below L1, of the block each ends at
        (``cache.frequency``). Walks the whole index (an admin request)."""
        return frequency.frequent_prefixes(self, limit)

    def top_prefixes(self, limit: int) -> list[frequency.PrefixUse]:
        """Up to ``limit`` cached prefixes used most, counting uses in every tier (L1 too), best
        first (``cache.frequency.top_prefixes``). Walks the whole index (an admin request)."""
        return frequency.top_prefixes(self, limit)

    def warm_frequent(self, limit_blocks: int) -> WarmReport:
        """Promote the most used prefixes' blocks into L1 (cached, not pinned) and, from the last
        tier, into the first tier below; at most ``limit_blocks`` blocks, parents first, never
        evicting a pinned or in-use block (``cache.warming``)."""
        return warming.warm_frequent(self, limit_blocks)

    # ---- management ---------------------------------------------------------------------

    def clear(self, tier: str = "all") -> dict[str, int]:
        """Drop the cached blocks of one tier (a name in ``tier_names``) or ``all``; blocks in
        use keep their data. Pinned blocks go too, but their pins stay counted: a pinned block
        is pinned again wherever it is cached later. Returns the blocks removed per tier name."""
        allowed = [*self.tier_names, "all"]
        if tier not in allowed:
            raise ValueError(f"tier: got {tier!r}, allowed: {', '.join(allowed)}")
        removed: dict[str, int] = {}
        if tier in ("l1", "all"):
            keys = list(self.pool.cached)
            for key in keys:
                self.pool.uncache(key)
                self.placement.discard(key, L1)
            removed["l1"] = len(keys)
        for position, store_tier in enumerate(self.tiers, 1):
            if tier in (store_tier.name, "all"):
                removed[store_tier.name] = store_tier.tier.clear()
                for key in self.index.keys_held_by(1 << position):
                    self.placement.discard(key, position)
        return removed

    def offload(self) -> int:
        """Move L1's unreferenced cached blocks to the first tier below and free them in L1.

        The prefixes stay servable (a later hit promotes them back); blocks in
        use by running sequences, and pinned blocks, stay where they are.
        Returns the blocks moved.
        """
        if not self.tiers:
            return 0
        # registration order puts parents before children; children go first so a
        # full lower tier evicts leaves before the prefixes they extend
        pool = self.pool
        idle = [key for key, block_id in pool.cached.items() if pool.blocks[block_id].ref_count == 0]
        idle = [key for key in idle if key not in pool.pinned]
        self._demote_from_l1([pool.blocks[pool.cached[key]] for key in reversed(idle)])  # one copy off the arena
        for key in reversed(idle):
            pool.uncache(key)
        return len(idle)

    def snapshot(self) -> CacheSnapshot:
        """Statistics of every tier and of the index; O(number of tiers), no walk over entries."""
        self.placement.sync_removed()
        pool = self.pool
        self.l1_stats.evictions = pool.evictions
        held = (pool.num_blocks - pool.num_empty_blocks) * self.block_bytes  # blocks in use or cached
        tiers = {
            "l1": TierSnapshot.of(
                "l1", self.l1_stats, len(pool.cached), held, pool.num_blocks, pool.num_free_blocks, medium="arena",
                capacity=(pool.num_blocks, pool.num_blocks * self.block_bytes or None),
            )
        }
        for store_tier in self.tiers:
            tier = store_tier.tier
            tiers[store_tier.name] = TierSnapshot.of(
                store_tier.name, tier.stats, len(tier), tier.bytes_used, medium=tier.medium,
                capacity=(tier.capacity.entries, tier.capacity.bytes),
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
            partial_block_tokens=s.partial_block_tokens,
            loads=s.loads,
            load_timeouts=s.load_timeouts,
            load_failures=s.load_failures,
        )

    def check_integrity(self) -> None:
        """The pool's and the index's invariants, and that they agree with every tier
        (queued background writes are settled first: a check is about a quiet store)."""
        self.flush()
        self.pool.check_integrity()
        self.placement.check_integrity()

    def writes_stored(self) -> bool:
        """Whether every tier's queued writes are on their medium (asked without waiting)."""
        return all(store_tier.tier.writes_pending() == 0 for store_tier in self.tiers)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every tier's queued background writes are on their medium (at most
        ``timeout`` seconds in all; ``None``: as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for store_tier in self.tiers:
            store_tier.tier.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    @property
    def write_through_names(self) -> list[str]:
        """The names of the tiers every newly computed block is written to."""
        return [self.tier_names[position] for position in self._write_through]

    def close(self) -> None:
        """Move every block's access counts down to the slowest tier holding it (a persistent tier
        keeps the uses seen above it), then flush and release every tier."""
        frequency.settle_accesses(self)
        if self._loader is not None:  # what the loader thread opened in the tiers, closed on that thread
            self._loader.submit(lambda: [store_tier.tier.release_thread() for store_tier in self.tiers]).result()
            self._loader.shutdown(wait=True)
        for store_tier in self.tiers:
            store_tier.tier.close()
