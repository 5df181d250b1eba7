"""An engine publishes what its cache holds as numbered batches of block events, and the fleet's index follows
them: what it believes a replica holds is what the replica holds, after stores, evictions, demotions and
clears; a lost, repeated or out-of-order batch or a restarted engine forces a snapshot, never a wrong belief;
and the router's reading of a request gives the block hashes the replica computed for it."""

from __future__ import annotations

import json

import pytest

from tierserve.cache.kv_events import KVEventBatch, KVEventLog, KVEvents
from tierserve.core.sampling_params import SamplingParams
from tierserve.fleet.kv_index import FleetKVIndex, ReplicaLoad, ReplicaMatch, choose
from tierserve.fleet.request_tokens import RequestTokens
from tierserve.testing import http_client, tiny_engine, tiny_settings

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
PROMPTS = [
    "the first prompt is long enough to fill a good number of KV blocks of four tokens each",
    "a second prompt, different from the very first token on, also several blocks long",
]
SETTINGS = {"kv_cache.block_size": 4, "kv_cache.l1_capacity": 8, "kv_cache.tiers": [{"name": "l2", "plugin": "memory", "capacity": 200}]}


def load_of(engine) -> ReplicaLoad:
    stats = engine.stats()
    return ReplicaLoad(engine.info.fingerprint, engine.info.block_size, stats.kv_blocks_free, stats.kv_blocks_total)


def follow(engine, index: FleetKVIndex, name: str = "r1") -> bool:
    epoch, seq = index.cursor(name)
    return index.apply(name, engine.kv_events(epoch, seq), load_of(engine))


def believed(index: FleetKVIndex, name: str = "r1") -> dict[bytes, int]:
    return dict(index.replicas[name].holds)


def actual(engine) -> dict[bytes, int]:
    """Positions (bits) of every block the engine's cache holds, from its own index."""
    store = engine.driver.core.store
    return {key: node.tiers for key, node in store.index.nodes.items() if node.tiers}


def test_the_index_follows_stores_evictions_demotions_and_clears():
    with tiny_engine(SETTINGS) as engine:
        index = FleetKVIndex()
        assert follow(engine, index)  # a snapshot of nothing
        engine.generate([PROMPTS[0]], GREEDY)
        assert follow(engine, index) and believed(index) == actual(engine) and believed(index)
        for _ in range(3):  # each prompt's blocks push the other's out of L1 into L2
            engine.generate(PROMPTS, GREEDY)
            assert follow(engine, index)
            assert believed(index) == actual(engine)
        assert any(bits == 0b10 for bits in believed(index).values())  # some blocks are in L2 only
        engine.clear_cache("all")
        assert follow(engine, index) and believed(index) == actual(engine) == {}


def test_a_lost_batch_a_repeated_one_or_a_restarted_engine_forces_a_snapshot():
    with tiny_engine(SETTINGS) as engine:
        index = FleetKVIndex()
        follow(engine, index)
        engine.generate([PROMPTS[0]], GREEDY)
        epoch, seq = index.cursor("r1")
        first = engine.kv_events(epoch, seq)  # read, then lost on its way
        engine.generate([PROMPTS[1]], GREEDY)
        second = engine.kv_events(first.epoch, first.seq)
        assert second.batches and second.batches[0].seq == first.seq + 1
        assert not index.apply("r1", second, load_of(engine))  # a gap: refused, belief dropped at once
        assert believed(index) == {} and index.cursor("r1") == (None, -1)
        snapshot = engine.kv_events(*index.cursor("r1"))
        assert snapshot.snapshot is not None
        assert index.apply("r1", snapshot, load_of(engine)) and believed(index) == actual(engine)
        assert not index.apply("r1", second, load_of(engine))  # replayed: out of order, refused again
        assert follow(engine, index) and believed(index) == actual(engine)
        other_epoch = KVEvents("another-engine", 5, (KVEventBatch(5, ((True, 0, b"x" * 16),)),))
        assert not index.apply("r1", other_epoch, load_of(engine)) and believed(index) == {}


