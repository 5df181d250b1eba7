"""Probes of a ``plugin = "redis"`` tier's own keys, against one real redis-server the lab starts once.

Each probe builds the tier as the engine builds it and looks at what a user
can see: the server's keys and connections, the tier's statistics, a log line.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.effects_cache import stored_size
from tests.effects_lab import Lab, entry, new_threads
from tests.redis_server import RedisServer
from tests.waiting import wait_until

PROBE_USER, PROBE_PASSWORD = "probe-user", "probe-password-1"


def server(lab: Lab) -> RedisServer:
    def start() -> RedisServer:
        started = RedisServer(lab.tmp / "redis-lab").start()
        started.client().execute_command("ACL", "SETUSER", PROBE_USER, "on", f">{PROBE_PASSWORD}", "~*", "+@all")
        return started

    return lab.once("redis-server", start)


def redis(lab: Lab, **own) -> dict:
    prefix = own.pop("key_prefix", f"probe-{time.monotonic_ns()}")  # every probe its own namespace
    return {"kv_cache.tiers": [{"name": "shared", "plugin": "redis", "url": server(lab).url, "key_prefix": prefix, **own}]}


def stored_names(lab: Lab, prefix: str) -> list[bytes]:
    return server(lab).client().keys(f"{prefix}:kv:*")


def put_and_flush(tier, count: int) -> None:
    for index in range(count):
        tier.put(entry(index))
    tier.flush()


def redis_url(lab: Lab) -> None:
    with lab.tier(redis(lab, key_prefix="url-probe")) as tier:
        put_and_flush(tier, 1)
        assert len(stored_names(lab, "url-probe")) == 1
    elsewhere = RedisServer(lab.tmp / "elsewhere")  # nothing listens there
    settings = redis(lab)
    settings["kv_cache.tiers"][0]["url"] = elsewhere.url
    with lab.tier(settings) as tier:
        put_and_flush(tier, 1)
        assert tier.stats.connection_errors > 0 and tier.get(entry(0).key) is None


def redis_username(lab: Lab) -> None:
    with lab.tier(redis(lab, key_prefix="user-probe", username=PROBE_USER, password=PROBE_PASSWORD)) as tier:
        put_and_flush(tier, 1)
        assert tier.stats.connection_errors == 0 and len(stored_names(lab, "user-probe")) == 1
    with lab.tier(redis(lab, username="nobody", password=PROBE_PASSWORD)) as tier:
        put_and_flush(tier, 1)
        assert tier.stats.connection_errors > 0  # the server refuses an unknown user


def redis_password(lab: Lab) -> None:
    with lab.tier(redis(lab, username=PROBE_USER, password="wrong-password")) as tier:
        put_and_flush(tier, 1)
        assert tier.stats.connection_errors > 0
    with lab.tier(redis(lab, username=PROBE_USER, password=PROBE_PASSWORD)) as tier:
        put_and_flush(tier, 1)
        assert tier.stats.connection_errors == 0 and tier.get(entry(0).key) is not None


def redis_password_env(lab: Lab) -> None:
    os.environ["TIERSERVE_PROBE_REDIS_PASSWORD"] = PROBE_PASSWORD
    try:
        with lab.tier(redis(lab, username=PROBE_USER, password_env="TIERSERVE_PROBE_REDIS_PASSWORD")) as tier:
            put_and_flush(tier, 1)
            assert tier.stats.connection_errors == 0 and tier.get(entry(0).key) is not None
    finally:
        del os.environ["TIERSERVE_PROBE_REDIS_PASSWORD"]
    with pytest.raises(Exception, match="TIERSERVE_PROBE_REDIS_PASSWORD"):
        with lab.tier(redis(lab, username=PROBE_USER, password_env="TIERSERVE_PROBE_REDIS_PASSWORD")):
            pass


def redis_key_prefix(lab: Lab) -> None:
    with lab.tier(redis(lab, key_prefix="team-a.cache")) as tier:
        put_and_flush(tier, 2)
    assert len(stored_names(lab, "team-a.cache")) == 2


def redis_compression_level(lab: Lab) -> None:
    with lab.tier(redis(lab, compression_level=19)) as tier:
        put_and_flush(tier, 1)
        assert tier.bytes_used == stored_size(19) < stored_size(3)


def redis_write_queue(lab: Lab) -> None:
    with lab.tier(redis(lab, write_queue=1, compression_level=22)) as tier:
        for index in range(20):  # faster than the writer compresses
            tier.put(entry(index))
        assert tier.stats.dropped_writes > 0


def redis_write_batch(lab: Lab) -> None:
    def round_trips(batch: int) -> int:
        with lab.tier(redis(lab, write_batch=batch)) as tier:
            trips = []
            pipeline = tier.client.pipeline

            def counted(*args, **kwargs):
                pipe = pipeline(*args, **kwargs)
                execute = pipe.execute
                pipe.execute = lambda: trips.append(1) or execute()
                return pipe

            tier.client.pipeline = counted
            with tier.lock:  # the writer waits for the lock after its first entry: the rest queue behind it
                for index in range(20):
                    tier.put(entry(index))
            tier.flush()
            assert tier.stats.dropped_writes == 0
            return len(trips)

    assert round_trips(1) == 40 and round_trips(64) <= 4  # two per batch: the first entry alone, then 19


def redis_writer_nice(lab: Lab) -> None:
    if not hasattr(os, "getpriority"):
        pytest.skip("thread priorities are a Linux feature")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = {t.ident for t in new_threads(set(), "tierserve-redis-writer")}
    with lab.tier(redis(lab, writer_nice=15)) as tier:
        [writer] = new_threads(before, "tierserve-redis-writer")
        put_and_flush(tier, 1)
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == min(19, base + 15)


def connections_while_paused(lab: Lab, **own) -> int:
    """Connections the tier holds after 4 lookups at once while the server held every command for 0.3 s
    (the pool keeps what it opened; the tier names its connections ``tierserve-<tier name>``)."""
    with lab.tier(redis(lab, timeout_seconds=2, **own)) as tier:
        put_and_flush(tier, 1)
        admin = server(lab).client()
        admin.client_pause(300)
        threads = [threading.Thread(target=tier.get, args=(entry(0).key,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(1 for client in admin.client_list() if client.get("name") == "tierserve-shared")


def redis_max_connections(lab: Lab) -> None:
    assert connections_while_paused(lab, max_connections=1) <= 2 < connections_while_paused(lab)


def redis_timeout_seconds(lab: Lab) -> None:
    for timeout, found in ((0.1, False), (2.0, True)):
        with lab.tier(redis(lab, timeout_seconds=timeout)) as tier:
            put_and_flush(tier, 1)
            server(lab).client().client_pause(500)
            assert (tier.get(entry(0).key) is not None) is found
            assert (tier.stats.connection_errors > 0) is not found
            wait_until(server(lab).client().ping, what="redis-server to answer after its pause")


def redis_retry_seconds(lab: Lab) -> None:
    for retry, found in ((60.0, False), (0.0, True)):
        with lab.tier(redis(lab, timeout_seconds=0.1, retry_seconds=retry)) as tier:
            put_and_flush(tier, 1)
            server(lab).client().client_pause(300)
            assert tier.get(entry(0).key) is None  # timed out: the server is skipped for retry_seconds
            wait_until(server(lab).client().ping, what="redis-server to answer after its pause")
            assert (tier.get(entry(0).key) is not None) is found


def redis_max_index_entries(lab: Lab) -> None:
    with lab.tier(redis(lab, key_prefix="index-probe", max_index_entries=2)) as tier:
        put_and_flush(tier, 4)
        assert len(tier) == 2 and len(stored_names(lab, "index-probe")) == 4
        assert tier.get(entry(0).key) is not None  # forgotten here, still on the server


PROBES = {
    "kv_cache.tiers[redis].url": redis_url,
    "kv_cache.tiers[redis].username": redis_username,
    "kv_cache.tiers[redis].password": redis_password,
    "kv_cache.tiers[redis].password_env": redis_password_env,
    "kv_cache.tiers[redis].key_prefix": redis_key_prefix,
    "kv_cache.tiers[redis].compression_level": redis_compression_level,
    "kv_cache.tiers[redis].write_queue": redis_write_queue,
    "kv_cache.tiers[redis].write_batch": redis_write_batch,
    "kv_cache.tiers[redis].writer_nice": redis_writer_nice,
    "kv_cache.tiers[redis].max_connections": redis_max_connections,
    "kv_cache.tiers[redis].timeout_seconds": redis_timeout_seconds,
    "kv_cache.tiers[redis].retry_seconds": redis_retry_seconds,
    "kv_cache.tiers[redis].max_index_entries": redis_max_index_entries,
}
