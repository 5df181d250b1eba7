"""The fleet across two Ray nodes on this machine (``tests.ray_nodes``): an engine replica on each, the ingress and
the hub on the head; the worker node's processes are killed mid-run. No request fails (those the lost replica was
computing are sent again by the ingress), the survivor serves everything, and the fleet forgets the lost replica's
cache within seconds."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import require_service
from tests.ray_nodes import TwoNodes, serving
from tests.waiting import wait_until
from tierserve.fleet.app import build_fleet
from tierserve.fleet.settings_sources import SettingsSources

pytestmark = pytest.mark.fleet

try:
    import ray
except ImportError:
    require_service("Ray", "pip install -e '.[test]' installs ray[serve]")

KEY = "fleet-nodes-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
SETTINGS = {
    ("model", "path"): "builtin:tiny",
    ("fleet", "replicas"): 2,
    ("fleet", "num_cpus"): 0.5,
    ("fleet", "max_replicas_per_node"): 1,  # one on each node
    ("fleet", "routing"): "kv_events",
    ("auth", "api_keys"): [KEY],
    ("kv_cache", "block_size"): 4,
    ("logging", "level"): "warning",
    ("server", "engine_process"): False,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = TwoNodes(tmp_path_factory.mktemp("ray-nodes")).start()
    try:
        with serving(nodes, build_fleet(SettingsSources.of("development", None, SETTINGS))) as url:
            yield nodes, url
    finally:
        nodes.stop()


def fleet_stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/fleet/stats", headers=AUTH, timeout=30).json()


def chat(url: str, system: str, turn: str) -> httpx.Response:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": turn}]
    body = {"model": "builtin:tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def test_a_lost_node_costs_no_request_and_the_fleet_forgets_its_replica(cluster):
    nodes, url = cluster
    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])

    def both_nodes() -> dict | None:
        replicas = fleet_stats(url)["replicas"]
        where = {state.get("node") for state in replicas.values()}
        return replicas if len(replicas) == 2 and len(where) == 2 and None not in where else None

    replicas = wait_until(both_nodes, timeout=60, interval=0.5, what="a replica reporting from each node")
    lost = next(name for name, state in replicas.items() if state["node"] != head)
    survivor = next(name for name in replicas if name != lost)

    # conversations: each tenant's system prompt; some of them live on the replica about to be lost
    # (a prompt nothing holds goes to either replica at random: new tenants until both have some)
    words = ["Amber", "Birch", "Cedar", "Dune", "Elm", "Fjord", "Grove", "Heath", "Inlet", "Juniper", "Kelp", "Larch"]
    homes: dict[str, str] = {}
    for word in words:
        system = f"{word} tramway: you answer questions about its stops and its timetable. " * 3
        homes[system] = chat(url, system, "First tram?").headers["x-tierserve-replica"]
        if len(homes) >= 4 and set(homes.values()) == {lost, survivor}:
            break
    assert set(homes.values()) == {lost, survivor}, homes
    systems = list(homes)

    results: list[tuple[float, float, int, str, str]] = []  # start, end, status, replica, error
    stop = threading.Event()

    def client(index: int) -> None:
        turn = 0
        while not stop.is_set():
            system = systems[(index + turn) % len(systems)]
            started = time.monotonic()
            try:
                answer = chat(url, system, f"Question {turn} from client {index}?")
                results.append((started, time.monotonic(), answer.status_code, answer.headers.get("x-tierserve-replica", ""),
                                "" if answer.status_code == 200 else answer.text[:300]))  # fmt: skip
            except httpx.HTTPError as exc:
                results.append((started, time.monotonic(), 0, "", repr(exc)))
            turn += 1

    with ThreadPoolExecutor(4) as pool:
        for index in range(4):
            pool.submit(client, index)
        time.sleep(3)
        killed = time.monotonic()
        nodes.kill_worker()
        time.sleep(15)
        stop.set()

    failed = [r for r in results if r[2] != 200]
    assert not failed, failed[:5]
    before = [r for r in results if r[1] < killed]
    after = [r for r in results if r[0] > killed]
    assert {r[3] for r in before} == {lost, survivor}  # both served while both nodes were up
    assert after and {r[3] for r in after} == {survivor}
    late = [r for r in after if r[0] > killed + 10]
    assert late and max(r[1] - r[0] for r in late) < 5, "requests ten seconds after the loss are served at once"

    # the fleet's view: the lost replica is stale within seconds (then dropped), and routing holds nothing of it
    def forgotten() -> dict | None:
        state = fleet_stats(url)["replicas"].get(lost)
        return state if state is None or state["stale"] else None

    wait_until(forgotten, timeout=10, interval=0.2, what="the lost replica marked stale")
    assert time.monotonic() - killed < 30
    again = chat(url, next(s for s, home in homes.items() if home == lost), "Last tram?")
    assert again.status_code == 200 and again.headers["x-tierserve-replica"] == survivor
