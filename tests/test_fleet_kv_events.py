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
