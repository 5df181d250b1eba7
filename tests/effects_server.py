"""Probes of the keys the server, the monitor, authentication, logging and plugin loading read."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import structlog
import uvicorn

from tests.effects_lab import Lab, greedy, run
from tests.server_helpers import free_port
from tests.waiting import wait_until
from tierserve.server.app import server_config
from tierserve.settings.config import load_settings
from tierserve.engine import RequestOutput
from tierserve.engine.process import EngineProcessError
from tierserve.models.builtin_models import write_checkpoint
from tierserve.core.errors import ConfigError
from tierserve.settings.logs import configure_logging
from tierserve.server.stats_document import current_alerts

LONG = "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read books."
FAST_MONITOR = {"monitoring.collection_interval_seconds": 0.02}
TENANT_PROMPT = "A prompt long enough to fill two blocks of the cache, so a second key could find it there."


@contextmanager
def serving(lab: Lab, values: dict) -> Iterator[uvicorn.Server]:
    """What ``tierserve serve`` runs for these settings, on a thread, until the block ends."""
    server = uvicorn.Server(server_config(lab.settings({"server.engine_process": False, **values})))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=60)
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def cache_stats(lab: Lab, values: dict, engine=None, wait: float = 0.0) -> dict:
    """``/v1/cache/stats`` of an app with these settings, after ``wait`` seconds of monitoring."""
    with lab.http(values, engine) as client:
        if wait:
            threading.Event().wait(wait)
        response = client.get("/v1/cache/stats")
        assert response.status_code == 200, response.text
        return response.json()


def alert_names(document: dict) -> set[str]:
    return {alert["name"] for alert in document["alerts"]}


# ---- [server] --------------------------------------------------------------------------------


def server_host(lab: Lab) -> None:
    with serving(lab, {"server.host": "0.0.0.0", "server.port": free_port()}) as server:
        assert server.servers[0].sockets[0].getsockname()[0] == "0.0.0.0"  # every interface, not just loopback


def server_port(lab: Lab) -> None:
    port = free_port()
    with serving(lab, {"server.port": port}):
        assert httpx.get(f"http://127.0.0.1:{port}/health/live").json() == {"status": "alive"}


def _slow_client(port: int, sent: bytes, wait: float) -> bytes:
    """What the server sends back (b"" once it closed the connection) to a client that sent ``sent`` and then
    nothing for ``wait`` seconds."""
    import socket

    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(sent)
    client.settimeout(wait)
    try:
        return client.recv(1024)
    except TimeoutError:
        return b"(still open)"
    finally:
        client.close()


def _closes_slow_clients(lab: Lab, key: str, partial: bytes) -> None:
    """Under ``key`` = 0.3 s a client that sent ``partial`` and stalls is disconnected within 1 s; by default not."""
    for values, expected in (({key: 0.3}, b""), ({}, b"(still open)")):
        port = free_port()
        with serving(lab, {"server.port": port, **values}):
            assert _slow_client(port, partial, 1.0) == expected


def server_header_timeout_seconds(lab: Lab) -> None:
    _closes_slow_clients(lab, "server.header_timeout_seconds", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")


def server_body_timeout_seconds(lab: Lab) -> None:
    partial = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\""
    _closes_slow_clients(lab, "server.body_timeout_seconds", partial)


def server_max_connections(lab: Lab) -> None:
    import socket

    port = free_port()
    with serving(lab, {"server.port": port, "server.max_connections": 2}):
        assert httpx.get(f"http://127.0.0.1:{port}/health/live").status_code == 200
        idle = socket.create_connection(("127.0.0.1", port))  # a second connection, open
        try:
            wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health/live").status_code == 503, timeout=5)
        finally:
            idle.close()


def server_shutdown_grace_seconds(lab: Lab) -> None:
    # cheaper than a shutdown with a request hanging: what serve hands uvicorn, which cancels requests after it
    assert server_config(lab.settings({"server.shutdown_grace_seconds": 2.5})).timeout_graceful_shutdown == 2.5


def server_max_request_bytes(lab: Lab) -> None:
    with lab.http({"server.max_request_bytes": 64}) as client:
        response = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1})
        assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"


def server_rate_limit_per_minute(lab: Lab) -> None:
    with lab.http({"server.rate_limit_per_minute": 2}) as client:
        assert [client.get("/v1/models").status_code for _ in range(3)] == [200, 200, 429]


def server_public_health(lab: Lab) -> None:
    with lab.http({"auth.api_keys": ["sk-1"]}) as client:
        assert client.get("/health").status_code == 200
    with lab.http({"auth.api_keys": ["sk-1"], "server.public_health": False}) as client:
        assert client.get("/health").status_code == 401
        assert client.get("/health", headers={"Authorization": "Bearer sk-1"}).status_code == 200


def server_public_metrics(lab: Lab) -> None:
    with lab.http({"auth.api_keys": ["sk-1"]}) as client:  # unset: private once keys exist
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer sk-1"}).status_code == 200
    with lab.http({"auth.api_keys": ["sk-1"], "server.public_metrics": True}) as client:
        assert client.get("/metrics").status_code == 200
    with lab.http({}) as client:  # no keys: public
        assert client.get("/metrics").status_code == 200


def server_retry_after_seconds(lab: Lab) -> None:
    values = {"server.retry_after_seconds": 7, "scheduler.max_waiting_requests": 1}
    with lab.engine(values) as engine, lab.http(values, engine) as client:
        engine.shutdown()  # nothing steps the core now: the next request stays queued
        engine.submit(engine.encode_prompt("queued"), greedy())
        response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
        assert response.status_code == 503 and response.headers["retry-after"] == "7"
        assert response.json()["error"]["code"] == "queue_full"


def server_max_stream_backlog(lab: Lab) -> None:
    def unread_after_steps(values: dict) -> RequestOutput:
        """Step an engine while nobody reads the request's stream; then read its last output."""

        async def scenario() -> RequestOutput:
            request_id, stream = engine.submit(engine.encode_prompt(LONG), greedy(12), loop=asyncio.get_running_loop())
            for _ in range(14):
                engine.step()
            return [output async for output in engine.outputs(request_id, stream)][-1]

        with lab.engine(values) as engine:
            return asyncio.run(scenario())

    assert unread_after_steps({}).finish_reason == "length"
    last = unread_after_steps({"server.max_stream_backlog": 3})
    assert last.finish_reason == "abort" and last.completion_tokens < 12


