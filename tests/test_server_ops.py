"""Operating a running server: health probes, Prometheus metrics, cache stats/clear/warm, plugins, request ids, the cache CLI."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import threading
from datetime import datetime

import httpx
import pytest
import structlog
from litestar import Litestar, get
from litestar.response import Stream
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from tests.engine_helpers import PROMPTS, build_checkpoint, make_engine
from tests.server_helpers import running_server
from tests.waiting import wait_until
from tierserve.settings.config import LoggingSettings, load_settings
from tierserve.settings.logs import configure_logging
from tierserve.core.plugins import load_plugins
from tierserve.server import metrics_routes
from tierserve.server.app import create_app
from tierserve.server.metrics_routes import RequestMetrics, request_middleware
from tierserve.server.state import ServerState

pytestmark = pytest.mark.integration

BLOCK = 4
METRIC_NAMES = [
    "tierserve_requests_total",
    "tierserve_request_seconds",
    "tierserve_time_to_first_token_seconds",
    "tierserve_time_per_output_token_seconds",
    "tierserve_e2e_request_latency_seconds",
    "tierserve_prompt_tokens_total",
    "tierserve_generation_tokens_total",
    "tierserve_cached_prompt_tokens_total",
    "tierserve_request_outcomes_total",
    "tierserve_requests_running",
    "tierserve_requests_waiting",
    "tierserve_active_http_requests",
    "tierserve_cache_hits_total",  # the engine's cache collector, registered alongside
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    return tmp_path_factory.mktemp("l3")


@pytest.fixture(scope="module")
def engine(checkpoint, disk):
    engine = make_engine(
        checkpoint,
        kv_cache__block_size=BLOCK,
        kv_cache__l1_capacity=512,
        kv_cache__disk_path=str(disk),
        kv_cache__persistence=True,
    )
    yield engine
    engine.close()


def settings_for(checkpoint, disk, extra: dict | None = None):
    overrides = {
        ("model", "path"): str(checkpoint),
        ("model", "device"): "cpu",
        ("kv_cache", "block_size"): BLOCK,
        ("kv_cache", "disk_path"): str(disk),
        ("kv_cache", "persistence"): True,
        ("monitoring", "collection_interval_seconds"): 0.2,
    }
    overrides.update(extra or {})
    return load_settings(None, environ={}, overrides=overrides)


@pytest.fixture
def server(checkpoint, disk, engine):
    """One server per test: every server stops the shared engine's step thread when it exits."""
    with running_server(settings_for(checkpoint, disk), engine=engine) as base:
        yield base