def test_a_reader_further_behind_than_the_log_gets_a_snapshot():
    holdings = {0: [b"a"]}
    log = KVEventLog({0: "l1"}, lambda position: holdings[position], max_batches=2)
    first = log.since(None, -1)
    for key in (b"b", b"c", b"d"):
        log.record(True, 0, key)
        log.since(first.epoch, log.seq)  # seal a batch
    assert log.since(first.epoch, first.seq).snapshot == {0: [b"a"]}  # three batches behind, two kept
    assert [b.seq for b in log.since(first.epoch, log.seq - 2).batches] == [log.seq - 1, log.seq]
    log.record(True, 1, b"shared")  # a position not reported (a shared tier)
    assert log.since(first.epoch, log.seq).batches == ()


def test_the_routers_reading_of_a_request_gives_the_hashes_the_replica_holds():
    """Completions and chat, with and without an API key's tenant and a cache_salt: after the replica served
    the request, the index built from its events says it holds every full block of that prompt in L1."""
    settings = {**SETTINGS, "kv_cache.l1_capacity": 64, "auth.api_keys": ["key-a"], "auth.tenants": {"acme": ["key-a"]}}
    loaded = tiny_settings(settings)
    tokens = RequestTokens(loaded.settings)
    requests = [
        {"prompt": PROMPTS[0]},
        {"prompt": PROMPTS[1], "cache_salt": "s1"},
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPTS[0]}]},
    ]
    headers = {"authorization": "Bearer key-a"}
    with http_client(settings) as client:
        for body in requests:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = client.post(path, json={**body, "max_tokens": 1}, headers={"Authorization": "Bearer key-a"})
            assert response.status_code == 200, response.text
            index = FleetKVIndex()
            follow(client.engine, index)
            ids, salt = tokens.of(headers, json.dumps(body).encode())
            assert len(ids) == response.json()["usage"]["prompt_tokens"]
            [match] = index.match(ids, salt).values()
            assert match.l1_blocks == match.tier_blocks == len(ids) // 4, body
            assert index.match(ids, "another-salt")["r1"].tier_blocks == 0  # another tenant's hashes hold nothing
    assert tokens.of({}, b'{"prompt": "hi"}') is None  # no key: the replica will refuse it, no routing by prefix
    assert tokens.of(headers, b"not json") is None


def match(l1: int, tiers: int | None = None, free: int = 100, ttft: float | None = 0.1) -> ReplicaMatch:
    return ReplicaMatch(l1, l1 if tiers is None else tiers, free, ttft)


def first(names: list[str]) -> str:
    return sorted(names)[0]


@pytest.mark.parametrize(
    "matches, ongoing, chosen",
    [
        ({"a": match(12), "b": match(9)}, {"a": 0, "b": 0}, ("a", "kv_l1")),
        ({"a": match(0, 20), "b": match(9)}, {"a": 0, "b": 0}, ("a", "kv_tier")),  # 20 blocks below L1 beat 9 in it
        ({"a": match(2), "b": match(0)}, {"a": 3, "b": 1}, ("b", "no_match")),  # 2 of 16 blocks: a template's, not a prefix
        ({"a": match(0), "b": match(0)}, {"a": 3, "b": 1}, ("b", "no_match")),
        ({"a": match(10), "b": match(8)}, {"a": 12, "b": 1}, ("b", "kv_l1")),  # a is overloaded: the next best
        ({"a": match(10, free=2), "b": match(0)}, {"a": 0, "b": 0}, ("b", "kv_pressure")),  # 16 - 10 = 6 > 2 free
        ({"a": match(10, ttft=2.0), "b": match(8, ttft=0.2)}, {"a": 0, "b": 0}, ("b", "kv_l1")),  # a is slow
        ({"a": match(10, ttft=2.0), "b": match(0, ttft=0.2)}, {"a": 0, "b": 0}, ("b", "slow")),
        # four times the others' median is a replica serving misses, not a slow one: it keeps its prefix
        ({"a": match(10, ttft=0.4), "b": match(0, ttft=0.1), "c": match(0, ttft=0.05)}, {"a": 0, "b": 0, "c": 0}, ("a", "kv_l1")),
    ],
)
def test_choose_weighs_the_prefix_against_load_kv_pressure_and_ttft(matches, ongoing, chosen):
    assert choose(matches, ongoing, prompt_blocks=16, max_imbalance=8, pick=first) == chosen