# ---- [monitoring] -----------------------------------------------------------------------------


def server_engine_max_restarts(lab: Lab) -> None:
    # the default restarts a killed core up to 5 times in a row (0: never, tests/test_engine_process.py); with 1,
    # a core that cannot load again (its checkpoint is gone) is tried once, then the supervisor gives up for good
    doomed = write_checkpoint(lab.tmp / "doomed", "llama", seed=1)
    values = {"model.path": str(doomed), "server.engine_max_restarts": 1, "server.engine_restart_backoff_seconds": 0.1}
    with lab.engine(values, process=True) as engine:
        shutil.rmtree(doomed)
        os.kill(engine.driver.process.pid, signal.SIGKILL)
        wait_until(lambda: engine.supervision().state == "failed", timeout=120, what="the supervisor to give up")
        status = engine.supervision()
        assert (status.attempt, status.restarts, status.last_exit_reason) == (1, 0, "it was killed by SIGKILL")
        with pytest.raises(EngineProcessError, match=r"could not be started again .* after server.engine_max_restarts "
                           r"\(1\) restarts in a row"):  # fmt: skip
            run(engine, "Hello")


def server_engine_restart_backoff_seconds(lab: Lab) -> None:
    # the default waits 1 s before a restart: a client is told to come back in a few seconds, here in minutes
    values = {"server.engine_restart_backoff_seconds": 120.0}
    with lab.engine(values, process=True) as engine, lab.http(values, engine) as client:
        os.kill(engine.driver.process.pid, signal.SIGKILL)
        wait_until(lambda: engine.supervision().state == "restarting", timeout=30, what="the restart to be scheduled")
        response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
        assert response.status_code == 503 and int(response.headers["retry-after"]) > 60
        assert (response.json()["error"]["code"], response.json()["error"]["retryable"]) == ("engine_restarting", True)
        assert client.get("/health").json()["status"] == "restarting"


def monitoring_enabled(lab: Lab) -> None:
    assert cache_stats(lab, FAST_MONITOR, wait=0.3)["trend_points"]
    assert cache_stats(lab, {**FAST_MONITOR, "monitoring.enabled": False}, wait=0.3)["trend_points"] == []


def monitoring_collection_interval_seconds(lab: Lab) -> None:
    assert cache_stats(lab, {}, wait=0.3)["trend_points"] == []  # every 30 s by default
    assert cache_stats(lab, FAST_MONITOR, wait=0.3)["trend_points"]


