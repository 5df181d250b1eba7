"""The tiered store over any number of tiers named by the caller, with real KV tensors.

The arena below is the backend's block copier reduced to a CPU tensor; the
"model" writes KV that is a fixed function of the tokens so far, so a block
promoted back must equal what a cold run computed, byte for byte.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.cache.block_pool import BlockPool
from tierserve.cache.kv_manager import KVCacheManager
from tierserve.cache.hash_index import BlockHashIndex
from tierserve.cache.stats import CacheSnapshot, PrefixMatch
from tierserve.cache.store import StoreTier, TieredStore
from tierserve.core.tier_settings import TierSettings
from tierserve.core.plugins import load_plugins
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.sequence import Sequence

pytestmark = pytest.mark.unit

_MANAGER = load_plugins(allowlist=[])
POLICIES = _MANAGER.registry("eviction_policies")
TIERS = _MANAGER.registry("cache_tiers")
LRU = POLICIES.get("lru").factory
FINGERPRINT = "tiered-store-test"
BLOCK = 4
KV_SHAPE = (2, 2, BLOCK, 2, 8)  # layers, k/v, tokens, kv heads, head dim
PROMPT_BLOCKS = 4


class Arena:
    """The KV arena: one CPU tensor of blocks, copied in and out as the backend does."""

    def __init__(self, num_blocks: int) -> None:
        self.data = torch.zeros(num_blocks, *KV_SHAPE)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.data[block_ids]

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.data[block_ids] = data


def kv_for(tokens: list[int]) -> torch.Tensor:
    """The KV the model would compute for the last block of ``tokens`` (a function of all of them)."""
    return torch.randn(*KV_SHAPE, generator=torch.Generator().manual_seed(hash(tuple(tokens)) & 0x7FFFFFFF))


def build_tier(plugin: str, **options):
    """A tier built the way the engine builds one: ``factory(TierSettings, policy_factory, fingerprint)``."""
    component = TIERS.get(plugin)
    tier = TierSettings(name="t", plugin=plugin, eviction_policy="lru", ttl_seconds=None, options=component.settings(**options))
    return component.factory(tier, LRU, FINGERPRINT)


def memory_tier(entries: int):
    return build_tier("memory", capacity=entries, max_bytes=0)


def disk_tier(path):
    return build_tier("disk", path=str(path), persistent=False)


class Runner:
    """Requests through the store the way the engine makes them: lookup, allocate, compute the rest, publish, free."""

    def __init__(self, num_blocks: int, tiers: list[StoreTier]) -> None:
        self.arena = Arena(num_blocks)
        self.pool = BlockPool(num_blocks, BLOCK, LRU(num_blocks))
        self.store = TieredStore(self.pool, self.arena, FINGERPRINT, tiers)
        self.kv = KVCacheManager(self.pool, self.store)
        self.requests = 0

    def run(self, prompt: list[int]) -> tuple[PrefixMatch, torch.Tensor]:
        """One request; returns what the lookup found and the KV of the prompt's full blocks."""
        self.requests += 1
        seq = Sequence(self.requests, f"r{self.requests}", list(prompt), len(prompt), SamplingParams())
        match = self.kv.match_prefix(seq)
        assert self.kv.allocate_slots(seq, seq.num_tokens)
        first = seq.num_computed_tokens // BLOCK
        for index in range(first, len(seq.block_table)):
            self.arena.write_blocks([seq.block_table[index]], kv_for(prompt[: (index + 1) * BLOCK]).unsqueeze(0))
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_computed(seq)
        full = self.arena.read_blocks(seq.block_table[: len(prompt) // BLOCK])
        self.kv.free(seq)
        self.store.check_integrity()
        return match, full


def prompt(n: int) -> list[int]:
    """Prompt ``n``: PROMPT_BLOCKS full blocks of its own, plus one token."""
    return [1000 * n + i for i in range(PROMPT_BLOCKS * BLOCK + 1)]


# ---------------------------------------------------------------------------
# three tiers below L1
# ---------------------------------------------------------------------------


@pytest.fixture
def three_tiers(tmp_path):
    tiers = [
        StoreTier("ram-small", memory_tier(PROMPT_BLOCKS)),
        StoreTier("ram-big", memory_tier(2 * PROMPT_BLOCKS)),
        StoreTier("disk", disk_tier(tmp_path / "disk")),
    ]
    # L1: one prompt's blocks and its extra token, so each new prompt pushes the last one down
    runner = Runner(PROMPT_BLOCKS + 1, tiers)
    yield runner
    runner.store.close()


def test_blocks_demote_down_three_tiers_and_promote_back_as_computed(three_tiers):
    runner = three_tiers
    store = runner.store
    assert store.tier_names == ["l1", "ram-small", "ram-big", "disk"]
    cold = {}
    for n in range(5):
        match, cold[n] = runner.run(prompt(n))
        assert match.cached_blocks == 0 and match.lookup_blocks == PROMPT_BLOCKS
    # prompt 4 in L1, 3 in ram-small (4 entries), 2 and 1 in ram-big (8), 0 pushed on to disk
    snap = store.snapshot()
    assert isinstance(snap, CacheSnapshot)
    assert [name for name in snap.tiers] == store.tier_names
    assert snap.demotions == {"ram-small": 16, "ram-big": 12, "disk": 4}
    entries = {name: tier.entries for name, tier in snap.tiers.items()}
    assert entries == {"l1": 4, "ram-small": 4, "ram-big": 8, "disk": 4}

    match, again = runner.run(prompt(0))
    assert match.hits == {"l1": 0, "ram-small": 0, "ram-big": 0, "disk": PROMPT_BLOCKS}
    assert torch.equal(again, cold[0])

    # each promotion pushes L1's prompt down a tier, cascading: 4 is now in ram-small, 3 in ram-big
    for n, tier in ((4, "ram-small"), (3, "ram-big"), (1, "disk")):
        match, again = runner.run(prompt(n))
        assert match.hits == dict.fromkeys(store.tier_names, 0) | {tier: PROMPT_BLOCKS}, (n, match.hits)
        assert torch.equal(again, cold[n]), f"prompt {n} came back different from {tier}"
    snap = store.snapshot()
    assert snap.promotions == {"ram-small": 4, "ram-big": 4, "disk": 8}
    assert snap.tiers["disk"].hits == 8 and snap.tiers["l1"].misses == 4 * PROMPT_BLOCKS + 5 * PROMPT_BLOCKS


def test_clear_names_the_tiers_and_one_tier_can_be_cleared(three_tiers):
    runner = three_tiers
    for n in range(3):
        runner.run(prompt(n))
    with pytest.raises(ValueError, match="tier: got 'l2', allowed: l1, ram-small, ram-big, disk, all"):
        runner.store.clear("l2")
    assert runner.store.clear("ram-big") == {"ram-big": 4}
    runner.store.check_integrity()
    assert runner.store.clear() == {"l1": 4, "ram-small": 4, "ram-big": 0, "disk": 0}
    match, _ = runner.run(prompt(0))
    assert match.cached_blocks == 0
    runner.store.check_integrity()


def test_write_through_writes_every_computed_block_to_each_tier_that_asks(tmp_path):
    tiers = [
        StoreTier("ram", memory_tier(100)),
        StoreTier("disk-a", disk_tier(tmp_path / "a"), write_through=True),
        StoreTier("disk-b", disk_tier(tmp_path / "b"), write_through=True),
    ]
    runner = Runner(2 * (PROMPT_BLOCKS + 1), tiers)
    try:
        _, cold = runner.run(prompt(7))
        snap = runner.store.snapshot()
        assert snap.write_through == 2 * PROMPT_BLOCKS
        assert [snap.tiers[name].entries for name in ("ram", "disk-a", "disk-b")] == [0, PROMPT_BLOCKS, PROMPT_BLOCKS]
        runner.store.clear("l1")
        match, again = runner.run(prompt(7))
        assert match.hits["disk-a"] == PROMPT_BLOCKS and torch.equal(again, cold)
    finally:
        runner.store.close()


@pytest.mark.parametrize("names", [["l1"], ["all"], ["x", "x"], [""]])
def test_reserved_empty_or_repeated_tier_names_are_refused(names):
    tiers = [StoreTier(name, memory_tier(4)) for name in names]
    with pytest.raises(ValueError, match="cache tier name"):
        TieredStore(BlockPool(4, BLOCK, LRU(4)), Arena(4), FINGERPRINT, tiers)


def test_l1_only_store_needs_no_transfer_and_reports_l1():
    runner = Runner(PROMPT_BLOCKS + 1, [])
    runner.store.transfer = None
    runner.run(prompt(1))
    match, _ = runner.run(prompt(1))
    assert match.hits == {"l1": PROMPT_BLOCKS}
    stats = runner.store.snapshot().as_dict()
    assert set(stats["tiers"]) == {"l1"} and stats["promotions"] == {} and stats["demotions"] == {}
    assert set(stats["tiers"]["l1"]) == {
        "hits", "misses", "hit_rate", "entries", "bytes", "evictions", "expirations", "corrupt", "corrupt_indexes",
        "dropped_writes", "write_errors", "connection_errors", "errors", "get_seconds", "put_seconds", "compression_ratio", "blocks_total", "blocks_free",
        "medium", "capacity_entries", "capacity_bytes",
    }
    assert (stats["tiers"]["l1"]["capacity_entries"], stats["tiers"]["l1"]["medium"]) == (PROMPT_BLOCKS + 1, "arena")
    assert stats["index"] == {"cached_blocks": PROMPT_BLOCKS, "active_prefixes": 1, "avg_prefix_tokens": 16.0}


# ---------------------------------------------------------------------------
# the hash index's statistics
# ---------------------------------------------------------------------------


def key(i: int) -> bytes:
    return i.to_bytes(4, "big")


def test_index_statistics_count_prefixes_and_their_lengths():
    index = BlockHashIndex()
    for i in range(3):  # prompt A: blocks 0-2
        index.add(key(i), key(i - 1) if i else None, 1)
    index.add(key(10), key(1), 2)  # prompt B shares A's first two blocks
    stats = index.stats(BLOCK)
    assert (stats.cached_blocks, stats.active_prefixes, stats.avg_prefix_tokens) == (4, 2, 3 * BLOCK)
    index.discard(key(2), 1)  # A's last block leaves: B's branch is the only prefix
    assert index.stats(BLOCK).active_prefixes == 1
    index.add(key(21), key(20), 1)  # its parent is not indexed: a prefix of one block
    stats = index.stats(BLOCK)
    assert (stats.active_prefixes, stats.avg_prefix_tokens) == (2, (3 + 1) * BLOCK / 2)
    index.check_integrity()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(-1, 15), st.integers(0, 2)), max_size=80))
