"""The L1 eviction policy decides what stays cached: content that is hit often outlives content seen once.

Every access here goes through the real L1 path, as the scheduler drives it:
a request whose prompt is one full block for the trace key plus one token,
``match_prefix``, ``allocate_slots``, the block marked computed,
``cache_computed``, then ``free``. The pool holds ``capacity`` cached blocks
and one for the extra token, and there is no tier below L1, so a block the
policy evicts is gone: the next request for it is a miss.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence as Seq

import pytest

from bench.eviction_traces import frequency_trace, mixed_trace, replay
from tierserve.cache.block_pool import BlockPool
from tierserve.cache.kv_manager import KVCacheManager
from tierserve.cache.store import TieredStore
from tierserve.core.plugins import load_plugins
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.sequence import Sequence

pytestmark = pytest.mark.unit

POLICIES = load_plugins(allowlist=[]).registry("eviction_policies")
BLOCK = 2
PARAMS = SamplingParams()


class L1Cache:
    """A block pool with a prefix store and no lower tiers, driven one request per access."""

    def __init__(self, policy: str, capacity: int) -> None:
        self.pool = BlockPool(capacity + 1, BLOCK, POLICIES.get(policy).factory(capacity + 1))
        self.store = TieredStore(self.pool, None, "l1-eviction-test")
        self.kv = KVCacheManager(self.pool, self.store)
        self.tokens: dict[Hashable, int] = {}
        self.requests = 0

    def access(self, key: Hashable) -> bool:
        """Serve one request for ``key``'s block; True if that block came from the cache."""
        token = self.tokens.setdefault(key, len(self.tokens) + 1)
        self.requests += 1
        seq = Sequence(self.requests, f"r{self.requests}", [token, token, 0], 3, PARAMS)
        self.kv.match_prefix(seq)
        hit = seq.num_cached_tokens == BLOCK
        assert self.kv.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_computed(seq)
        self.kv.free(seq)
        return hit

    def hit_rate(self, trace: Seq[Hashable]) -> float:
        return sum(self.access(key) for key in trace) / len(trace)


# ---------------------------------------------------------------------------
# a block hit ten times against blocks seen once
# ---------------------------------------------------------------------------

# Block 0 is requested eleven times (one miss, ten hits), then blocks 1-3 once
# each; a fifth block then needs a slot in the full cache.
HOT_THEN_ONCE = [0] * 11 + [1, 2, 3]


@pytest.mark.parametrize(
    "policy, hot_block_survives",
    [
        ("lfu", True),  # 11 uses against 1
        ("adaptive", True),  # block 0 is in ARC's frequency list, 1-3 only in its recency list
        ("clock", True),  # block 0's reference bit buys it a second chance
        ("lru", False),  # recency only: block 0 was used least recently
    ],
)
def test_a_block_hit_ten_times_outlives_blocks_seen_once(policy, hot_block_survives):
    cache = L1Cache(policy, capacity=4)
    assert [cache.access(key) for key in HOT_THEN_ONCE] == [False] + [True] * 10 + [False] * 3
    assert cache.access(4) is False  # evicts one of the four cached blocks
    cache.store.check_integrity()
    assert cache.pool.evictions == 1

    assert cache.access(0) is hot_block_survives
    cache.store.check_integrity()


def test_under_lfu_the_blocks_seen_once_go_first_oldest_first():
    cache = L1Cache("lfu", capacity=4)
    for key in HOT_THEN_ONCE:
        cache.access(key)
    cache.access(4)  # evicts block 1, the oldest of those used once
    cache.access(5)  # evicts block 2
    assert [cache.access(key) for key in (0, 3)] == [True, True]
    assert cache.access(1) is False
    cache.store.check_integrity()


# ---------------------------------------------------------------------------
# a seeded trace replayed through the real L1 path ranks the policies as the benchmark does
# ---------------------------------------------------------------------------

CAPACITY = 100

# Each case: a shortened trace of bench/eviction_traces.py and the policies
# from best to worst in groups that ``python -m bench.eviction`` separates
# clearly on it (equal rank within a group; policies left out are within
# noise of a neighbour). Hit rates are deterministic.
RANKINGS = {
    "frequency": (lambda: frequency_trace(length=10_000), [{"lfu", "adaptive"}, {"clock", "lru"}]),
    "mixed": (lambda: mixed_trace(length=20_000), [{"adaptive"}, {"lru"}, {"lfu"}]),
}
MARGIN = 0.02  # every policy of a group beats every policy of the next by at least this


def assert_ranked(rates: dict[str, float], groups: list[set[str]]) -> None:
    for better, worse in zip(groups, groups[1:]):
        floor = min(rates[name] for name in better)
        ceiling = max(rates[name] for name in worse)
        assert floor >= ceiling + MARGIN, f"{sorted(better)} should beat {sorted(worse)}: {rates}"


@pytest.mark.parametrize("trace_name", sorted(RANKINGS))
def test_policies_rank_on_a_trace_through_l1_as_in_the_benchmark(trace_name):
    make_trace, groups = RANKINGS[trace_name]
    trace = make_trace()
    names = [component.name for component in POLICIES]
    through_l1 = {name: L1Cache(name, CAPACITY).hit_rate(trace) for name in names}
    benchmark = {name: replay(POLICIES.get(name).factory(CAPACITY), trace, CAPACITY) for name in names}

    assert_ranked(benchmark, groups)  # the benchmark's own ranking on this trace
    assert_ranked(through_l1, groups)
    assert len(set(through_l1.values())) == len(names), f"policies should differ in effect: {through_l1}"
    for name in names:
        # the pool evicts before it registers the newcomer, the benchmark after it inserts: close, not equal
        assert through_l1[name] == pytest.approx(benchmark[name], abs=0.02), (name, through_l1, benchmark)