def monitoring_trend_samples(lab: Lab) -> None:
    assert len(cache_stats(lab, {**FAST_MONITOR, "monitoring.trend_samples": 3}, wait=0.5)["trend_points"]) == 3


def monitoring_detailed_profiling(lab: Lab) -> None:
    assert lab.shared.stats().profiling is None
    with lab.engine({"monitoring.detailed_profiling": True}) as engine:
        run(engine, LONG)
        run(engine, LONG)
        profiling = engine.stats().profiling
        assert all(stats.count > 0 and stats.seconds > 0 for stats in profiling.phases().values())
        with lab.http({}, engine) as client:
            assert 'tierserve_step_phase_seconds_count{phase="forward"}' in client.get("/metrics").text


def monitoring_prometheus(lab: Lab) -> None:
    with lab.http({"monitoring.prometheus": False}) as client:
        response = client.get("/metrics")
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def monitoring_alert_hit_rate_below(lab: Lab) -> None:
    run(lab.shared, "a prompt nobody sent before, so its blocks miss")
    assert "low_hit_rate" not in alert_names(cache_stats(lab, {}))
    assert "low_hit_rate" in alert_names(cache_stats(lab, {"monitoring.alert_hit_rate_below": 0.999}))


def monitoring_alert_memory_bytes_above(lab: Lab) -> None:
    run(lab.shared, LONG)
    lab.shared.offload_cache()  # into the L2 memory tier
    assert "high_memory" not in alert_names(cache_stats(lab, {}))
    assert "high_memory" in alert_names(cache_stats(lab, {"monitoring.alert_memory_bytes_above": 1}))


def monitoring_alert_dropped_writes_above(lab: Lab) -> None:
    slow_disk = {"name": "l2", "plugin": "disk", "path": str(lab.tmp), "write_through": True, "write_queue": 1,
                 "compression_level": 22}  # fmt: skip
    values = {"kv_cache.block_size": 4, "kv_cache.tiers": [slow_disk]}
    with lab.engine(values) as engine:
        run(engine, LONG)  # its prompt's blocks are written through at once, faster than level 22 compresses
        assert engine.stats().cache.tiers["l2"].dropped_writes > 0
        assert "dropped_writes" in alert_names(cache_stats(lab, values, engine))
        assert "dropped_writes" not in alert_names(cache_stats(lab, {**values, "monitoring.alert_dropped_writes_above": 10**6}, engine))


def monitoring_alert_queue_fraction_above(lab: Lab) -> None:
    with lab.engine({"scheduler.max_num_seqs": 1}) as engine:
        for prompt in ("a", "b", "c"):
            engine.submit(engine.encode_prompt(prompt), greedy())
        engine.step()  # one runs, two wait
        snapshot, limit = engine.stats(), engine.settings.scheduler.max_waiting_requests
        default = lab.settings().settings.monitoring
        low = lab.settings({"monitoring.alert_queue_fraction_above": 0.001}).settings.monitoring
        assert "queue_full" not in alert_names({"alerts": current_alerts(default, limit, snapshot)})
        assert "queue_full" in alert_names({"alerts": current_alerts(low, limit, snapshot)})


# ---- [auth], [logging], [plugins] enabled ---------------------------------------------------------


def auth_api_keys(lab: Lab) -> None:
    with lab.http({"auth.api_keys": ["sk-1"]}) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer sk-1"}).status_code == 200


def auth_admin_api_keys(lab: Lab) -> None:
    with lab.http({"auth.api_keys": ["sk-1"], "auth.admin_api_keys": ["sk-admin"]}) as client:
        user, admin = ({"Authorization": f"Bearer {key}"} for key in ("sk-1", "sk-admin"))
        assert client.post("/v1/cache/clear", headers=user).status_code == 403
        assert client.post("/v1/cache/clear", headers=admin).status_code == 200


def shares_a_prefix(lab: Lab, values: dict, first: str, second: str) -> bool:
    """Whether key ``second`` finds the prompt key ``first`` just sent in the cache (a fresh engine)."""
    body = {"prompt": f"{TENANT_PROMPT} {first} {second}", "max_tokens": 1, "temperature": 0}
    with lab.engine() as engine, lab.http(values, engine=engine) as client:
        for key in (first, second):
            reply = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def auth_tenants(lab: Lab) -> None:
    assert not shares_a_prefix(lab, {"auth.api_keys": ["sk-1", "sk-2"]}, "sk-1", "sk-2")
    assert shares_a_prefix(lab, {"auth.tenants": {"team": ["sk-1", "sk-2"]}}, "sk-1", "sk-2")