def test_index_statistics_equal_a_recount_after_any_operations(ops):
    index = BlockHashIndex()
    for add, k, parent, tier in ops:
        if add:
            index.add(key(k), key(parent) if parent >= 0 and parent != k else None, 1 << tier)
        else:
            index.discard(key(k), 1 << tier)
        index.check_integrity()  # recounts leaves and summed depths the slow way and compares


def test_the_blocks_an_allocation_evicts_are_copied_off_the_arena_at_once(tmp_path):
    """A prompt that needs every L1 block evicts the last prompt's blocks: their data leaves the arena in one
    read (not one per block), each lands below with its own content, and the prompt's KV reads back intact."""
    runner = Runner(PROMPT_BLOCKS + 1, [StoreTier("ram", memory_tier(4 * PROMPT_BLOCKS))])
    try:
        _, first = runner.run(prompt(1))
        reads = []
        read = runner.arena.read_blocks
        runner.arena.read_blocks = lambda ids: reads.append(list(ids)) or read(ids)
        runner.run(prompt(2))  # all of prompt 1's blocks go down to make room
        # the write-back of the evicted blocks, then the runner's own read of the new prompt's KV
        assert len(reads) == 2, reads
        assert len(reads[0]) == PROMPT_BLOCKS, reads
        match, again = runner.run(prompt(1))
        assert match.hits["ram"] == PROMPT_BLOCKS and torch.equal(again, first)
    finally:
        runner.store.close()