def test_the_hub_hands_a_mirror_its_updates_in_order_or_its_whole_state():
    """A router's mirror applies the hub's publications in order; a mirror further behind than the hub's log, or
    ahead of a restarted hub, takes the hub's whole state; a replica the hub had to resync is dropped by both."""
    import asyncio

    from tierserve.fleet.kv_hub import HubMirror, KVHub

    hub, mirror = KVHub(max_log=2), HubMirror("tierserve")  # the mirror's thread is not started: applied by hand
    cursor = (None, -1)

    def publish(engine) -> bool:
        nonlocal cursor
        events = engine.kv_events(*cursor)
        applied = asyncio.run(hub.publish("r1", events, load_of(engine)))
        cursor = (events.epoch, events.seq) if applied else (None, -1)
        return applied

    def sync() -> None:
        mirror.apply(asyncio.run(hub.updates(mirror.version)))

    def same() -> bool:
        return mirror.index.replicas["r1"].holds == hub.index.replicas["r1"].holds == actual(engine)

    with tiny_engine(SETTINGS) as engine:
        assert publish(engine)
        sync()
        engine.generate([PROMPTS[0]], GREEDY)
        publish(engine)
        updates = asyncio.run(hub.updates(mirror.version))
        assert updates.full is None and len(updates.entries) == 1  # one publication since: a delta
        mirror.apply(updates)
        assert same()
        for prompt in PROMPTS * 2:  # four publications: more than the log keeps
            engine.generate([prompt], GREEDY)
            publish(engine)
        assert asyncio.run(hub.updates(mirror.version)).full is not None
        sync()
        assert same()
        engine.generate([PROMPTS[0]], GREEDY)
        lost = engine.kv_events(*cursor)  # read by the replica, never applied by the hub
        cursor = (lost.epoch, lost.seq)
        engine.generate([PROMPTS[1]], GREEDY)
        assert not publish(engine)  # the next publication does not follow: the hub resyncs the replica
        sync()
        assert "r1" not in mirror.index.replicas and hub.index.replicas["r1"].holds == {}
        assert publish(engine)  # the snapshot
        sync()
        assert same()
    restarted = KVHub()
    mirror.apply(asyncio.run(restarted.updates(mirror.version)))  # ahead of a new hub: its (empty) whole state
    assert mirror.index.replicas == {} and mirror.version == 0


def test_a_prompt_just_routed_counts_as_held_until_its_events_arrive_or_the_expectation_lapses():
    now = [100.0]
    index = FleetKVIndex(clock=lambda: now[0])
    load = ReplicaLoad("fp", 4, 50, 64)
    index.apply("a", KVEvents("e", 0, snapshot={}), load)
    index.apply("b", KVEvents("e", 0, snapshot={}), load)
    ids = list(range(40))
    index.expect("a", ids, None)
    assert index.match(ids, None)["a"].l1_blocks == 10 and index.match(ids, None)["b"].l1_blocks == 0
    assert index.match(ids, "other-tenant")["a"].l1_blocks == 0
    now[0] += 6.0  # EXPECT_SECONDS later, no events came (the request failed): no belief left
    index.apply("a", KVEvents("e", 0), load)  # a publication with nothing new keeps it live
    assert index.match(ids, None)["a"].l1_blocks == 0


def test_the_fleet_document_merges_the_shared_tiers_and_counts_decisions_per_replica():
    from tierserve.fleet.fleet_view import fleet_document

    redis = {"medium": "remote", "entries": 40, "bytes": 4000, "hits": 3, "misses": 1}
    replicas = {
        "r2": {"stale": False, "tiers": {"shared": {**redis, "entries": 42, "hits": 5}, "l2": {**redis, "medium": "memory"}}},
        "r1": {"stale": False, "tiers": {"shared": redis}},
        "r3": {"stale": True, "tiers": {"shared": {**redis, "hits": 100}}},  # gone: its figures are not the tier's now
    }
    document = fleet_document("kv_events", {"kv_l1": 3, "no_match": 1}, {"r1": {"kv_l1": 3}, "r2": {"no_match": 1}}, replicas)
    assert list(document["replicas"]) == ["r1", "r2", "r3"]
    assert document["replicas"]["r1"]["routing_decisions"] == {"kv_l1": 3} and document["replicas"]["r3"]["routing_decisions"] == {}
    assert document["shared_tiers"] == {"shared": {"entries": 42, "bytes": 4000, "hits": 8, "misses": 2, "replicas": 2}}