def auth_shared_cache_keys(lab: Lab) -> None:
    assert shares_a_prefix(lab, {"auth.shared_cache_keys": ["sk-1", "sk-2"]}, "sk-1", "sk-2")


def auth_public_stats(lab: Lab) -> None:
    user = {"Authorization": "Bearer sk-1"}
    with lab.http({"auth.api_keys": ["sk-1"]}) as client:
        assert client.get("/v1/cache/stats", headers=user).json()["scope"] == "tenant"
    with lab.http({"auth.api_keys": ["sk-1"], "auth.public_stats": True}) as client:
        assert "cache_manager" in client.get("/v1/cache/stats", headers=user).json()


@contextmanager
def captured_logs(values: dict, lab: Lab) -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        configure_logging(lab.settings(values).settings.logging, stream=stream)
        yield stream
    finally:
        root.handlers, root.level = handlers, level
        structlog.reset_defaults()


def logging_level(lab: Lab) -> None:
    with captured_logs({"logging.level": "warning"}, lab) as stream:
        structlog.get_logger("tierserve.effects").info("quiet")
        structlog.get_logger("tierserve.effects").warning("loud")
    assert "loud" in stream.getvalue() and "quiet" not in stream.getvalue()


def logging_format(lab: Lab) -> None:
    with captured_logs({"logging.format": "json"}, lab) as stream:
        structlog.get_logger("tierserve.effects").info("as_json", blocks=3)
    assert json.loads(stream.getvalue().splitlines()[-1])["blocks"] == 3


def plugins_enabled(lab: Lab) -> None:
    lab.request.getfixturevalue("install_fake_plugin")(
        "tierserve-effects-mru",
        "tierserve_effects_mru",
        """
        from tierserve.core import hookimpl
        from tierserve.plugins.eviction.lru import LRUPolicy
        @hookimpl
        def register_eviction_policies(register):
            register("effects-mru", LRUPolicy)
        """,
    )
    chosen = {("kv_cache", "eviction_policy"): "effects-mru"}
    assert load_settings(None, environ={}, overrides=chosen).settings.kv_cache.eviction_policy == "effects-mru"
    try:
        load_settings(None, environ={}, overrides={**chosen, ("plugins", "enabled"): []})
    except ConfigError as exc:
        assert "unknown eviction policy 'effects-mru'" in str(exc)  # the installed plugin was not loaded
    else:
        raise AssertionError("plugins.enabled = [] still loaded an installed plugin")


PROBES = {
    "server.host": server_host,
    "server.port": server_port,
    "server.max_request_bytes": server_max_request_bytes,
    "server.shutdown_grace_seconds": server_shutdown_grace_seconds,
    "server.header_timeout_seconds": server_header_timeout_seconds,
    "server.body_timeout_seconds": server_body_timeout_seconds,
    "server.max_connections": server_max_connections,
    "server.rate_limit_per_minute": server_rate_limit_per_minute,
    "server.public_health": server_public_health,
    "server.public_metrics": server_public_metrics,
    "server.retry_after_seconds": server_retry_after_seconds,
    "server.max_stream_backlog": server_max_stream_backlog,
    "server.engine_max_restarts": server_engine_max_restarts,
    "server.engine_restart_backoff_seconds": server_engine_restart_backoff_seconds,
    "monitoring.enabled": monitoring_enabled,
    "monitoring.collection_interval_seconds": monitoring_collection_interval_seconds,
    "monitoring.detailed_profiling": monitoring_detailed_profiling,
    "monitoring.prometheus": monitoring_prometheus,
    "monitoring.trend_samples": monitoring_trend_samples,
    "monitoring.alert_hit_rate_below": monitoring_alert_hit_rate_below,
    "monitoring.alert_memory_bytes_above": monitoring_alert_memory_bytes_above,
    "monitoring.alert_dropped_writes_above": monitoring_alert_dropped_writes_above,
    "monitoring.alert_queue_fraction_above": monitoring_alert_queue_fraction_above,
    "auth.api_keys": auth_api_keys,
    "auth.admin_api_keys": auth_admin_api_keys,
    "auth.tenants": auth_tenants,
    "auth.shared_cache_keys": auth_shared_cache_keys,
    "auth.public_stats": auth_public_stats,
    "logging.level": logging_level,
    "logging.format": logging_format,
    "plugins.enabled": plugins_enabled,
}
