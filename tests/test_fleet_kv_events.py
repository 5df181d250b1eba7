"""The fleet routing on what the replicas' caches hold (``fleet.routing = "kv_events"``): two engine replicas
publish their block events to the hub, and the router sends a prompt to the replica holding its prefix, and
stops doing so the moment that replica no longer holds it (a guess-based router cannot know)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import require_service
from tests.server_helpers import free_port
from tests.waiting import wait_until
from tierserve.fleet.app import APP_NAME, build_fleet
from tierserve.fleet.settings_sources import SettingsSources

pytestmark = pytest.mark.fleet

try:
    import ray
    from ray import serve
except ImportError:
    require_service("Ray", "pip install -e '.[test]' installs ray[serve]")

KEY = "fleet-kv-events-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are a helpful assistant for a railway company; answer about timetables and tickets only. " * 2
SETTINGS = {
    ("model", "path"): "builtin:tiny",
    ("fleet", "replicas"): 2,
    ("fleet", "num_cpus"): 0.5,
    ("fleet", "routing"): "kv_events",
    ("auth", "api_keys"): [KEY],
    ("auth", "admin_api_keys"): [KEY],  # /v1/cache/clear
    ("kv_cache", "block_size"): 4,
    ("logging", "level"): "warning",
    ("server", "engine_process"): False,
}


@pytest.fixture(scope="module")
def fleet():
    sources = SettingsSources.of("development", None, SETTINGS)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_fleet(sources), name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def chat(url: str, *turns: str) -> httpx.Response:
    messages = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": turn} for turn in turns]
    body = {"model": "builtin:tiny", "messages": messages, "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def fleet_stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/fleet/stats", headers=AUTH, timeout=30).json()


def held_by(url: str, replica: str) -> int:
    return sum(fleet_stats(url)["replicas"].get(replica, {}).get("blocks_held", {}).values())


def test_a_conversation_goes_where_its_blocks_are_and_leaves_when_they_are_gone(fleet):
    url = fleet
    first = chat(url, "When does the first train leave?")
    assert first.status_code == 200, first.text
    home = first.headers["x-tierserve-replica"]
    wait_until(lambda: held_by(url, home) > 0, timeout=30, interval=0.1, what="the replica's events at the hub")
    before = fleet_stats(url)["routing_decisions"]
    for turn in ("And the last one?", "How much is a return ticket?"):
        answer = chat(url, "When does the first train leave?", turn)
        assert answer.status_code == 200 and answer.headers["x-tierserve-replica"] == home
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    after = fleet_stats(url)["routing_decisions"]
    assert after.get("kv_l1", 0) - before.get("kv_l1", 0) >= 2

    # clear the home replica's cache (a request without a prompt goes to the least loaded: try until it lands)
    for _ in range(20):
        cleared = httpx.post(f"{url}/v1/cache/clear", json={"tiers": "all"}, headers=AUTH, timeout=30)
        assert cleared.status_code == 200
        if cleared.headers["x-tierserve-replica"] == home:
            break
    else:
        pytest.skip("the clear never landed on the replica holding the prefix")
    wait_until(lambda: held_by(url, home) == 0, timeout=30, interval=0.1, what="the clear's events at the hub")
    before = fleet_stats(url)["routing_decisions"]
    again = chat(url, "When does the first train leave?")
    assert again.status_code == 200
    after = fleet_stats(url)["routing_decisions"]
    assert after.get("no_match", 0) - before.get("no_match", 0) == 1  # no belief in blocks that are gone
    assert after.get("kv_l1", 0) == before.get("kv_l1", 0)


def test_the_fleet_dashboard_and_top_show_each_replica(fleet, capsys):
    url = fleet
    question = "Which platform does the 9:15 to the coast leave from?"
    homes = {chat(url, question).headers["x-tierserve-replica"], chat(url, question, "And on Sundays?").headers["x-tierserve-replica"]}
    home = homes.pop()
    assert not homes, "the conversation's second turn went where its first one's blocks are"

    def reported() -> dict | None:
        stats = fleet_stats(url)
        mine = stats["replicas"].get(home, {})
        return stats if (mine.get("prompt_tokens_cached") or 0) > 0 else None

    stats = wait_until(reported, timeout=30, interval=0.2, what="the home replica's report at the hub")
    node = ray.get_runtime_context().get_node_id()
    assert stats["routing"] == "kv_events" and len(stats["replicas"]) == 2
    for name, replica in stats["replicas"].items():
        assert replica["deployment"] == "engine" and replica["node"] == node and not replica["stale"]
        assert replica["total_blocks"] > 0 and replica["kv_blocks_used"] >= 0
    per_replica = {}
    for replica in stats["replicas"].values():
        for reason, count in replica["routing_decisions"].items():
            per_replica[reason] = per_replica.get(reason, 0) + count
    assert per_replica == stats["routing_decisions"]  # each decision is counted against the replica it chose
    timing = stats["routing_seconds"]  # what deciding took in the router: reading, hashing, matching
    assert timing["decisions"] >= sum(per_replica.values()) and 0 < timing["p50"] <= timing["p99"] <= timing["max"] < 5
    assert stats["replicas"][home]["routing_decisions"].get("kv_l1", 0) >= 1
    assert stats["shared_tiers"] == {}  # no redis tier in this fleet

    page = httpx.get(f"{url}/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "fleet dashboard" in page.text and "/dashboard/fleet.js" in page.text
    assert "content-security-policy" in page.headers
    script = httpx.get(f"{url}/dashboard/fleet.js", timeout=30)
    assert script.status_code == 200 and "/v1/fleet/stats" in script.text
    missing = httpx.get(f"{url}/dashboard/index.html", timeout=30)
    assert missing.status_code == 404 and "/dashboard/fleet.js" in missing.json()["error"]["message"]

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.browser import headless_chromium

    with headless_chromium() as chrome:  # the page as a person sees it: each replica's row, drawn from the document
        chrome.get(f"{url}/dashboard")
        chrome.find_element(By.ID, "api-key").send_keys(KEY)
        chrome.find_element(By.ID, "key-use").click()
        WebDriverWait(chrome, 20, poll_frequency=0.2).until(
            lambda c: len(c.find_elements(By.CSS_SELECTOR, "#replicas tbody tr[data-replica]")) == 2
        )
        shown = chrome.execute_script(
            "return [...document.querySelectorAll('#replicas tbody tr[data-replica]')].map(r => "
            "[r.dataset.replica, r.cells[1].textContent, r.cells[6].dataset.value])"
        )
        held = {name: str(state["blocks_held"].get("0", 0)) for name, state in fleet_stats(url)["replicas"].items()}
        assert {name: (deployment, l1) for name, deployment, l1 in shown} == {name: ("engine", held[name]) for name in held}
        assert chrome.find_element(By.ID, "fig-routing").text == "kv_events"
        # script errors only: the first poll, before the key was given, was a 401 and said so
        severe = [e for e in chrome.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
        assert not severe, severe

    from tierserve.cli.main import main

    assert main(["top", "--fleet", "--once", "--url", url, "--api-key", KEY]) == 0
    output = capsys.readouterr().out
    assert "kv_events" in output and "2 live / 2" in output
    for name, replica in fleet_stats(url)["replicas"].items():
        row = next(line for line in output.splitlines() if name in line)
        rate = replica["hit_rate"]  # None: a replica that served no prompt yet
        assert "engine" in row and ("–" if rate is None else f"{100 * rate:.1f}%") in row
    assert main(["top", "--fleet", "--once", "--url", url]) == 2  # the fleet's stats need the admin key
    assert "HTTP 401" in capsys.readouterr().err
