"""Model-based tests of the L1 block pool and the block tables built on it.

A hypothesis state machine drives ``BlockPool`` + ``KVCacheManager`` side by
side with a deliberately plain reference: a reference count per block, the
set of blocks that carry a prefix hash, and each table's token count. After
every step the pool must agree with it and pass ``check_integrity()``.

Semantics the reference encodes (from ``cache/block_pool.py``):

* A block is free when its count is 0; it is *cached-free* if it was
  registered under a hash and keeps it. Both kinds count in
  ``num_free_blocks``. Only a block in use can be registered, once.
* ``allocate_slots`` takes plain free blocks first and evicts cached-free ones
  (clearing the hash, counting ``evictions``) only when those run out; if the
  pool is short it returns False and nothing changes.
* ``share`` adds a reference to a block in use or revives a cached-free one;
  a plain free block cannot be shared.
* Freeing a block more times than it was referenced raises ``ValueError``.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tierserve.cache.block_pool import BlockPool, OutOfBlocksError
from tierserve.cache.kv_manager import KVCacheManager
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.sequence import Sequence
from tierserve.core.plugins import load_plugins

pytestmark = pytest.mark.unit

POLICY_NAMES = ("lru", "lfu", "clock", "adaptive")
NUM_TABLES = 4

_POLICIES = load_plugins(allowlist=[]).registry("eviction_policies")


def holding(table: list[int]) -> Sequence:
    """A sequence whose block table is ``table`` (the KV manager works on sequences)."""
    return Sequence(0, "table", [], 0, SamplingParams(), block_table=table)


def make_pool(num_blocks: int, block_size: int, policy: str = "lru") -> BlockPool:
    return BlockPool(num_blocks, block_size, _POLICIES.get(policy).factory(num_blocks))


def snapshot(pool: BlockPool) -> tuple:
    """Everything a caller can observe about the pool."""
    return (
        [(b.ref_count, b.block_hash) for b in pool.blocks],
        pool.num_free_blocks,
        pool.evictions,
    )


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(min_value=1, max_value=12),
        block_size=st.integers(min_value=1, max_value=4),
        policy=st.sampled_from(POLICY_NAMES),
    )
    def setup(self, num_blocks: int, block_size: int, policy: str) -> None:
        self.pool = make_pool(num_blocks, block_size, policy)
        self.kv = KVCacheManager(self.pool)
        self.tables: list[list[int]] = [[] for _ in range(NUM_TABLES)]
        self.tokens = [0] * NUM_TABLES
        self.refs = [0] * num_blocks
        self.hashed: set[int] = set()
        self.evictions = 0
        self.next_hash = 0

    # ---- reference helpers ---------------------------------------------------

    def plain_free(self) -> set[int]:
        return {b for b, r in enumerate(self.refs) if r == 0 and b not in self.hashed}

    def cached_free(self) -> set[int]:
        return {b for b, r in enumerate(self.refs) if r == 0 and b in self.hashed}

    def in_use(self) -> list[int]:
        return [b for b, r in enumerate(self.refs) if r > 0]

    def ref_free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.refs[b] -= 1

    # ---- rules -------------------------------------------------------------------

    @rule(t=st.integers(0, NUM_TABLES - 1), extra=st.integers(min_value=0, max_value=10))
    def grow(self, t: int, extra: int) -> None:
        table = self.tables[t]
        target = self.tokens[t] + extra
        needed = max(0, -(-target // self.pool.block_size) - len(table))
        plain_before = self.plain_free()
        cached_before = self.cached_free()
        fits = needed <= len(plain_before) + len(cached_before)
        before = snapshot(self.pool)
        old_table = list(table)

        assert self.kv.allocate_slots(holding(table), target) is fits

        if not fits:
            assert table == old_table
            assert snapshot(self.pool) == before
            return
        assert table[: len(old_table)] == old_table
        new = table[len(old_table) :]
        assert len(new) == needed
        assert len(set(new)) == needed
        from_plain = min(needed, len(plain_before))
        assert set(new[:from_plain]) <= plain_before, "a cached-free block was evicted while plain free ones remained"
        assert set(new[from_plain:]) <= cached_before
        for b in new:
            self.refs[b] = 1
            assert self.pool.blocks[b].block_hash is None
        self.hashed -= set(new)
        self.evictions += needed - from_plain
        self.tokens[t] = target
        assert len(table) * self.pool.block_size >= target

    @rule(src=st.integers(0, NUM_TABLES - 1), dst=st.integers(0, NUM_TABLES - 1), data=st.data())
    def share_into(self, src: int, dst: int, data) -> None:
        if not self.tables[src]:
            return
        block = data.draw(st.sampled_from(self.tables[src]))
        self.pool.share(block)
        self.refs[block] += 1
        self.append_full_block(dst, block)

    @precondition(lambda self: bool(self.cached_free()))
    @rule(dst=st.integers(0, NUM_TABLES - 1), data=st.data())
    def revive_cached(self, dst: int, data) -> None:
        block = data.draw(st.sampled_from(sorted(self.cached_free())))
        free_before = self.pool.num_free_blocks
        self.pool.share(block)
        assert self.pool.blocks[block].ref_count == 1
        assert self.pool.blocks[block].block_hash is not None
        assert self.pool.num_free_blocks == free_before - 1
        self.refs[block] = 1
        self.append_full_block(dst, block)

    def append_full_block(self, t: int, block: int) -> None:
        # a shared block is a full prefix block: the table covers its tokens exactly
        self.tables[t].append(block)
        self.tokens[t] = len(self.tables[t]) * self.pool.block_size

    @precondition(lambda self: any(r > 0 for r in self.refs))
    @rule(data=st.data())
    def register(self, data) -> None:
        block = data.draw(st.sampled_from(self.in_use()))
        registered = self.pool.register(block, f"h{self.next_hash}".encode(), None, (self.next_hash,))
        self.next_hash += 1
        assert registered is (block not in self.hashed)  # a block is published once
        self.hashed.add(block)

    @rule(t=st.integers(0, NUM_TABLES - 1))
    def free_table(self, t: int) -> None:
        table = self.tables[t]
        freed = list(table)
        self.kv.free(holding(table))
        assert table == []
        self.ref_free(freed)
        self.tokens[t] = 0

    @precondition(lambda self: any(r == 0 for r in self.refs))
    @rule(data=st.data())
    def double_free_raises(self, data) -> None:
        block = data.draw(st.sampled_from([b for b, r in enumerate(self.refs) if r == 0]))
        before = snapshot(self.pool)
        with pytest.raises(ValueError, match=f"block {block}"):
            self.pool.free([block])
        assert snapshot(self.pool) == before

    @precondition(lambda self: bool(self.plain_free()))
    @rule(data=st.data())
    def share_plain_free_raises(self, data) -> None:
        block = data.draw(st.sampled_from(sorted(self.plain_free())))
        before = snapshot(self.pool)
        with pytest.raises(ValueError, match=f"block {block}"):
            self.pool.share(block)
        assert snapshot(self.pool) == before

    @rule()
    def free_everything(self) -> None:
        for t in range(NUM_TABLES):
            self.free_table(t)
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert self.pool.num_used_blocks == 0
        assert all(b.ref_count == 0 for b in self.pool.blocks)

    # ---- invariants ----------------------------------------------------------

    @invariant()
    def agrees_with_reference(self) -> None:
        self.pool.check_integrity()
        assert self.pool.num_free_blocks == self.pool.num_blocks - len(self.in_use())
        assert [b.ref_count for b in self.pool.blocks] == self.refs
        assert {b.block_id for b in self.pool.blocks if b.block_hash is not None} == self.hashed
        assert self.pool.evictions == self.evictions
        for t, table in enumerate(self.tables):
            assert len(table) * self.pool.block_size >= self.tokens[t]
        held = [b for table in self.tables for b in table]
        assert sorted(held) == sorted(b for b, r in enumerate(self.refs) for _ in range(r))

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.free_everything()
        self.pool.check_integrity()


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------------
# The cached-free path, step by step
# ---------------------------------------------------------------------------


def test_hashed_block_becomes_cached_free_and_share_revives_it():
    pool = make_pool(4, 2)
    kv = KVCacheManager(pool)
    table: list[int] = []
    assert kv.allocate_slots(holding(table), 4)
    prefix = table[0]
    assert pool.register(prefix, b"prefix", None, (1, 2))

    kv.free(holding(table))
    assert pool.num_free_blocks == 4  # cached-free still counts as free
    assert pool.blocks[prefix].ref_count == 0
    assert pool.blocks[prefix].block_hash == b"prefix"
    pool.check_integrity()

    pool.share(prefix)
    assert pool.blocks[prefix].ref_count == 1
    assert pool.blocks[prefix].block_hash == b"prefix"
    assert pool.num_free_blocks == 3
    pool.check_integrity()

    # revived, it is in use: allocating every other block never evicts it
    rest = pool.allocate(3)
    assert prefix not in rest
    assert pool.evictions == 0
    assert pool.blocks[prefix].block_hash == b"prefix"
    with pytest.raises(OutOfBlocksError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    pool.free(rest + [prefix])
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_cached_free_blocks_are_evicted_only_after_plain_free_ones_run_out():
    pool = make_pool(4, 1)
    kv = KVCacheManager(pool)
    table: list[int] = []
    assert kv.allocate_slots(holding(table), 4)
    first, second = table[0], table[1]
    assert pool.register(first, b"a", None, (1,))
    assert pool.register(second, b"b", b"a", (2,))
    kv.free(holding(table))  # tail first: `second` becomes cached-free before `first`

    plain = pool.allocate(2)
    assert set(plain) == set(range(4)) - {first, second}
    assert pool.evictions == 0
    assert pool.blocks[first].block_hash == b"a" and pool.blocks[second].block_hash == b"b"

    # LRU evicts the block that was freed first: the tail of the prefix
    [evicted] = pool.allocate(1)
    assert evicted == second
    assert pool.blocks[second].block_hash is None
    assert pool.blocks[second].ref_count == 1
    assert pool.evictions == 1
    assert pool.blocks[first].block_hash == b"a"
    pool.check_integrity()

    [evicted] = pool.allocate(1)
    assert evicted == first
    assert pool.blocks[first].block_hash is None
    assert pool.evictions == 2
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing():
    pool = make_pool(3, 4)
    kv = KVCacheManager(pool)
    held: list[int] = []
    assert kv.allocate_slots(holding(held), 5)  # 2 blocks
    assert pool.register(held[0], b"x", None, (1, 2, 3, 4))
    table: list[int] = []
    before = snapshot(pool)
    assert kv.allocate_slots(holding(table), 9) is False  # 3 blocks, 1 free
    assert table == []
    assert snapshot(pool) == before
    assert kv.allocate_slots(holding(table), 4) is True
    assert kv.allocate_slots(holding(table), 4) is True  # already covered: no new block
    assert len(table) == 1


def test_double_free_raises_and_changes_nothing():
    pool = make_pool(2, 4)
    [block] = pool.allocate(1)
    pool.free([block])
    before = snapshot(pool)
    with pytest.raises(ValueError, match=f"block {block} freed more times than it was allocated"):
        pool.free([block])
    assert snapshot(pool) == before
    pool.check_integrity()


def test_shared_block_is_freed_only_by_its_last_reference():
    pool = make_pool(2, 4)
    kv = KVCacheManager(pool)
    a: list[int] = []
    assert kv.allocate_slots(holding(a), 4)
    pool.share(a[0])
    b = [a[0]]
    kv.free(holding(a))
    assert pool.num_free_blocks == 1
    assert pool.blocks[b[0]].ref_count == 1
    kv.free(holding(b))
    assert pool.num_free_blocks == 2
    pool.check_integrity()


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 1)])
def test_pool_rejects_non_positive_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be positive"):
        BlockPool(num_blocks, block_size, _POLICIES.get("lru").factory(4))
