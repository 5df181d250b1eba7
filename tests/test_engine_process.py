"""The engine core in a child process (``server.engine_process = true``): same outputs, same API, faults survived,
a dead core restarted (``server.engine_max_restarts``) with its disk tier intact."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading

import httpx
import pytest

from tests.engine_helpers import PROMPTS, build_checkpoint, hf_greedy, make_engine
from tests.server_helpers import running_server, wait_ready
from tests.waiting import wait_until
from tierserve.engine.beam_search import BeamSearchParams
from tierserve.settings.config import load_settings
from tierserve.engine import EngineClient
from tierserve.engine.process import EngineProcessError
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("process"), "llama", "llama")


def process_engine(path, **settings) -> EngineClient:
    overrides = {("model", "path"): str(path), ("model", "device"): "cpu", ("kv_cache", "block_size"): 4}
    for dotted, value in settings.items():
        section, key = dotted.split("__")
        overrides[(section, key)] = value
    loaded = load_settings(None, environ={}, overrides=overrides)
    return EngineClient.from_settings(loaded.settings, loaded.plugins, process=True)


@pytest.fixture(scope="module")
def engine(llama):
    engine = process_engine(llama)
    yield engine
    engine.close()


def test_outputs_equal_transformers_and_the_in_process_engine(llama, engine):
    assert engine.driver.process.pid != os.getpid()
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == hf_greedy(llama, PROMPTS, GREEDY.max_tokens)
    again = engine.generate(PROMPTS, GREEDY)  # now from the child's prefix cache
    assert [r.token_ids for r in again] == hf_greedy(llama, PROMPTS, GREEDY.max_tokens)
    assert any(r.cached_tokens for r in again)

    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[again[4].text[5:8]])
    local = make_engine(llama, kv_cache__block_size=4)
    for params in (sampled, stop):
        [here] = local.generate([PROMPTS[4]], params)
        [there] = engine.generate([PROMPTS[4]], params)
        assert (there.token_ids, there.text, there.finish_reason) == (here.token_ids, here.text, here.finish_reason)
    assert there.finish_reason == "stop"
    local.close()


def test_commands_and_statistics_cross_the_process_boundary(engine):
    engine.generate([PROMPTS[4]], GREEDY)
    stats = engine.stats()
    assert stats.cache is not None and stats.counters.generation_tokens >= GREEDY.max_tokens
    assert stats.kv_blocks_free == stats.kv_blocks_total  # nothing running
    vectors, tokens = engine.embed(["hello", "world"])
    assert vectors.shape[0] == 2 and tokens > 0
    [beam] = engine.beam_search(PROMPTS[1], BeamSearchParams(2, 6)).hypotheses
    assert len(beam.token_ids) == 6
    cleared = engine.clear_cache("l1")
    assert cleared["l1"] > 0 and engine.stats().cache.tiers["l1"].entries == 0
    engine.check_integrity()


def test_a_client_that_leaves_frees_its_blocks(engine):
    async def leave_early() -> int:
        seen = 0
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        async for output in engine.add_request(PROMPTS[4], params):
            seen += len(output.token_ids)
            if seen >= 3:
                break
        return seen

    before = engine.stats().counters.requests_aborted
    assert asyncio.run(leave_early()) >= 3
    wait_until(lambda: engine.stats().counters.requests_aborted != before, timeout=30, what="the abort")
    stats = engine.stats()
    assert stats.counters.requests_aborted == before + 1 and stats.kv_blocks_free == stats.kv_blocks_total


def test_a_killed_core_ends_requests_and_fails_cleanly(llama):
    engine = process_engine(llama, server__engine_max_restarts=0)
    _, stream = engine.submit(engine.encode_prompt(PROMPTS[1]), SamplingParams(max_tokens=400, ignore_eos=True))
    stream.get(timeout=60)  # it is running
    os.kill(engine.driver.process.pid, signal.SIGKILL)
    while not (out := stream.get(timeout=60)).finished:
        pass
    assert out.finish_reason == "abort"
    assert isinstance(out.failure, EngineProcessError) and out.failure.retry_after is None  # not to be retried
    with pytest.raises(EngineProcessError, match="engine_max_restarts = 0 allows no restart"):
        engine.submit(engine.encode_prompt(PROMPTS[1]), GREEDY)
    with pytest.raises(EngineProcessError):
        engine.clear_cache()
    engine.close()  # nothing left to stop: returns at once


def test_a_core_that_may_not_restart_leaves_the_server_unhealthy_saying_why(llama):
    """``engine_max_restarts = 0``: the death is logged with the signal; the request in flight and every later
    one answer 503 that is not to be retried; /health, /health/ready and /metrics say it is down for good and
    why; liveness stays up."""
    from litestar.testing import TestClient
    from structlog.testing import capture_logs

    from tierserve.server.app import create_app

    engine = process_engine(llama, server__engine_max_restarts=0)
    app = create_app(engine.settings, engine=engine, load_in_background=False)
    with TestClient(app) as http, capture_logs() as logs:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert "tierserve_ready 1.0" in http.get("/metrics").text
        os.kill(engine.driver.process.pid, signal.SIGKILL)
        wait_until(lambda: not engine.alive, timeout=30, what="the client to see its core is gone")
        wait_until(lambda: any(e["event"] == "engine_process_given_up" for e in logs), timeout=30, what="giving up")
        [died] = [e for e in logs if e["event"] == "engine_process_died"]
        assert died["exitcode"] == -signal.SIGKILL and died["signal"] == "SIGKILL"
        assert "tierserve_ready 0.0" in http.get("/metrics").text
        failed = http.post("/v1/completions", json=body)
        assert failed.status_code == 503 and "retry-after" not in failed.headers
        error = failed.json()["error"]
        assert (error["code"], error["retryable"]) == ("engine_unavailable", False)
        assert "killed by SIGKILL" in error["message"] and "server.engine_max_restarts = 0" in error["message"]
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        restarts = health.json()["details"]["restarts"]
        assert (restarts["state"], restarts["count"], restarts["engine_pid"]) == ("failed", 0, None)
        assert "server.engine_max_restarts = 0" in restarts["failure"]
        assert "server.engine_max_restarts = 0" in health.json()["components"]["load_error"]
        ready = http.get("/health/ready")
        assert ready.status_code == 503 and "server.engine_max_restarts = 0" in ready.json()["error"]["message"]
        assert http.get("/health/live").status_code == 200
        assert http.get("/v1/cache/stats").status_code == 503


def test_a_killed_core_is_restarted_and_serves_its_disk_tier_again(llama, tmp_path):
    """SIGKILL the core under a request: the request answers a retryable 503 with Retry-After, the core is
    started again, /health counts the restart and its cause, and the prompt written through to the
    persistent disk tier before the kill is served from it after."""
    overrides = {
        ("model", "path"): str(llama), ("model", "device"): "cpu", ("server", "engine_process"): True,
        ("kv_cache", "disk_path"): str(tmp_path / "l3"), ("kv_cache", "persistence"): True,
        ("scheduler", "max_num_seqs"): 1,  # the 16 choices below run one after another: a request in flight for long
        ("logging", "level"): "warning",
    }  # fmt: skip
    loaded = load_settings(None, environ={}, overrides=overrides)
    prompt = {"prompt": "A prompt long enough to fill several blocks of the cache. " * 6, "max_tokens": 1}
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        assert httpx.post(f"{base}/v1/completions", json=prompt, timeout=60).status_code == 200
        assert httpx.post(f"{base}/v1/cache/flush", timeout=60).status_code == 200  # its blocks are on disk
        before = httpx.get(f"{base}/health").json()["details"]["restarts"]
        assert (before["count"], before["state"]) == (0, "running")
        core = before["engine_pid"]
        assert core in {child.pid for child in multiprocessing.active_children()}  # this test's server's core

        replies: list[httpx.Response] = []
        events: list[str] = []
        long = {"prompt": "count", "max_tokens": 400, "ignore_eos": True, "n": 16}

        def stream() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", json={**long, "stream": True}, timeout=120) as reply:
                events.extend(line for line in reply.iter_lines() if line.startswith("data: "))

        def post() -> None:
            replies.append(httpx.post(f"{base}/v1/completions", json=long, timeout=120))

        senders = [threading.Thread(target=post), threading.Thread(target=stream)]
        for sender in senders:
            sender.start()
        def both_in_flight() -> bool:
            return httpx.get(f"{base}/health").json()["active_requests"] == 2

        wait_until(both_in_flight, timeout=30)
        os.kill(core, signal.SIGKILL)
        for sender in senders:
            sender.join()
        [cut] = replies
        assert cut.status_code == 503 and int(cut.headers["retry-after"]) >= 1, cut.text
        assert (cut.json()["error"]["code"], cut.json()["error"]["retryable"]) == ("engine_restarting", True)
        assert events[-1] == "data: [DONE]"  # the stream's 200 was sent: the 503's body is its last event
        assert '"code":"engine_restarting"' in events[-2] and '"retryable":true' in events[-2]

        wait_ready(base, timeout=120)
        health = httpx.get(f"{base}/health").json()
        restarts = health["details"]["restarts"]
        assert health["status"] == "healthy"
        assert (restarts["count"], restarts["state"], restarts["failure"]) == (1, "running", None)
        assert (restarts["last_exit_reason"], restarts["last_exit_code"]) == ("it was killed by SIGKILL", -9)
        assert restarts["last_exit_at"] and restarts["engine_pid"] not in (None, core)

        again = httpx.post(f"{base}/v1/completions", json=prompt, timeout=60)
        assert again.status_code == 200
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # L1 and L2 died with the core

        def l3_hits() -> int:
            return httpx.get(f"{base}/v1/cache/stats").json()["cache_manager"]["kv_cache"]["l3_hits"]

        wait_until(l3_hits, timeout=30, what="the new core to report its L3 hits")


def test_plugins_assembled_in_this_process_cannot_follow_the_core_into_its_own(llama):
    from types import SimpleNamespace

    from tierserve.core.errors import ConfigError
    from tierserve.core.plugins import load_plugins

    plugins = load_plugins(allowlist=[])
    assert plugins.reproducible  # built-ins and entry points: the core process loads the same
    plugins.add_plugin(SimpleNamespace(), "by-hand", "0", "test")
    loaded = load_settings(None, environ={}, overrides={("model", "path"): str(llama)}, plugins=plugins)
    with pytest.raises(ConfigError, match="engine_process = false"):
        EngineClient.from_settings(loaded.settings, plugins, process=True)


@pytest.mark.slow  # ~7 s: a server process of its own, its core started, then SIGKILLed
def test_a_core_whose_server_process_dies_exits_too(llama, tmp_path):
    """SIGKILL the server process: its core process must not live on (it would keep writing the cache files a
    restarted server opens)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import signal, sys
        from tierserve.settings.config import load_settings
        from tierserve.engine import EngineClient
        loaded = load_settings(None, environ={{}}, overrides={{("model", "path"): {str(llama)!r}}})
        engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=True)
        print("CORE", engine.driver.process.pid, flush=True)
        signal.pause()  # until the test kills this process
        """
    )
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    core_pid = next(int(line.split()[1]) for line in server.stdout if line.startswith("CORE "))
    os.kill(server.pid, signal.SIGKILL)
    server.wait()

    def core_gone() -> bool:
        try:
            os.kill(core_pid, 0)
        except ProcessLookupError:
            return True
        return False

    try:
        wait_until(core_gone, timeout=30, interval=0.1, what="the core process to exit with its server process")
    finally:
        if not core_gone():
            os.kill(core_pid, signal.SIGKILL)