def test_a_mirrors_call_waits_for_news_and_is_answered_when_a_replica_publishes():
    """The hub answers a mirror that is up to date when something is published (a long poll), not at its deadline;
    with nothing published, after ``wait_seconds`` with no entries."""
    import asyncio
    import time

    from tierserve.fleet.kv_hub import KVHub

    hub = KVHub()
    load = ReplicaLoad("fp", 4, 50, 64)

    async def scenario() -> tuple[float, int, float, int]:
        started = time.monotonic()
        quiet = await hub.updates(hub.version, wait_seconds=0.2)
        quiet_took = time.monotonic() - started
        waiting = asyncio.ensure_future(hub.updates(hub.version, wait_seconds=30))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await hub.publish("r1", KVEvents("e", 0, snapshot={0: [b"k"]}), load)
        news = await waiting
        return quiet_took, len(quiet.entries), time.monotonic() - started, len(news.entries)

    quiet_took, quiet_entries, news_took, news_entries = asyncio.run(scenario())
    assert 0.15 <= quiet_took < 5 and quiet_entries == 0
    assert news_took < 5 and news_entries == 1


class _Hub:
    """The hub's ``publish`` as a replica's handle calls it (``.remote(...).result()``), into a real ``KVHub``."""

    def __init__(self) -> None:
        import asyncio

        from tierserve.fleet.kv_hub import KVHub

        self.hub, self.calls, self.publish = KVHub(), 0, self
        self.loop = asyncio.new_event_loop()

    def remote(self, *args):
        self.calls += 1
        result = self.loop.run_until_complete(self.hub.publish(*args))
        return type("Done", (), {"result": lambda _self: result})()


def test_a_replica_publishes_when_its_cache_changed_and_otherwise_only_a_heartbeat():
    """Nothing new in the cache, free blocks where they were: no publication until the heartbeat is due; a request
    that stored blocks is published at the next look, and the hub then believes what the engine holds."""
    from tierserve.fleet import kv_hub
    from tierserve.fleet.kv_hub import EventPublisher

    with tiny_engine(SETTINGS) as engine:
        hub = _Hub()
        publisher = EventPublisher("r1", engine, hub, lambda: None)
        assert publisher.publish_once() and hub.calls == 1  # the first: a snapshot
        for _ in range(5):
            publisher.publish_once()
        assert hub.calls == 1  # quiet engine: nothing sent
        engine.generate([PROMPTS[0]], GREEDY)
        publisher.publish_once()
        assert hub.calls == 2 and hub.hub.index.replicas["r1"].holds == actual(engine)
        publisher.published -= kv_hub.HEARTBEAT_SECONDS  # a heartbeat's worth of silence
        publisher.publish_once()
        assert hub.calls == 3


def test_a_replica_whose_core_was_replaced_publishes_at_once():
    """A restarted core counts its events from zero again, and an idle one may show the counts the old one last
    showed: its other epoch alone makes the replica publish, so the hub drops the old core's holdings at once."""
    from tierserve.fleet.kv_hub import EventPublisher

    with tiny_engine(SETTINGS) as old_core, tiny_engine(SETTINGS) as new_core:
        hub = _Hub()
        publisher = EventPublisher("r1", old_core, hub, lambda: None)
        assert publisher.publish_once()
        publisher.engine = new_core  # what the replica's client answers with after the supervisor's restart
        assert publisher.publish_once()  # asked from the old epoch, the new core answers with its snapshot
        assert hub.calls == 2 and hub.hub.index.replicas["r1"].epoch == new_core.kv_events(None, -1).epoch


def test_the_fleet_document_reports_what_routing_decisions_took():
    from tierserve.fleet.fleet_view import fleet_document

    document = fleet_document("kv_events", {}, {}, {}, [0.002] * 98 + [0.05, 0.09])
    assert document["routing_seconds"] == {"decisions": 100, "p50": 0.002, "p99": 0.05, "max": 0.09}
    assert fleet_document("power_of_two", {}, {}, {})["routing_seconds"]["decisions"] == 0