@pytest.fixture
def json_logs():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    configure_logging(LoggingSettings(format="json"), stream=stream)
    yield stream
    root.handlers, root.level = handlers, level
    structlog.reset_defaults()


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSERVE_")}
    full_env.update(env or {})
    command = [sys.executable, "-m", "tierserve.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=60)


def stats(base: str, **kwargs) -> dict:
    response = httpx.get(f"{base}/v1/cache/stats", timeout=30, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


# ---- health -----------------------------------------------------------------------------


def test_health_probes_when_ready(server, engine):
    health = httpx.get(f"{server}/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "healthy" and body["version"] and body["uptime_seconds"] >= 0
    assert datetime.fromisoformat(body["timestamp"].replace("Z", "+00:00")).tzinfo is not None  # ISO-8601, UTC
    details = body["details"]
    assert details["memory_usage_bytes"] == body["memory"]["rss_bytes"] > 10 * 1024 * 1024
    assert details["components"] == {
        "inference_runtime": "operational", "model_registry": "operational", "cache_system": "operational"
    }
    assert body["memory"]["kv_blocks_total"] == engine.info.kv_blocks == 512
    assert 0 < body["memory"]["kv_blocks_free"] <= 512
    assert body["active_requests"] == details["active_requests"] == 0  # a probe does not count itself
    assert body["components"] == {
        "engine": "ready",
        "attention_kernel": engine.info.attention_kernel,  # [sliding_window] use_flash_attention
        "linear_kernel": engine.info.linear_kernel,  # [plugins.native] linear_kernel, model.quantization
        "quantization": "none",
        "kv_dtype": "float32",
        "backend": "native",
        "scheduler": "fcfs",
        "cache_tiers": ["l1", "l2", "l3"],
        "load_error": None,
        "models": {engine.settings.model.path: "ready"},
    }
    assert httpx.get(f"{server}/health/ready").json() == {"status": "ready"}
    assert httpx.get(f"{server}/health/live").json() == {"status": "alive"}


def test_health_while_loading_and_after_a_failed_load(checkpoint, disk, engine, tmp_path, monkeypatch):
    started = threading.Event()
    proceed = threading.Event()
    real_start = engine.start

    def slow_start():
        started.set()
        proceed.wait(30)
        real_start()

    monkeypatch.setattr(engine, "start", slow_start)
    with TestClient(create_app(settings_for(checkpoint, disk), engine=engine)) as client:
        assert started.wait(30)
        assert client.get("/health/live").status_code == 200
        loading = client.get("/health")
        assert loading.status_code == 200 and loading.json()["status"] == "loading"
        assert loading.json()["components"]["engine"] == "loading"
        not_ready = client.get("/health/ready")
        assert not_ready.status_code == 503 and not_ready.headers["retry-after"] == "5"
        assert not_ready.json()["error"]["code"] == "not_ready" and "loading" in not_ready.json()["error"]["message"]
        assert client.get("/v1/cache/stats").status_code == 503
        proceed.set()
        wait_until(lambda: client.get("/health/ready").status_code == 200, timeout=30, what="/health/ready")

    missing = settings_for(tmp_path / "no-such-checkpoint", disk)
    with TestClient(create_app(missing)) as client:

        def settled() -> httpx.Response | None:
            answer = client.get("/health")
            return answer if answer.json()["status"] != "loading" else None

        health = wait_until(settled, timeout=30, what="the load to end")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert health.json()["components"]["engine"] == "failed" and health.json()["components"]["load_error"]
        ready = client.get("/health/ready")
        assert ready.status_code == 503 and "failed to load" in ready.json()["error"]["message"]


# ---- metrics --------------------------------------------------------------------------------


def test_metrics_exposition_counts_requests(server):
    assert httpx.get(f"{server}/v1/plugins").status_code == 200
    assert httpx.get(f"{server}/v1/plugins").status_code == 200
    response = httpx.get(f"{server}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    for name in METRIC_NAMES:
        assert f"\n{name}" in text, name
    assert 'tierserve_requests_total{endpoint="/v1/plugins",status="200"} 2.0' in text
    assert 'tierserve_request_seconds_count{endpoint="/v1/plugins"} 2.0' in text
    assert "tierserve_active_http_requests 1.0" in text  # the scrape itself
    assert 'tierserve_request_outcomes_total{outcome="abort"} 0.0' in text


def test_prometheus_off_means_no_metrics_route_and_no_collector(checkpoint, disk, engine):
    """``[monitoring] prometheus = false``: /metrics is an unknown path, and nothing is collected."""
    settings = settings_for(checkpoint, disk, {("monitoring", "prometheus"): False}).settings
    app = create_app(settings, engine=engine, load_in_background=False)
    with TestClient(app) as client:
        body = {"prompt": "Hello", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
        scrape, unknown = client.get("/metrics"), client.get("/no-such-route")
        assert scrape.status_code == unknown.status_code == 404
        assert scrape.json() == unknown.json()
        assert scrape.json()["error"]["type"] == "not_found_error"
        assert "metrics" not in app.state.tierserve.extras  # no registry, so no collector to scrape


def test_request_metrics_api():
    metrics = RequestMetrics(CollectorRegistry())
    metrics.observe_request("/v1/completions", 200, 0.5)
    metrics.observe_ttft(0.02)
    metrics.observe_tpot(0.01)
    metrics.observe_e2e(0.3)
    metrics.count_tokens(prompt=10, generated=5, cached=8)
    metrics.count_outcome("success")
    text = generate_latest(metrics.registry).decode()
    for line in (
        'tierserve_requests_total{endpoint="/v1/completions",status="200"} 1.0',
        "tierserve_time_to_first_token_seconds_count 1.0",
        "tierserve_time_per_output_token_seconds_sum 0.01",
        "tierserve_e2e_request_latency_seconds_count 1.0",
        "tierserve_prompt_tokens_total 10.0",
        "tierserve_generation_tokens_total 5.0",
        "tierserve_cached_prompt_tokens_total 8.0",
        'tierserve_request_outcomes_total{outcome="success"} 1.0',
    ):
        assert line in text
    with pytest.raises(ValueError, match="allowed: success, abort, error"):
        metrics.count_outcome("finished")


# ---- cache stats / warm / clear --------------------------------------------------------------------


def test_cache_stats_shape_and_hits_after_warming(server, engine):
    before = stats(server)
    assert set(before) == {"cache_manager", "plugin_figures", "overall", "alerts", "trends", "trend_points", "recent",
                           "latency"}
    manager = before["cache_manager"]
    assert set(manager["kv_cache"]["tiers"]) == {"l1", "l2", "l3"}
    assert manager["speculation"]["enabled"] is False and manager["speculation"]["proposed"] == 0
    assert {"acceptance_rate", "mean_accepted_length", "early_stops"} <= set(manager["speculation"])
    assert manager["sliding_window"]["enabled"] is False and manager["sliding_window"]["windows_slid"] == 0
    assert set(manager["radix_tree"]) == {
        "prefix_matches", "sharing_hits", "memory_saved", "active_prefixes", "avg_prefix_length", "cached_blocks", "lookups"
    }

    prompt = PROMPTS[4]
    ids = engine.encode_prompt(prompt)
    unknown = httpx.post(f"{server}/v1/cache/warm", json={"prompts": [prompt], "extra": "x"}, timeout=60)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "extra"  # never silently ignored
    warmed = httpx.post(f"{server}/v1/cache/warm", json={"prompts": [prompt]}, timeout=60)
    assert warmed.status_code == 200, warmed.text
    tokens = len(ids) // BLOCK * BLOCK
    writes = {"l3": {"written": tokens // BLOCK, "dropped": 0, "pending": 0}}  # persistence: written through, stored
    blocks = tokens // BLOCK
    assert warmed.json() == {"source": "prompts", "warmed": 1, "tokens": tokens, "blocks": blocks, "writes": writes}

    [result] = engine.generate([prompt + " And then"])
    assert result.cached_tokens >= tokens - BLOCK
    after = stats(server)
    kv, old = after["cache_manager"]["kv_cache"], before["cache_manager"]["kv_cache"]
    assert kv["l1_hits"] >= old["l1_hits"] + tokens // BLOCK - 1
    assert kv["hits"] == kv["l1_hits"] + kv["l2_hits"] + kv["l3_hits"] > old["hits"]
    assert kv["tiers"]["l3"]["entries"] >= tokens // BLOCK  # written through (persistence)
    assert after["cache_manager"]["radix_tree"]["cached_blocks"] > 0
    overall = after["overall"]
    assert overall["cached_tokens"] >= before["overall"]["cached_tokens"] + result.cached_tokens
    assert overall["token_hit_rate"] == round(overall["cached_tokens"] / overall["prompt_tokens"], 4)

    # L1 dropped: the same prompt is now served from L3 (write-through) and promoted back
    cleared = httpx.post(f"{server}/v1/cache/clear", json={"tiers": ["l1"]})
    assert cleared.status_code == 200 and cleared.json()["cleared"]["l1"] > 0
    engine.generate([prompt])
    final = stats(server)["cache_manager"]["kv_cache"]
    assert final["l3_hits"] > kv["l3_hits"] and final["promotions"]["l3"] > kv["promotions"]["l3"]
    assert final["loads"] == kv["loads"] + 1 and final["load_timeouts"] == final["load_failures"] == 0  # off the step


def test_warm_chat_messages_and_validation(server):
    messages = [[{"role": "user", "content": "Tell me about the library at the edge of the town."}]]
    warmed = httpx.post(f"{server}/v1/cache/warm", json={"messages": messages}, timeout=60)
    assert warmed.status_code == 200 and warmed.json()["warmed"] == 1 and warmed.json()["blocks"] > 0
    for body, param in (
        ({"prompts": []}, "prompts"),
        ({"prompts": "not a list"}, "prompts"),
        ({"messages": [[{"role": "user"}]]}, "messages"),
    ):
        response = httpx.post(f"{server}/v1/cache/warm", json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].startswith(param), (body, error)


def test_clear_tiers_and_unknown_tier(server):
    everything = httpx.post(f"{server}/v1/cache/clear")
    assert everything.status_code == 200 and set(everything.json()["cleared"]) == {"l1", "l2", "l3"}
    assert stats(server)["cache_manager"]["kv_cache"]["tiers"]["l3"]["entries"] == 0
    for body, bad in (({"tiers": ["l1", "l4"]}, "'l4'"), ({"tiers": []}, "empty list"), ({"tiers": "some"}, "'some'")):
        response = httpx.post(f"{server}/v1/cache/clear", json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["param"] == "tiers" and error["type"] == "invalid_request_error", error
        assert bad in error["message"] and 'l1, l2, l3, or "all"' in error["message"]
    assert httpx.post(f"{server}/v1/cache/clear", json={"tiers": "l2"}).json()["cleared"] == {"l2": 0}


def test_clearing_every_tier_releases_the_named_prefixes_and_says_so(server):
    named = {"prompt": " ".join([PROMPTS[3], PROMPTS[6], PROMPTS[1]]), "max_tokens": 2, "cache_key": "pinned-docs"}
    assert httpx.post(f"{server}/v1/cached/completions", json=named, timeout=120).status_code == 200
    keys = lambda: httpx.get(f"{server}/v1/cache/keys").json()["data"]  # noqa: E731
    assert [k["id"] for k in keys()] == ["pinned-docs"] and keys()[0]["pinned_bytes"] > 0
    some = httpx.post(f"{server}/v1/cache/clear", json={"tiers": ["l2"]}).json()
    assert some["released_keys"] == 0 and some["kept_pinned_keys"] == 1  # a partial clear keeps the key, and says so
    assert [k["id"] for k in keys()] == ["pinned-docs"]
    everything = httpx.post(f"{server}/v1/cache/clear").json()
    assert everything["released_keys"] == 1 and everything["kept_pinned_keys"] == 0
    assert keys() == []
    l1 = stats(server)["cache_manager"]["kv_cache"]["tiers"]["l1"]
    assert l1["entries"] == 0  # the blocks the key pinned went with the rest


def test_trends_sampled_and_hit_rate_alert(checkpoint, disk, engine):
    settings = settings_for(checkpoint, disk, {("monitoring", "alert_hit_rate_below"): 0.99})
    with running_server(settings, engine=engine) as base:
        engine.generate(["a prompt nobody has sent before, long enough to fill several blocks"])

        def sampled_twice() -> dict | None:
            document = stats(base)
            return document if len(document["trend_points"]) >= 2 else None

        body = wait_until(sampled_twice, interval=0.1, what="two trend samples")
    sample = body["trend_points"][-1]
    assert set(sample) == {
        "timestamp", "hit_rate", "memory_bytes", "cached_tokens", "requests_running", "requests_waiting",
        "dropped_writes", "operations", "generation_tokens", "tiers",
    }
    assert body["trend_points"][0]["timestamp"] < sample["timestamp"]
    assert body["trends"]["data_points"] == len(body["trend_points"]) and body["trends"]["window_seconds"] > 0
    [alert] = body["alerts"]
    assert alert["name"] == "low_hit_rate" and alert["threshold"] == 99.0  # percent, as the document's rates
    assert alert["value"] == body["cache_manager"]["kv_cache"]["hit_rate"] < 99.0 and alert["message"]


def test_queue_alert_with_waiting_requests(checkpoint, disk, tmp_path):
    small = make_engine(checkpoint, scheduler__max_num_seqs=1, scheduler__max_waiting_requests=10, kv_cache__block_size=BLOCK)
    settings = settings_for(checkpoint, disk, {("monitoring", "alert_queue_fraction_above"): 0.1})
    try:
        with running_server(settings, engine=small) as base:
            from tierserve.core.sampling_params import SamplingParams

            params = SamplingParams(max_tokens=64, ignore_eos=True)
            for prompt in PROMPTS[:5]:
                small.submit(small.encode_prompt(prompt), params)
            alerts = wait_until(lambda: stats(base)["alerts"], what="a queue alert")
    finally:
        small.close()
    [alert] = alerts
    assert alert["name"] == "queue_full" and alert["threshold"] == 1.0 and alert["value"] > 1


# ---- auth, plugins, request ids ----------------------------------------------------------------------


def test_admin_key_needed_for_clear_and_warm(checkpoint, disk, engine):
    settings = settings_for(checkpoint, disk, {("auth", "api_keys"): ["user"], ("auth", "admin_api_keys"): ["admin"]})
    with running_server(settings, engine=engine) as base:
        for path, body in (
            ("/v1/cache/clear", {"tiers": ["l2"]}),
            ("/v1/cache/warm", {"prompts": ["Hello there, world"]}),
            ("/v1/cache/flush", None),
            ("/v1/cache/offload", None),
        ):
            assert httpx.post(f"{base}{path}", json=body).status_code == 401
            forbidden = httpx.post(f"{base}{path}", json=body, headers={"Authorization": "Bearer user"})
            assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
            allowed = httpx.post(f"{base}{path}", json=body, headers={"Authorization": "Bearer admin"}, timeout=60)
            assert allowed.status_code == 200, allowed.text
        offloaded = allowed.json()["offloaded_blocks"]  # the warmed prompt, now in L2
        assert offloaded > 0
        assert httpx.get(f"{base}/v1/cache/stats").status_code == 401
        stats(base, headers={"Authorization": "Bearer user"})
        assert httpx.get(f"{base}/health").status_code == 200  # public; /metrics is private once keys exist
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer user"}).status_code == 200

        denied = cli("cache", "warm", "Hello", "--url", base, env={"TIERSERVE_API_KEY": "user"})
        assert denied.returncode == 2 and "HTTP 403" in denied.stderr and "admin API key" in denied.stderr
        ok = cli("cache", "clear", "--tier", "l2", "--url", base, "--api-key", "admin")
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["cleared"] == {"l2": offloaded}


def test_plugins_route_matches_the_cli(server):
    response = httpx.get(f"{server}/v1/plugins")
    assert response.status_code == 200
    body = response.json()
    expected = load_plugins()
    assert body["plugins"] == [plugin.as_dict() for plugin in expected.plugins()]
    assert body["failures"] == []
    names = {plugin["name"] for plugin in body["plugins"]}
    assert {"tierserve.plugins.eviction.lru", "tierserve.plugins.schedulers.fcfs"} <= names
    assert all(plugin["source"] == "builtin" for plugin in body["plugins"])


def test_request_id_echoed_and_in_access_log(server, json_logs):
    given = httpx.get(f"{server}/v1/cache/stats", headers={"x-request-id": "trace-abc-123"})
    assert given.headers["x-request-id"] == "trace-abc-123"
    fresh = httpx.get(f"{server}/v1/cache/stats").headers["x-request-id"]
    assert fresh.startswith("req-")

    def access_log() -> dict[str, dict] | None:
        records = [json.loads(line) for line in json_logs.getvalue().splitlines() if line.startswith("{")]
        lines = {r["request_id"]: r for r in records if r["event"] == "http_request"}
        return lines if fresh in lines else None

    access = wait_until(access_log, timeout=5, what="the access log line of the last request")
    line = access["trace-abc-123"]
    assert line["method"] == "GET" and line["path"] == "/v1/cache/stats" and line["status"] == 200
    assert line["duration_ms"] >= 0 and line["level"] == "info"
    assert access[fresh]["path"] == "/v1/cache/stats"


def test_middleware_times_a_stream_to_its_last_chunk(checkpoint):
    @get("/stream")
    async def stream() -> Stream:
        async def chunks():
            for index in range(3):
                await asyncio.sleep(0.05)
                yield f"data: {index}\n\n"

        return Stream(chunks(), media_type="text/event-stream", status_code=201)

    loaded = load_settings(None, environ={}, overrides={("model", "path"): str(checkpoint)})
    state = ServerState(settings=loaded.settings, plugins=loaded.plugins)
    metrics_routes.setup(state)
    app = Litestar([stream], middleware=[request_middleware])
    app.state.tierserve = state
    with TestClient(app) as client:
        response = client.get("/stream")
    assert response.status_code == 201 and response.text.count("data:") == 3
    assert response.headers["x-request-id"].startswith("req-")
    text = generate_latest(state.extras["metrics"].registry).decode()
    assert 'tierserve_requests_total{endpoint="/stream",status="201"} 1.0' in text
    prefix = 'tierserve_request_seconds_sum{endpoint="/stream"}'
    [seconds] = [line.split()[-1] for line in text.splitlines() if line.startswith(prefix)]
    assert float(seconds) >= 0.15  # the whole stream, not just the response start
    assert state.active_requests == 0


# ---- the cache CLI ---------------------------------------------------------------------------------------


def test_cache_cli_against_a_running_server(server, tmp_path):
    shown = cli("cache", "stats", env={"TIERSERVE_URL": server})
    assert shown.returncode == 0, shown.stderr
    assert set(json.loads(shown.stdout)["cache_manager"]) == {"kv_cache", "radix_tree", "speculation", "sliding_window"}

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The first prompt from a file, long enough\n\nThe second prompt from a file, also long\n")
    warmed = cli("cache", "warm", "One more prompt given as an argument", "--file", str(prompts), "--url", server)
    assert warmed.returncode == 0, warmed.stderr
    result = json.loads(warmed.stdout)
    assert result["warmed"] == 3 and result["blocks"] == result["tokens"] // BLOCK > 0
    reused = cli("cache", "warm", "One more prompt given as an argument", "--url", server)  # a hit: counted
    assert reused.returncode == 0, reused.stderr

    offloaded = cli("cache", "offload", "--url", server)
    assert offloaded.returncode == 0, offloaded.stderr
    assert json.loads(offloaded.stdout)["offloaded_blocks"] > 0
    assert stats(server)["cache_manager"]["kv_cache"]["tiers"]["l2"]["entries"] > 0

    cleared = cli("cache", "clear", "--tier", "l1", "--tier", "l3", "--url", server)
    assert cleared.returncode == 0, cleared.stderr
    assert set(json.loads(cleared.stdout)["cleared"]) == {"l1", "l3"}

    frequent = cli("cache", "warm", "--limit-blocks", "4", "--url", server)  # no prompts: the most used, from l2
    assert frequent.returncode == 0, frequent.stderr
    report = json.loads(frequent.stdout)
    assert report["source"] == "frequent" and 0 < report["blocks_by_tier"]["l1"] <= 4, report

    named = cli("cache", "warm", "A manual worth naming, long enough for a block or two", "--cache-key", "manual",
                "--url", server)  # fmt: skip
    assert named.returncode == 0, named.stderr
    listed = cli("cache", "keys", "--url", server)
    assert [key["id"] for key in json.loads(listed.stdout)["data"]] == ["manual"]
    forgot = cli("cache", "forget", "manual", "--url", server)
    assert forgot.returncode == 0 and json.loads(forgot.stdout)["deleted"] is True
    again = cli("cache", "forget", "manual", "--url", server)
    assert again.returncode == 2 and "not registered" in again.stderr
    unreachable = cli("cache", "stats", "--url", "http://127.0.0.1:9")
    assert unreachable.returncode == 2 and "cannot reach the server" in unreachable.stderr
