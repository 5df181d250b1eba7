"""The shared redis tier against a real redis-server: sharing across processes, faults, isolation, secrets."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.engine_helpers import build_checkpoint, hf_greedy, make_engine
from tests.redis_server import RedisServer
from tests.test_cache_tiers import FINGERPRINT, make_tier
from tests.waiting import wait_until
from tierserve.cache.hashing import block_hash, root_hash
from tierserve.cache.tier import CacheEntry
from tierserve.settings.config import load_settings
from tierserve.settings.logs import configure_logging
from tierserve.core.sampling_params import SamplingParams
from tierserve.settings.secrets import settings_secrets

pytestmark = pytest.mark.redis

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SYSTEM = "You are a terse assistant for a bakery: prices, opening hours and allergens only. " * 2
PROMPT = SYSTEM + "Do you sell rye bread?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")
    return path, hf_greedy(path, [PROMPT], NEW_TOKENS)[0]


def entry(index: int, parent: bytes | None = None) -> CacheEntry:
    tokens = tuple(range(index * 4, index * 4 + 4))
    key = block_hash(parent or root_hash(FINGERPRINT, 4), tokens)
    return CacheEntry(key, parent, tokens, torch.full((2, 2, 4, 2, 8), float(index)))


def redis_tier(server: RedisServer, **options):
    return make_tier("redis", url=server.url, **options)


def redis_tiers(server: RedisServer, **options) -> dict:
    """Engine settings with L1 only above a redis tier (written through: a shared tier's default)."""
    tier = {"name": "redis", "plugin": "redis", "url": server.url, **options}
    return {"kv_cache__block_size": 4, "kv_cache__tiers": [tier]}


def test_an_entry_written_by_one_tier_is_read_by_another_and_checked(server):
    writer, reader = redis_tier(server), redis_tier(server)
    try:
        first = entry(1)
        writer.put(first)
        writer.flush()
        assert writer.contains(first.key) and writer.stats.stored_bytes > 0
        assert not reader.contains(first.key)  # the reader has not seen it: the store asks a shared tier anyway
        got = reader.get(first.key)
        assert got is not None and got.token_ids == first.token_ids and torch.equal(got.kv, first.kv)
        assert reader.contains(first.key) and reader.stats.hits == 1

        client = server.client()
        [name] = client.keys(f"tierserve:kv:*:{first.key.hex()}")
        client.set(name, client.get(name)[:-7])  # truncated on the server
        assert redis_tier(server).get(first.key) is None
        assert not client.exists(name)  # the bad value was deleted
        assert reader.stats.corrupt == 0

        other_model = make_tier("redis", url=server.url, fingerprint="another-model")
        writer.put(second := entry(2))
        writer.flush()
        assert other_model.get(second.key) is None  # keys are namespaced by the model
        other_model.close()
    finally:
        writer.close()
        reader.close()


def test_get_many_reads_every_key_in_one_round_trip(server):
    """The store's loader reads a prompt's blocks with ``get_many``: one MGET for all of them, the same entries
    and counters as one ``get`` each up to the first miss, and nothing after it counted."""
    writer, reader = redis_tier(server, key_prefix="many"), redis_tier(server, key_prefix="many")
    try:
        entries, parent = [], None
        for index in range(5):
            entries.append(item := entry(10 + index, parent))
            parent = item.key
            writer.put(item)
        writer.flush()
        calls = []
        mget = reader.client.mget
        reader.client.mget = lambda names: calls.append(len(names)) or mget(names)
        got = reader.get_many([item.key for item in entries])
        assert calls == [5] and len(got) == 5
        assert all(torch.equal(g.kv, e.kv) and g.token_ids == e.token_ids for g, e in zip(got, entries))
        assert (reader.stats.hits, reader.stats.misses) == (5, 0)

        missing = entry(99).key  # a gap: the blocks after it are read in the same trip, not used or counted
        got = reader.get_many([entries[0].key, entries[1].key, missing, entries[2].key])
        assert calls == [5, 4] and [g.key for g in got] == [entries[0].key, entries[1].key]
        assert (reader.stats.hits, reader.stats.misses) == (7, 1)
    finally:
        writer.close()
        reader.close()


def test_queued_writes_go_out_in_pipelined_batches(server):
    """The writer sends the writes queued back to back together: two round trips per batch (which exist, then
    the new ones set), not two per entry; a key another process wrote is kept, not written again."""
    writer = redis_tier(server, key_prefix="batched", write_batch=16)
    other = redis_tier(server, key_prefix="batched")
    try:
        entries, parent = [], None
        for index in range(40):
            entries.append(item := entry(100 + index, parent))
            parent = item.key
        other.put(entries[5])
        other.flush()
        trips = []
        pipeline = writer.client.pipeline

        def counted(*args, **kwargs):
            pipe = pipeline(*args, **kwargs)
            execute = pipe.execute
            pipe.execute = lambda: trips.append(len(pipe.command_stack)) or execute()
            return pipe

        writer.client.pipeline = counted
        with writer.lock:  # the writer waits for the tier's lock after taking its first entry: 39 queue behind
            writer.put_many(entries)
        writer.flush()
        assert len(trips) <= 2 + 2 * -(-39 // 16) and max(trips) <= 16, trips  # the first alone, then 16, 16, 7
        assert sum(trips) >= 40 + 39  # an EXISTS each, a SET each new one (a STRLEN for the one there already)
        reader = redis_tier(server, key_prefix="batched")
        got = reader.get_many([item.key for item in entries])
        assert len(got) == 40 and all(torch.equal(g.kv, e.kv) for g, e in zip(got, entries))
        assert writer.stats.dropped_writes == 0 and writer.bytes_used > 0
        reader.close()
    finally:
        writer.close()
        other.close()


def test_ttl_becomes_the_key_expiry_and_clear_empties_the_model_namespace(server):
    tier = make_tier("redis", ttl_seconds=600, url=server.url, key_prefix="ttl-test")
    try:
        tier.put(first := entry(3))
        tier.put(entry(4, first.key))
        tier.flush()
        client = server.client()
        names = client.keys("ttl-test:kv:*")
        assert len(names) == 2 and all(0 < client.pttl(name) <= 600_000 for name in names)
        assert tier.clear() == 2 and client.keys("ttl-test:kv:*") == [] and len(tier) == 0
    finally:
        tier.close()


def test_a_server_evicting_under_maxmemory_gives_misses_not_errors(tmp_path):
    full = RedisServer(tmp_path / "full", "--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru").start()
    tier = redis_tier(full)
    try:
        generator = torch.Generator().manual_seed(0)
        entries = [
            CacheEntry(bytes([i % 256, i // 256]) * 8, None, (i,), torch.randn(2, 2, 4, 2, 64, generator=generator))
            for i in range(1000)
        ]  # ~8 MB of incompressible blocks for a 3 MB server
        for item in entries:
            tier.put(item)
            tier.flush()
        found = [tier.get(item.key) for item in entries]
        # the server's LRU is sampled (approximate): the oldest entries are mostly gone, not each one
        assert sum(item is None for item in found[:100]) >= 50, [item is None for item in found[:100]]
        assert found[-1] is not None and torch.equal(found[-1].kv, entries[-1].kv)
        assert len(tier) < len(entries)  # what the server evicted is forgotten once a lookup misses
        assert tier.stats.connection_errors == tier.stats.write_errors == tier.stats.corrupt == 0
    finally:
        tier.close()
        full.stop()


def test_an_unreachable_server_means_misses_and_counted_errors_then_recovery(tmp_path):
    down = RedisServer(tmp_path / "down")  # not started yet
    tier = redis_tier(down, retry_seconds=0.2, timeout_seconds=0.2)
    try:
        tier.put(first := entry(5))
        tier.flush()
        assert tier.get(first.key) is None
        assert tier.stats.connection_errors >= 1 and tier.stats.dropped_writes >= 1
        down.start()
        reader = redis_tier(down)

        def written() -> bool:  # once retry_seconds have passed, the next command tries the server again
            tier.put(first)
            tier.flush()
            return reader.get(first.key) is not None

        wait_until(written, what="a write to reach the restarted server")
        reader.close()
    finally:
        tier.close()
        down.stop()


def test_a_shared_tier_is_written_through_unless_its_entry_says_not(server, checkpoint):
    """A redis entry without ``write_through``: every computed block is published, so a second engine finds the
    prompt; ``write_through = false``: only L1 evictions would reach it, and here none happen."""
    path, expected = checkpoint
    for write_through, shared in ((None, True), (False, False)):
        options = {"key_prefix": f"default-{write_through}"} | ({} if write_through is None else
                                                                 {"write_through": write_through})  # fmt: skip
        first = make_engine(path, **redis_tiers(server, **options))
        try:
            first.generate([PROMPT], GREEDY)
            assert (first.stats().cache.write_through > 0) is shared
        finally:
            first.close()
        second = make_engine(path, **redis_tiers(server, **options))
        try:
            [again] = second.generate([PROMPT], GREEDY)
            assert again.token_ids == expected and (again.cached_tokens > 0) is shared
        finally:
            second.close()


def test_two_processes_share_a_prefix_through_redis_with_the_cold_output(server, checkpoint, tmp_path):
    path, expected = checkpoint
    settings = redis_tiers(server, key_prefix="two-processes")
    script = textwrap.dedent(
        f"""
        import json
        from tests.engine_helpers import make_engine
        from tierserve.core.sampling_params import SamplingParams
        engine = make_engine({str(path)!r}, **{settings!r})
        [result] = engine.generate([{PROMPT!r}], SamplingParams(temperature=0, max_tokens={NEW_TOKENS}, ignore_eos=True))
        engine.close()  # flushes the redis writes
        print(json.dumps({{"tokens": result.token_ids, "cached": result.cached_tokens}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    a = json.loads(first.stdout.strip().splitlines()[-1])
    assert a["tokens"] == expected and a["cached"] == 0

    engine = make_engine(path, **settings)  # process B: its own empty L1, the same server
    try:
        [b] = engine.generate([PROMPT], GREEDY)
        stats = engine.stats().cache
        assert b.token_ids == expected
        assert b.cached_tokens > 0 and stats.promotions["redis"] * 4 == b.cached_tokens
        assert stats.tiers["redis"].hits > 0
        engine.check_integrity()
    finally:
        engine.close()


def test_redis_killed_mid_run_costs_misses_never_a_request(checkpoint, tmp_path):
    path, expected = checkpoint
    own = RedisServer(tmp_path / "own").start()
    engine = make_engine(path, **redis_tiers(own, retry_seconds=0.2, timeout_seconds=0.2))
    try:
        [cold] = engine.generate([PROMPT], GREEDY)
        engine.flush_cache()
        own.kill()
        engine.clear_cache("l1")
        [during] = engine.generate([PROMPT], GREEDY)  # the lookup and the write-through fail: computed again
        assert cold.token_ids == during.token_ids == expected and during.cached_tokens == 0
        assert engine.stats().cache.tiers["redis"].connection_errors > 0
        own.start()  # an empty server on the same port

        def served_from_redis() -> bool:  # once retry_seconds have passed, the engine uses the server again
            engine.clear_cache("l1")
            [after] = engine.generate([PROMPT], GREEDY)  # written through again now that the server is back
            engine.clear_cache("l1")
            engine.flush_cache()
            [hit] = engine.generate([PROMPT], GREEDY)
            assert after.token_ids == hit.token_ids == expected
            return hit.cached_tokens > 0

        wait_until(served_from_redis, what="a prefix served from the restarted server")
    finally:
        engine.close()
        own.stop()


def test_a_password_is_refused_in_the_url_and_never_logged(tmp_path, monkeypatch):
    for url in ("redis://:hunter22@h:1/0", "redis://h:1/0?password=hunter22"):
        with pytest.raises(Exception, match="password or password_env"):
            load_settings(None, environ={}, overrides={("kv_cache", "tiers"): [{"name": "r", "plugin": "redis", "url": url}]})
    monkeypatch.setenv("TS_TEST_REDIS_PASSWORD", "s3cret-redis-pass")
    tiers = [{"name": "r", "plugin": "redis", "url": "redis://127.0.0.1:1/0", "password_env": "TS_TEST_REDIS_PASSWORD"}]
    loaded = load_settings(None, environ={}, overrides={("kv_cache", "tiers"): tiers})
    stream = io.StringIO()
    configure_logging(loaded.settings.logging, stream=stream, secrets=settings_secrets(loaded.settings))
    import structlog

    structlog.get_logger("test").warning("oops", detail="auth failed with s3cret-redis-pass")
    assert "s3cret-redis-pass" not in stream.getvalue() and "[redacted]" in stream.getvalue()


def test_the_server_evicts_so_an_eviction_policy_in_the_entry_is_refused():
    tier = {"name": "r", "plugin": "redis", "url": "redis://127.0.0.1:1/0", "eviction_policy": "lfu"}
    with pytest.raises(Exception, match=r"kv_cache.tiers\[0\].eviction_policy: .*maxmemory-policy"):
        load_settings(None, environ={}, overrides={("kv_cache", "tiers"): [tier]})


def test_the_redis_tier_keeps_the_tier_rules_that_apply_to_a_server_evicting_by_itself(server):
    """tierserve.testing's suite over the redis tier: its bound is the server's (unknown here), so the bound and
    pin rules are reported as skipped; every other rule runs against the real server."""
    from tierserve.plugins.tiers.redis_tier import RedisTier
    from tierserve.testing import check_cache_tier

    checked = check_cache_tier(RedisTier, {"url": server.url})
    skipped = [name for name in checked if "skipped" in name]
    assert [name.split(" ")[0] for name in skipped] == ["keeps_its_bound_and_accounts_for_every_entry",
                                                        "pinned_entries_outlive_the_bound"]  # fmt: skip
    assert len(checked) == 13
