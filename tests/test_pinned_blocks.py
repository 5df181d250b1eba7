"""Pinned blocks: in the L1 pool, and counted pins across every tier of the store.

A pin keeps a block from eviction in every tier that holds it or receives it
later; pins nest, and the store's own leaves-first pins in the last tier
count alongside them, so neither undoes the other.
"""

from __future__ import annotations

import pytest
import torch

from tests.store_helpers import PROMPT_BLOCKS, Requests, StoreTier, build_tier, disk_entry_bytes, prompt
from tierserve.cache.block_pool import BlockPool, OutOfBlocksError
from tierserve.core.plugins import load_plugins

pytestmark = pytest.mark.unit

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


# ---------------------------------------------------------------------------
# the store: pins in every tier
# ---------------------------------------------------------------------------


def test_a_pinned_prefix_survives_pressure_that_evicts_everything_else_in_every_tier(tmp_path):
    disk = build_tier("disk", path=str(tmp_path / "l3"), max_bytes=int((PROMPT_BLOCKS + 2.5) * disk_entry_bytes()))
    tiers = [StoreTier("l2", build_tier("memory", capacity=PROMPT_BLOCKS, max_bytes=0)), StoreTier("l3", disk, True)]
    requests = Requests(2 * PROMPT_BLOCKS + 1, tiers)  # room for the pinned prefix and one more request
    store = requests.store
    try:
        _, cold = requests.run(prompt(0))
        store.offload()  # prompt 0 to l2 (and, written through, it is on disk)
        match, _ = requests.run(prompt(0))  # back into l1; l2 keeps its copy
        assert match.hits["l2"] == PROMPT_BLOCKS
        keyed = requests.hashes(prompt(0))
        assert all(requests.tiers_holding(key) == ["l1", "l2", "l3"] for key in keyed)
        store.pin(keyed)

        for n in range(1, 12):
            requests.run(prompt(n))
        snap = store.snapshot()
        assert store.pool.evictions > 0 and snap.tiers["l2"].evictions > 0 and snap.tiers["l3"].evictions > 0
        assert all(requests.tiers_holding(key) == ["l1", "l2", "l3"] for key in keyed)
        for n in (1, 2, 3):  # the other early prompts are gone from every tier
            assert all(requests.tiers_holding(key) == [] for key in requests.hashes(prompt(n)))

        match, again = requests.run(prompt(0))
        assert match.hits == {"l1": PROMPT_BLOCKS, "l2": 0, "l3": 0}
        assert torch.equal(again, cold)
    finally:
        requests.close()


def test_a_block_pinned_later_is_pinned_in_each_tier_it_reaches():
    tiers = [StoreTier("l2", build_tier("memory", capacity=PROMPT_BLOCKS, max_bytes=0))]
    requests = Requests(PROMPT_BLOCKS + 1, tiers)
    store = requests.store
    keyed = requests.hashes(prompt(0))
    store.pin(keyed)  # nothing cached yet
    assert store.pool.num_free_blocks == PROMPT_BLOCKS + 1
    requests.run(prompt(0))
    assert store.pool.pinned == set(keyed)
    assert store.pool.num_free_blocks == 1  # the pinned blocks are not free once no request holds them
    store.unpin(keyed)
    store.offload()  # unpinned, they may leave l1
    store.pin(keyed)
    requests.run(prompt(1))
    requests.run(prompt(2))  # l2 holds four entries: without the pins, prompt 0 would be evicted first
    assert all(requests.tiers_holding(key) == ["l2"] for key in keyed)
    store.unpin(keyed)
    for n in range(3, 8):
        requests.run(prompt(n))
    assert all(requests.tiers_holding(key) == [] for key in keyed)


def test_pins_nest_and_unpinning_more_than_pinned_changes_nothing():
    requests = Requests(PROMPT_BLOCKS + 1, [])
    store = requests.store
    keyed = requests.hashes(prompt(0))
    requests.run(prompt(0))
    store.pin(keyed)
    store.pin(keyed[:1])
    store.unpin(keyed)
    assert store.pool.pinned == set(keyed[:1])
    with pytest.raises(ValueError, match="unpinned more times than it is pinned"):
        store.unpin([keyed[0], keyed[1]])
    assert store.pool.pinned == set(keyed[:1])
    store.check_integrity()


# ---------------------------------------------------------------------------
# leaves-first pins in the last tier and key pins count together
# ---------------------------------------------------------------------------


def two_block_store() -> tuple[Requests, list[bytes]]:
    """L1 and one memory tier of two entries holding prompt 0's two blocks [parent, child]."""
    requests = Requests(3, [StoreTier("l2", build_tier("memory", capacity=2, max_bytes=0))])
    tokens = prompt(0)[: 2 * 4 + 1]
    requests.run(tokens)
    requests.store.offload()
    return requests, requests.hashes(tokens)


def push_one_block_down(requests: Requests, n: int) -> None:
    requests.run(prompt(n)[:5])  # one full block, then offloaded into the memory tier
    requests.store.offload()


def test_a_key_pin_outlives_the_leaves_first_pin_of_the_same_block():
    requests, (parent, child) = two_block_store()
    store = requests.store
    store.pin([parent])
    assert store.evict_keys([child]) == 1  # the child leaves: the store's leaves-first hold on the parent ends
    for n in range(1, 5):
        push_one_block_down(requests, n)
    assert requests.tiers_holding(parent) == ["l2"]  # still pinned by the key


def test_a_leaves_first_pin_outlives_a_key_pin_of_the_same_block():
    requests, (parent, child) = two_block_store()
    store = requests.store
    store.pin([parent])
    store.unpin([parent])  # the key lets go; the cached child still needs its parent
    store.tiers[0].tier.get(child)  # the parent is now the least recently used entry
    push_one_block_down(requests, 1)
    assert requests.tiers_holding(parent) == ["l2"] and requests.tiers_holding(child) == []
    store.check_integrity()


# ---------------------------------------------------------------------------
# evict_keys
# ---------------------------------------------------------------------------


def test_evict_keys_removes_unpinned_blocks_everywhere_but_keeps_pinned_and_in_use_ones(tmp_path):
    tiers = [
        StoreTier("l2", build_tier("memory", capacity=100, max_bytes=0)),
        StoreTier("l3", build_tier("disk", path=str(tmp_path / "l3")), write_through=True),
    ]
    requests = Requests(3 * PROMPT_BLOCKS + 2, tiers)
    store = requests.store
    try:
        for n in range(3):
            requests.run(prompt(n))
        store.offload()
        for n in range(3):
            requests.run(prompt(n))  # every block in l1, l2 and l3
        free, pinned, running = (requests.hashes(prompt(n)) for n in range(3))
        store.pin(pinned)
        seq, _ = requests.start(prompt(2))  # a running request uses prompt 2's blocks in l1

        removed = store.evict_keys(free + pinned + running)
        assert removed == 3 * PROMPT_BLOCKS + 2 * PROMPT_BLOCKS
        assert all(requests.tiers_holding(key) == [] for key in free)
        assert all(requests.tiers_holding(key) == ["l1", "l2", "l3"] for key in pinned)
        assert all(requests.tiers_holding(key) == ["l1"] for key in running)
        assert requests.run(prompt(0))[0].cached_blocks == 0
        requests.finish(seq)
    finally:
        requests.close()
