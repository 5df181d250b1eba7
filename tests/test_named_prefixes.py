"""Named, pinned prefixes (what a request's ``cache_key`` means): bounded by keys, pinned bytes and a TTL.

Every test drives a real ``TieredStore`` with real KV tensors; a key's
prefix is the keyed request's full prompt blocks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.store_helpers import BLOCK, PROMPT_BLOCKS, Requests, StoreTier, build_tier, prompt
from tierserve.cache.named_prefixes import NamedPrefixes

pytestmark = pytest.mark.unit

BLOCK_BYTES = 1024  # bytes of one test block: 256 float32


def keyed_store(tmp_path=None, l1_blocks: int = 3 * PROMPT_BLOCKS + 1) -> Requests:
    tiers = [StoreTier("l2", build_tier("memory", capacity=PROMPT_BLOCKS, max_bytes=0))]
    if tmp_path is not None:
        tiers.append(StoreTier("l3", build_tier("disk", path=str(tmp_path / "l3")), write_through=True))
    return Requests(l1_blocks, tiers)


def registry(requests: Requests, keys: int = 10, blocks: int = 100, ttl: float | None = None) -> NamedPrefixes:
    return NamedPrefixes(
        requests.store, max_keys=keys, max_pinned_bytes=blocks * BLOCK_BYTES, ttl_seconds=ttl, block_bytes=BLOCK_BYTES
    )


def pressure(requests: Requests, first: int = 50, count: int = 8) -> None:
    """Requests for prompts used once, enough to push anything unpinned out of l1 and l2."""
    for n in range(first, first + count):
        requests.run(prompt(n))


def keyed_request(requests: Requests, keys: NamedPrefixes, n: int, name: str, now: float, namespace: str = "t"):
    """A request with a cache key, as the engine will make one: use the key if known, run, register."""
    keys.use(namespace, name, 0, now)
    match, kv = requests.run(prompt(n))
    keys.register(namespace, name, requests.hashes(prompt(n)), now)
    return match, kv


# ---------------------------------------------------------------------------
# register, use, get
# ---------------------------------------------------------------------------


def test_a_keyed_prefix_stays_cached_under_pressure_and_hits_from_l1(tmp_path):
    requests = keyed_store(tmp_path, l1_blocks=2 * PROMPT_BLOCKS + 1)
    keys = registry(requests)
    try:
        _, cold = keyed_request(requests, keys, 0, "support-bot", now=100.0)
        pressure(requests)
        match, again = requests.run(prompt(0))
        assert match.hits["l1"] == PROMPT_BLOCKS and torch.equal(again, cold)
        used = keys.use("t", "support-bot", match.cached_blocks, now=130.0)
        assert (used.requests, used.hits, used.last_used, used.created) == (2, 1, 130.0, 100.0)

        got = keys.get("t", "support-bot")
        assert got.block_hashes == tuple(requests.hashes(prompt(0)))
        assert (got.prefix_tokens, got.pinned_bytes) == (PROMPT_BLOCKS * BLOCK, PROMPT_BLOCKS * BLOCK_BYTES)
        assert got.tiers.complete == ["l1", "l3"]  # computed in l1, written through to disk; never demoted to l2
        assert got.tiers.blocks == {"l1": PROMPT_BLOCKS, "l2": 0, "l3": PROMPT_BLOCKS}
        assert got.expires_at is None and keys.get("t", "unknown") is None
        keys.check_integrity()
    finally:
        requests.close()


def test_registering_a_key_again_pins_the_new_prefix_and_releases_the_old():
    requests = keyed_store()
    keys = registry(requests)
    keyed_request(requests, keys, 0, "k", now=1.0)
    keyed_request(requests, keys, 1, "k", now=2.0)
    assert keys.get("t", "k").block_hashes == tuple(requests.hashes(prompt(1)))
    assert requests.store.pool.pinned == set(requests.hashes(prompt(1)))
    assert keys.get("t", "k").requests == 2 and len(keys) == 1
    keys.check_integrity()


def test_a_prefix_over_the_byte_cap_alone_is_refused_and_changes_nothing():
    requests = keyed_store()
    keys = registry(requests, blocks=PROMPT_BLOCKS - 1)
    requests.run(prompt(0))
    with pytest.raises(ValueError, match=f"max_pinned_bytes = {(PROMPT_BLOCKS - 1) * BLOCK_BYTES}"):
        keys.register("t", "too-long", requests.hashes(prompt(0)), now=1.0)
    assert len(keys) == 0 and not requests.store.pool.pinned
    with pytest.raises(ValueError, match="must not be empty"):
        keys.register("t", "", [], now=1.0)


# ---------------------------------------------------------------------------
# bounds: key count, pinned bytes (shared blocks once), TTL
# ---------------------------------------------------------------------------


def test_the_key_cap_forgets_the_least_recently_used_key_first():
    requests = keyed_store()
    keys = registry(requests, keys=2)
    for n, name in enumerate(["a", "b"]):
        keyed_request(requests, keys, n, name, now=float(n))
    keys.use("t", "a", 1, now=5.0)  # "b" is now the least recently used
    keyed_request(requests, keys, 2, "c", now=6.0)
    assert [p.name for p in keys.list("t")] == ["a", "c"]
    assert requests.store.pool.pinned == set(requests.hashes(prompt(0)) + requests.hashes(prompt(2)))
    keys.check_integrity()


def test_the_byte_cap_counts_a_shared_block_once_and_forgets_the_oldest_key_first():
    requests = keyed_store()
    keys = registry(requests, blocks=2 * PROMPT_BLOCKS)
    requests.run(prompt(0))
    shared = requests.hashes(prompt(0))
    keys.register("t", "a", shared, now=1.0)
    keys.register("u", "a", shared, now=2.0)  # another tenant, the same blocks: still 4 blocks pinned
    assert keys.pinned_bytes == PROMPT_BLOCKS * BLOCK_BYTES
    keyed_request(requests, keys, 1, "b", now=3.0)  # 8 blocks: at the cap
    assert len(keys) == 3
    keyed_request(requests, keys, 2, "c", now=4.0)  # 12 blocks: ("t", "a") goes, but ("u", "a") pins the same
    assert [(p.namespace, p.name) for p in keys.list()] == [("t", "b"), ("t", "c")]
    assert keys.pinned_bytes == 2 * PROMPT_BLOCKS * BLOCK_BYTES
    keys.check_integrity()


def test_ttl_expiry_unpins_idle_keys_and_use_extends_it():
    requests = keyed_store(l1_blocks=2 * PROMPT_BLOCKS + 1)
    keys = registry(requests, ttl=60.0)
    keyed_request(requests, keys, 0, "idle", now=0.0)
    keyed_request(requests, keys, 1, "busy", now=0.0)
    keys.use("t", "busy", 1, now=50.0)
    assert keys.get("t", "busy").expires_at == 110.0
    assert keys.expire(now=59.0) == 0
    assert keys.expire(now=61.0) == 1
    assert [p.name for p in keys.list("t")] == ["busy"]
    assert requests.store.pool.pinned == set(requests.hashes(prompt(1)))
    pressure(requests)
    assert requests.run(prompt(1))[0].hits["l1"] == PROMPT_BLOCKS
    assert requests.run(prompt(0))[0].cached_blocks == 0  # unpinned, it was evicted like any block
    assert registry(requests).expire(now=1e12) == 0  # no TTL: never


# ---------------------------------------------------------------------------
# delete and namespaces
# ---------------------------------------------------------------------------


def test_delete_unpins_and_removes_the_blocks_from_every_tier(tmp_path):
    requests = keyed_store(tmp_path)
    keys = registry(requests)
    try:
        keyed_request(requests, keys, 0, "gone", now=1.0)
        assert keys.delete("t", "gone") and not keys.delete("t", "gone")
        assert all(requests.tiers_holding(key) == [] for key in requests.hashes(prompt(0)))
        assert requests.run(prompt(0))[0].cached_blocks == 0
    finally:
        requests.close()


def test_delete_keeps_blocks_another_key_pins_or_a_running_request_uses(tmp_path):
    requests = keyed_store(tmp_path)
    keys = registry(requests)
    try:
        requests.run(prompt(0))
        shared = requests.hashes(prompt(0))
        keys.register("tenant-a", "k", shared, now=1.0)
        keys.register("tenant-b", "k", shared, now=1.0)
        assert keys.delete("tenant-a", "k")
        assert all(requests.tiers_holding(key) == ["l1", "l3"] for key in shared)
        assert [p.namespace for p in keys.list()] == ["tenant-b"] and keys.list("tenant-a") == []

        running, _ = requests.start(prompt(0))
        assert keys.delete("tenant-b", "k")
        assert all(requests.tiers_holding(key) == ["l1"] for key in shared)  # in use: l1 keeps it
        requests.finish(running)
        assert not requests.store.pool.pinned
    finally:
        requests.close()


def test_namespaces_keep_the_same_name_apart():
    requests = keyed_store()
    keys = registry(requests)
    keyed_request(requests, keys, 0, "k", now=1.0, namespace="a")
    keyed_request(requests, keys, 1, "k", now=1.0, namespace="b")
    assert [p.block_hashes for p in keys.list("a")] == [tuple(requests.hashes(prompt(0)))]
    assert [p.block_hashes for p in keys.list("b")] == [tuple(requests.hashes(prompt(1)))]
    assert keys.delete("a", "k")
    assert keys.get("b", "k") is not None
    assert requests.store.pool.pinned == set(requests.hashes(prompt(1)))
    keys.check_integrity()


# ---------------------------------------------------------------------------
# any sequence of operations keeps every book straight
# ---------------------------------------------------------------------------


class KeyedStoreMachine(RuleBasedStateMachine):
    """Requests, keys (register/use/delete/expire), direct pins and evictions, on L1 and two memory tiers.

    After every step the store, the pool and the registry pass their integrity
    checks, and no pinned block has left a tier it was in.
    """

    @initialize(keys=st.integers(1, 3), blocks=st.integers(PROMPT_BLOCKS, 2 * PROMPT_BLOCKS))
    def setup(self, keys: int, blocks: int) -> None:
        tiers = [
            StoreTier("l2", build_tier("memory", capacity=PROMPT_BLOCKS, max_bytes=0)),
            StoreTier("l3", build_tier("memory", capacity=2 * PROMPT_BLOCKS, max_bytes=0)),
        ]
        self.requests = Requests(4 * PROMPT_BLOCKS + 2, tiers)
        self.store = self.requests.store
        self.keys = registry(self.requests, keys=keys, blocks=blocks, ttl=10.0)
        self.direct: list[list[bytes]] = []  # pins made directly on the store, still held
        self.running = []
        self.now = 0.0
        self.placed = self.pinned_placement()

    def pinned_placement(self) -> dict[bytes, int]:
        return {key: self.store.index.tiers_of(key) for key in self.store.pins.pinned_keys()}

    def fits(self) -> bool:
        """Whether a request can be admitted (pinned blocks are not free: the engine would wait)."""
        return self.store.pool.num_free_blocks >= PROMPT_BLOCKS + 1

    @rule(n=st.integers(0, 5))
    def request(self, n: int) -> None:
        if self.fits():
            self.requests.run(prompt(n))

    @precondition(lambda self: len(self.running) < 2)
    @rule(n=st.integers(0, 5))
    def start(self, n: int) -> None:
        if self.fits():
            self.running.append(self.requests.start(prompt(n))[0])

    @precondition(lambda self: self.running)
    @rule()
    def finish(self) -> None:
        self.requests.finish(self.running.pop(0))

    @rule(n=st.integers(0, 5), name=st.sampled_from(["a", "b", "c"]), namespace=st.sampled_from(["x", "y"]))
    def register(self, n: int, name: str, namespace: str) -> None:
        self.now += 1
        self.keys.register(namespace, name, self.requests.hashes(prompt(n)), self.now)

    @rule(name=st.sampled_from(["a", "b", "c"]), namespace=st.sampled_from(["x", "y"]), hit=st.booleans())
    def use(self, name: str, namespace: str, hit: bool) -> None:
        self.now += 1
        self.keys.use(namespace, name, int(hit), self.now)

    @rule(name=st.sampled_from(["a", "b", "c"]), namespace=st.sampled_from(["x", "y"]))
    def delete(self, name: str, namespace: str) -> None:
        self.keys.delete(namespace, name)

    @rule(later=st.floats(0, 20))
    def expire(self, later: float) -> None:
        self.keys.expire(self.now + later)

    @precondition(lambda self: not self.direct)
    @rule(n=st.integers(0, 5), blocks=st.integers(1, PROMPT_BLOCKS))
    def pin(self, n: int, blocks: int) -> None:
        keys = self.requests.hashes(prompt(n))[:blocks]
        self.store.pin(keys)
        self.direct.append(keys)

    @precondition(lambda self: self.direct)
    @rule()
    def unpin(self) -> None:
        self.store.unpin(self.direct.pop(0))

    @rule(n=st.integers(0, 5))
    def evict(self, n: int) -> None:
        self.store.evict_keys(self.requests.hashes(prompt(n)))

    @rule()
    def offload(self) -> None:
        self.store.offload()

    @invariant()
    def books_balance(self) -> None:
        self.store.check_integrity()
        self.keys.check_integrity()
        placed = self.pinned_placement()
        for key, tiers in self.placed.items():
            if key in placed:
                assert placed[key] & tiers == tiers, f"pinned block {key.hex()} left a tier"
        self.placed = placed

    def teardown(self) -> None:
        if hasattr(self, "requests"):
            while self.running:
                self.finish()


TestKeyedStoreMachine = KeyedStoreMachine.TestCase
TestKeyedStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
