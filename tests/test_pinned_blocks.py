"""Pinned blocks: in the L1 pool, and counted pins across every tier of the store.

A pin keeps a block from eviction in every tier that holds it or receives it
later; pins nest, and the store's own leaves-first pins in the last tier
count alongside them, so neither undoes the other.
"""

from __future__ import annotations

import pytest

from tierserve.cache.block_pool import BlockPool, OutOfBlocksError
from tierserve.core.plugins import load_plugins

LRU = load_plugins(allowlist=[]).registry("eviction_policies").get("lru").factory


# ---------------------------------------------------------------------------
# the L1 pool
# ---------------------------------------------------------------------------


def cached_pool(blocks: int, registered: int) -> tuple[BlockPool, list[int]]:
    """A pool whose first ``registered`` allocated blocks are cached and free again (hashes b"h0", b"h1", ...)."""
    pool = BlockPool(blocks, 1, LRU(blocks))
    ids = pool.allocate(registered)
    for i, block_id in enumerate(ids):
        assert pool.register(block_id, f"h{i}".encode(), None, (i,))
    pool.free(ids)
    pool.check_integrity()
    return pool, ids


def test_a_pinned_idle_block_is_not_free_and_is_never_reused():
    pool, (kept, other) = cached_pool(4, 2)
    assert pool.num_free_blocks == 4
    pool.pin(b"h0")
    pool.check_integrity()
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 1

    taken = pool.allocate(3)  # two plain free blocks, then the cached block nobody pinned
    assert kept not in taken and other in taken and pool.evictions == 1
    assert pool.lookup(b"h0", (0,)) == kept
    with pytest.raises(OutOfBlocksError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    pool.check_integrity()

    pool.free(taken)
    pool.unpin(b"h0")
    pool.check_integrity()
    assert pool.num_free_blocks == 4
    assert kept in pool.allocate(4)  # unpinned, it is reused like any cached block
    pool.check_integrity()


def test_a_pinned_block_revived_and_freed_stays_cached_and_pinned():
    pool, (kept,) = cached_pool(2, 1)
    pool.pin(b"h0")
    pool.share(kept)  # a prefix hit on it
    assert pool.num_free_blocks == 1
    pool.check_integrity()
    pool.free([kept])
    assert pool.num_free_blocks == 1 and pool.lookup(b"h0", (0,)) == kept
    pool.check_integrity()
    pool.pin(b"h0")  # pins in the pool do not nest (the store counts them)
    pool.pin(b"nothing cached")  # ignored
    pool.unpin(b"h0")
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_uncaching_a_pinned_block_drops_the_pin_and_frees_it():
    pool, (kept,) = cached_pool(2, 1)
    pool.pin(b"h0")
    assert pool.uncache(b"h0")
    assert pool.num_free_blocks == 2 and not pool.pinned
    pool.check_integrity()
