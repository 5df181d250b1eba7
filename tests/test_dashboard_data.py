"""What the dashboard and ``tierserve top`` read: the figures ``/v1/cache/stats`` gained for them, the most used
prefixes (``/v1/cache/prefixes``), the page's files, and ``tierserve top`` itself against a running server."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.engine_helpers import PROMPTS, build_checkpoint
from tests.server_helpers import running_server
from tests.waiting import wait_until
from tierserve.cli.main import main
from tierserve.settings.config import load_settings
from tierserve.server.recent import RecentRates, percentile

pytestmark = pytest.mark.integration

L1_BLOCKS = 16
SHARED = PROMPTS[4] + " " + PROMPTS[2]
NAMED = " ".join([PROMPTS[3], PROMPTS[6], PROMPTS[1]])
USER_KEY, ADMIN_KEY = "data-user-key", "data-admin-key"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


def settings(checkpoint, preset: str = "development", **extra):
    overrides = {
        ("model", "path"): str(checkpoint),
        ("model", "device"): "cpu",
        ("server", "engine_process"): False,
        ("kv_cache", "l1_capacity"): L1_BLOCKS,
        ("logging", "level"): "warning",
        **{tuple(key.split("__")): value for key, value in extra.items()},
    }
    return load_settings(preset, environ={}, overrides=overrides)


@pytest.fixture(scope="module")
def server(checkpoint):
    """The development preset, L1 of 16 blocks, a monitor sample every 0.2 s."""
    loaded = settings(checkpoint, monitoring__collection_interval_seconds=0.2)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        yield base


def complete(base: str, prompt: str, headers: dict | None = None, **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}
    path = "/v1/cached/completions" if "cache_key" in fields else "/v1/completions"
    reply = httpx.post(f"{base}{path}", json=body, headers=headers or {}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stats(base: str, headers: dict | None = None) -> dict:
    reply = httpx.get(f"{base}/v1/cache/stats", headers=headers or {})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_rates_span_the_last_minute_and_one_reading_before_it():
    rates = RecentRates(started_at=1000.0, window=60)
    assert rates.since({"tokens": 5}, now=1010.0) == (10.0, {"tokens": 5})  # no reading yet: since start-up, from zero
    rates.add({"tokens": 5}, now=1010.0)
    rates.add({"tokens": 8}, now=1050.0)
    rates.add({"tokens": 20}, now=1100.0)
    assert rates.since({"tokens": 20}, now=1100.0) == (90.0, {"tokens": 15})  # 1010 is the newest reading before 1040
    rates.add({"tokens": 30}, now=1120.0)
    assert rates.since({"tokens": 30}, now=1120.0) == (70.0, {"tokens": 22})  # 1050 now is; 1010 is dropped
    values = [float(v) for v in range(100, 0, -1)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile([7.0], 0.99)) == (50.0, 99.0, 7.0)


def test_stats_give_each_tier_its_bounds_and_l1_its_bytes(server):
    complete(server, SHARED)
    kv = stats(server)["cache_manager"]["kv_cache"]
    l1, l2 = kv["tiers"]["l1"], kv["tiers"]["l2"]
    assert l1["medium"] == "arena" and l2["medium"] == "memory"
    assert l1["capacity_entries"] == l1["blocks_total"] == L1_BLOCKS
    block_bytes = l1["capacity_bytes"] // L1_BLOCKS
    assert block_bytes > 0 and l1["capacity_bytes"] == L1_BLOCKS * block_bytes
    assert l1["entries"] > 0 and l1["bytes"] == (L1_BLOCKS - l1["blocks_empty"]) * block_bytes
    assert l1["blocks_in_use"] == L1_BLOCKS - l1["blocks_free"] == 0  # nothing runs
    assert kv["memory_bytes"] == l1["bytes"] + l2["bytes"]
    assert (l2["capacity_entries"], l2["capacity_bytes"]) == (5000, 500_000_000)  # the preset's l2 tier: capacity, max_bytes
    assert kv["memory_limit_bytes"] == l1["capacity_bytes"] + l2["capacity_bytes"]  # what memory_bytes may reach
    metrics = httpx.get(f"{server}/metrics").text
    assert 'tierserve_cache_capacity_entries{tier="l2"} 5000.0' in metrics
    assert f'tierserve_cache_capacity_bytes{{tier="l1"}} {float(l1["capacity_bytes"])}' in metrics


def test_trend_points_carry_every_tier(server):
    complete(server, SHARED)

    def sampled_twice() -> dict | None:
        document = stats(server)
        return document if len(document["trend_points"]) >= 2 else None

    body = wait_until(sampled_twice, interval=0.1, what="two trend samples")
    point = body["trend_points"][-1]
    assert set(point["tiers"]) == {"l1", "l2"}
    assert set(point["tiers"]["l1"]) == {"hits", "misses", "hit_rate", "evictions", "entries"}
    tier = body["cache_manager"]["kv_cache"]["tiers"]["l1"]
    assert point["tiers"]["l1"]["hits"] <= tier["hits"] and point["generation_tokens"] <= body["overall"]["generation_tokens"]
    assert point["tiers"]["l1"]["hit_rate"] == round(
        point["tiers"]["l1"]["hits"] / (point["tiers"]["l1"]["hits"] + point["tiers"]["l1"]["misses"]), 4
    )


def test_recent_rates_latency_and_evictions_by_tier(checkpoint):
    # no monitor: the only readings are this test's own stats requests, so the increases are exact
    loaded = settings(checkpoint, monitoring__enabled=False)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        first = stats(base)
        assert first["latency"]["ttft_seconds"] == {"count": 0, "p50": None, "p99": None}
        generated = 0
        prompts = [f"Story {i}. {PROMPTS[4]}" for i in range(6)]  # no shared prefix: more blocks in all than L1 has
        for prompt in prompts:
            generated += complete(base, prompt)["usage"]["completion_tokens"]
        second = stats(base)
        recent = second["recent"]
        assert 0 < recent["seconds"] < 60
        for name, count in (("generation_tokens_per_second", generated), ("requests_per_second", len(prompts))):
            rate = recent[name]  # the document rounds the span to 1 ms and the rate to 0.01/s
            assert rate * recent["seconds"] == pytest.approx(count, abs=rate * 0.0005 + recent["seconds"] * 0.005), name
        tiers, old = second["cache_manager"]["kv_cache"]["tiers"], first["cache_manager"]["kv_cache"]["tiers"]
        assert recent["evictions"] == {name: tiers[name]["evictions"] - old[name]["evictions"] for name in tiers}
        assert recent["evictions"]["l1"] > 0  # 16 blocks could not hold them all
        latency = second["latency"]
        assert latency["ttft_seconds"]["count"] == len(prompts) == latency["tpot_seconds"]["count"]
        assert 0 < latency["ttft_seconds"]["p50"] <= latency["ttft_seconds"]["p99"]
        assert 0 < latency["tpot_seconds"]["p50"] <= latency["tpot_seconds"]["p99"]
        third = stats(base)["recent"]  # still from the first reading (within the minute): the same tokens, a longer span
        assert third["seconds"] > recent["seconds"] and third["evictions"] == recent["evictions"]
        rate = third["generation_tokens_per_second"]
        assert rate * third["seconds"] == pytest.approx(generated, abs=rate * 0.0005 + third["seconds"] * 0.005)


def test_top_prefixes_count_every_tier_and_name_keys(checkpoint):
    loaded = settings(checkpoint, monitoring__enabled=False)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        assert httpx.get(f"{base}/v1/cache/prefixes").json() == {"object": "list", "data": []}
        prompt_tokens = complete(base, SHARED)["usage"]["prompt_tokens"]
        for _ in range(2):
            complete(base, SHARED)
        for _ in range(2):
            complete(base, NAMED, cache_key="manual")
        top = httpx.get(f"{base}/v1/cache/prefixes?limit=10").json()["data"]
        assert [p["hits"] for p in top] == [2, 1]  # the first request computes, each later one hits
        shared, named = top
        assert shared["tiers"] == ["l1"] and shared["cache_key"] is None
        assert shared["blocks"] == (prompt_tokens - 1) // 16 and shared["tokens"] == shared["blocks"] * 16  # never the last token
        [key] = httpx.get(f"{base}/v1/cache/keys").json()["data"]
        assert named["cache_key"] == "manual" and named["blocks"] == key["blocks"]
        assert [p["key"] for p in httpx.get(f"{base}/v1/cache/prefixes?limit=1").json()["data"]] == [shared["key"]]

        moved = httpx.post(f"{base}/v1/cache/offload").json()["offloaded_blocks"]
        assert moved > 0
        after = {p["key"]: p for p in httpx.get(f"{base}/v1/cache/prefixes").json()["data"]}
        assert after[shared["key"]]["tiers"] == ["l2"] and after[shared["key"]]["hits"] == 2  # uses follow blocks down

        for bad in ("0", "101", "many"):
            reply = httpx.get(f"{base}/v1/cache/prefixes", params={"limit": bad})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "limit", reply.text


def test_dashboard_files_are_the_packages_own_with_a_strict_policy(server):
    page = httpx.get(f"{server}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    script = httpx.get(f"{server}/dashboard/dashboard.js")
    sheet = httpx.get(f"{server}/dashboard/dashboard.css")
    assert script.headers["content-type"].startswith("text/javascript") and "/v1/cache/stats" in script.text
    assert sheet.headers["content-type"].startswith("text/css")
    for body in (page.text, script.text, sheet.text):  # no CDN, no other origin: only the SVG namespace is a URL
        assert set(re.findall(r"https?://[^\s\"')]+", body)) <= {"http://www.w3.org/2000/svg"}
    assert sum(len(r.content) for r in (page, script, sheet)) < 40_000
    missing = httpx.get(f"{server}/dashboard/../server/app.py")
    assert missing.status_code == 404
    unknown = httpx.get(f"{server}/dashboard/other.js")
    assert unknown.status_code == 404 and "common.js, dashboard.js, dashboard.css" in unknown.json()["error"]["message"]


def rows(output: str, first_cells: set[str]) -> dict[str, list[str]]:
    """The rows of a printed rich table whose first cell is one of ``first_cells``, split into cells."""
    found = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│┃").split("│")]
        if cells and cells[0] in first_cells:
            found[cells[0]] = cells
    return found


def test_top_once_prints_the_figures_of_stats(server, capsys):
    for _ in range(2):
        complete(server, SHARED)
    assert main(["top", "--once", "--url", server]) == 0
    output = capsys.readouterr().out
    body = stats(server)  # idle: the same figures the frame was drawn from
    tiers = body["cache_manager"]["kv_cache"]["tiers"]
    printed = rows(output, {"L1", "L2"})
    assert set(printed) == {"L1", "L2"}
    for name, cells in printed.items():
        tier = tiers[name.lower()]
        assert cells[1] == tier["medium"]
        assert cells[2] == f"{tier['entries']:,} / {tier['capacity_entries']:,} {100 * tier['entries'] / tier['capacity_entries']:.0f}%"
        assert cells[4] == f"{100 * tier['hit_rate']:.1f}%"
        assert cells[5] == f"{tier['hits']:,}" and cells[6] == f"{tier['evictions']:,}"
    figures = [line for line in output.splitlines() if line.startswith("│") and "ms" in line]
    [figure_cells] = [[c.strip() for c in line.strip("│").split("│")] for line in figures]
    overall, kv = body["overall"], body["cache_manager"]["kv_cache"]
    assert figure_cells[0] == str(overall["requests_running"]) and figure_cells[1] == str(overall["requests_waiting"])
    assert figure_cells[3] == f"{1000 * body['latency']['ttft_seconds']['p50']:.1f} ms"
    assert figure_cells[6] == f"{kv['hit_rate']:.1f}%" and figure_cells[7] == str(len(body["alerts"]))
    top = httpx.get(f"{server}/v1/cache/prefixes").json()["data"][0]
    assert top["key"][:12] + "…" in output


def test_top_with_keys_on_the_production_preset(checkpoint, tmp_path, capsys):
    loaded = settings(
        checkpoint, "production", kv_cache__disk_path=str(tmp_path / "l3"),
        auth__api_keys=[USER_KEY], auth__admin_api_keys=[ADMIN_KEY],
    )  # fmt: skip
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        complete(base, SHARED, {"Authorization": f"Bearer {USER_KEY}"})
        # any user may name a prefix: the name is shown as it is, never read as the terminal's markup
        complete(base, NAMED, {"Authorization": f"Bearer {USER_KEY}"}, cache_key="[/x][bold]k")
        assert main(["top", "--once", "--url", base, "--api-key", ADMIN_KEY]) == 0
        output = capsys.readouterr().out
        assert set(rows(output, {"L1", "L2", "L3"})) == {"L1", "L2", "L3"} and "disk" in output
        assert "[/x][bold]k" in output

        assert main(["top", "--once", "--url", base, "--api-key", USER_KEY]) == 0
        output = capsys.readouterr().out
        assert "not an admin key" in output
        tenant = stats(base, {"Authorization": f"Bearer {USER_KEY}"})
        assert tenant["scope"] == "tenant" and tenant["requests"] == 2
        assert re.search(rf"│\s+2\s+│\s+{tenant['prompt_tokens']:,}\s+│", output), output

        assert main(["top", "--once", "--url", base, "--api-key", "wrong"]) == 2
        assert "HTTP 401" in capsys.readouterr().err
        assert main(["top", "--once", "--url", base, "--interval", "0"]) == 2
        assert "--interval: got 0.0" in capsys.readouterr().err
