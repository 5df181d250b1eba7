"""tierserve fleet on a real Ray Serve cluster: two engine replicas of the builtin model behind the ingress.

One module-scoped cluster (2 CPUs, replicas of half a CPU each) serves every
test; the tests go through the ingress over HTTP as a client would.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
from litestar.testing import TestClient

from tests.conftest import require_service
from tests.redis_server import RedisServer
from tests.server_helpers import free_port
from tests.waiting import wait_until
from tierserve.engine import EngineClient
from tierserve.core.sampling_params import SamplingParams
from tierserve.fleet.app import APP_NAME, build_fleet, engine_options
from tierserve.fleet.settings_sources import SettingsSources
from tierserve.server.app import create_app

pytestmark = pytest.mark.fleet

try:
    import ray
    from ray import serve
except ImportError:
    require_service("Ray", "pip install -e '.[test]' installs ray[serve]")

KEY = "fleet-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are a helpful assistant for a railway company; answer about timetables and tickets only. " * 2
SETTINGS = {
    ("model", "path"): "builtin:tiny",
    ("fleet", "replicas"): 2,
    ("fleet", "num_cpus"): 0.5,
    ("auth", "api_keys"): [KEY],
    ("logging", "level"): "warning",
    ("server", "engine_process"): False,  # each replica is a process already
}


@pytest.fixture(scope="module")
def fleet():
    sources = SettingsSources.of("development", None, SETTINGS)
    for name in ("REPLICA", "HANDLE"):  # load reports every 10 s by default: too slow for a test of autoscaling
        os.environ[f"RAY_SERVE_{name}_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_fleet(sources), name=APP_NAME, route_prefix="/")
    yield sources, f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def chat(url: str, *turns: str, max_tokens: int = 4) -> httpx.Response:
    messages = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": turn} for turn in turns]
    body = {"model": "builtin:tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def running_replicas() -> int:
    status = serve.status().applications[APP_NAME].deployments["engine"]
    return status.replica_states.get("RUNNING", 0)


def live_replicas() -> set[str]:
    """The ids of the engine replicas whose actors are alive."""
    prefix = f"SERVE_REPLICA::{APP_NAME}#engine#"
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]
    return {name.removeprefix(prefix) for name in names if name.startswith(prefix)}


def test_the_fleet_answers_as_the_single_server_does(fleet):
    sources, url = fleet
    body = {"model": "builtin:tiny", "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert answer.status_code == 200 and answer.headers["x-tierserve-replica"]
    loaded = sources.load()
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
    try:
        [expected] = engine.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=6))
        assert answer.json()["choices"][0]["text"] == expected.text
        with TestClient(create_app(loaded, engine=engine, load_in_background=False)) as single:
            for path, request in (("/v1/completions", {**body, "max_tokens": 0}), ("/v1/models", None)):
                mine = single.post(path, json=request) if request else single.get(path)
                theirs = httpx.post(f"{url}{path}", json=request) if request else httpx.get(f"{url}{path}")
                assert (theirs.status_code, theirs.json()) == (mine.status_code, mine.json()) == (401, mine.json())
            bad = {**body, "max_tokens": 0}
            mine = single.post("/v1/completions", json=bad, headers=AUTH)
            theirs = httpx.post(f"{url}/v1/completions", json=bad, headers=AUTH)
            assert theirs.status_code == mine.status_code == 400 and theirs.json() == mine.json()
    finally:
        engine.close()
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=120) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert stream.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_a_conversation_stays_on_the_replica_holding_its_prefix(fleet):
    _, url = fleet
    before = httpx.get(f"{url}/v1/fleet/stats", headers=AUTH).json()["routing_decisions"]
    turns = ["When does the first train leave?", "And the last one?", "How much is a return ticket?"]
    replicas, cached = [], []
    for count in range(1, len(turns) + 1):
        answer = chat(url, *turns[:count])
        assert answer.status_code == 200
        replicas.append(answer.headers["x-tierserve-replica"])
        cached.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(set(replicas)) == 1 and cached[0] == 0 and min(cached[1:]) > 0
    after = httpx.get(f"{url}/v1/fleet/stats", headers=AUTH).json()["routing_decisions"]
    assert after.get("prefix", 0) - before.get("prefix", 0) >= 2
    assert httpx.get(f"{url}/v1/fleet/stats").status_code == 401


def test_a_killed_replica_is_replaced_and_requests_keep_succeeding(fleet):
    _, url = fleet
    serving = chat(url, "Which platform?").headers["x-tierserve-replica"]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#engine#{serving}", namespace="serve")
    ray.kill(actor, no_restart=True)
    for turn in range(4):  # the replica is gone: its conversation and new ones go to the other one
        answer = chat(url, "Which platform?", f"turn {turn}")
        assert answer.status_code == 200 and answer.headers["x-tierserve-replica"] != serving

    def replaced() -> bool:
        live = live_replicas()
        return serving not in live and len(live) >= 2 and running_replicas() >= 2

    wait_until(replaced, timeout=180, interval=0.5, what="a replica in place of the killed one")
    assert chat(url, "Is there a night train?").status_code == 200


def test_fleet_settings_become_the_deployment_options(fleet):
    sources, _ = fleet
    settings = sources.load(fleet__autoscaling=True, fleet__min_replicas=1, fleet__max_replicas=3).settings
    options = engine_options(settings.fleet, settings)
    assert "num_replicas" not in options
    assert options["autoscaling_config"]["max_replicas"] == 3
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}


def test_autoscaling_adds_a_replica_under_load_and_removes_it_when_idle(fleet):
    from concurrent.futures import ThreadPoolExecutor

    sources, url = fleet
    scaling = {
        ("fleet", "autoscaling"): True,
        ("fleet", "min_replicas"): 1,
        ("fleet", "max_replicas"): 2,
        ("fleet", "target_ongoing_requests"): 1,
        ("fleet", "upscale_delay_seconds"): 0.5,
        ("fleet", "downscale_delay_seconds"): 1,
        ("fleet", "load_window_seconds"): 1.5,
    }
    autoscaled = SettingsSources.of("development", None, {**SETTINGS, **scaling})
    serve.run(build_fleet(autoscaled), name=APP_NAME, route_prefix="/")  # the same deployment, now autoscaled
    # the new bounds take effect: min_replicas while nothing runs
    wait_until(lambda: running_replicas() <= 1, timeout=60, interval=0.5, what="the idle fleet at min_replicas")

    def busy(index: int) -> int:
        body = {"model": "builtin:tiny", "prompt": f"load {index}", "max_tokens": 48, "ignore_eos": True}
        return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=180).status_code

    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        while running_replicas() < 2:  # ongoing requests above the target: a second replica starts
            assert time.monotonic() - started < 120, "the loaded fleet did not scale up"
            assert all(code == 200 for code in pool.map(busy, range(6)))
    wait_until(lambda: running_replicas() <= 1, timeout=120, interval=0.5, what="the idle fleet back at one replica")


def test_an_oversized_body_is_refused_at_the_ingress(fleet):
    sources, url = fleet
    limit = sources.load().settings.server.max_request_bytes
    body = b'{"prompt": "' + b"x" * (limit + 1) + b'"}'
    answer = httpx.post(f"{url}/v1/completions", content=body, headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert answer.status_code == 413 and "max_request_bytes" in answer.json()["error"]["message"]


@pytest.mark.redis
def test_disaggregated_prefill_hands_the_prompt_to_the_decode_replica_through_redis(fleet, tmp_path):
    sources, url = fleet
    shared = RedisServer(tmp_path / "redis").start()
    try:
        tier = {"name": "shared", "plugin": "redis", "url": shared.url, "write_through": True}
        split = {**SETTINGS, ("fleet", "replicas"): 1, ("fleet", "prefill_replicas"): 1, ("kv_cache", "tiers"): [tier]}
        serve.run(build_fleet(SettingsSources.of("development", None, split)), name=APP_NAME, route_prefix="/")
        prompt = SYSTEM + "Which trains stop at the airport?"
        body = {"model": "builtin:tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=180)
        assert answer.status_code == 200
        usage = answer.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16  # all but the last block
        assert shared.client().dbsize() > 0
        loaded = sources.load()
        engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
        try:
            [expected] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
        finally:
            engine.close()
        assert answer.json()["choices"][0]["text"] == expected.text

        # the spec's cached routes go through the prefill replica too: their first request already finds its prompt
        # (prompts sharing no block with the one above: what they find, only the prefill replica put there)
        harbour = "The harbour tram line runs every ten minutes from the station to the ferry terminal. " * 2
        cached = {**body, "prompt": harbour + "When is the last one?", "cache_key": "harbour-trams"}
        answer = httpx.post(f"{url}/v1/cached/completions", json=cached, headers=AUTH, timeout=180)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert usage["cached_tokens"] >= usage["prompt_tokens"] - 16
        chat = {"model": "builtin:tiny", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": "Night buses leave the square hourly. " * 3},
                             {"role": "user", "content": "And on Sundays?"}]}  # fmt: skip
        answer = httpx.post(f"{url}/v1/cached/chat/completions", json=chat, headers=AUTH, timeout=180)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert usage["cached_tokens"] >= usage["prompt_tokens"] - 16
    finally:  # the last test of the module: the fleet stays disaggregated until the module's teardown
        shared.stop()

