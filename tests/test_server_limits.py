"""Keys, rate limits and back-pressure at the HTTP level."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.engine_helpers import build_checkpoint, make_engine
from tests.server_helpers import running_server
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


def settings_for(path, extra=None):
    overrides = {("model", "path"): str(path)}
    overrides.update(extra or {})
    return load_settings(None, environ={}, overrides=overrides)


def test_api_keys_guard_every_v1_route(checkpoint):
    loaded = settings_for(checkpoint, {("auth", "api_keys"): ["sk-user"]})  # /metrics: private once keys exist
    engine = make_engine(checkpoint)
    body = {"prompt": "Hi", "max_tokens": 2}
    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("POST", "/v1/embeddings"), ("GET", "/v1/cache/stats"), ("GET", "/v1/plugins"),
                             ("GET", "/metrics")):
            missing = httpx.request(method, base + path, json=body)
            wrong = httpx.request(method, base + path, json=body, headers={"Authorization": "Bearer nope"})
            assert missing.status_code == 401 and wrong.status_code == 401, path
            assert missing.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-user"}, timeout=60)
        assert ok.status_code == 200
        assert httpx.get(base + "/health").status_code == 200  # health stays public by default
    engine.close()


def test_rate_limit_answers_429_in_openai_shape(checkpoint):
    loaded = settings_for(checkpoint, {("server", "rate_limit_per_minute"): 3})
    engine = make_engine(checkpoint)
    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
        statuses = [httpx.get(base + "/v1/models").status_code for _ in range(5)]
        assert statuses[:3] == [200, 200, 200] and statuses[3:] == [429, 429]
        assert httpx.get(base + "/health").status_code == 200  # health is never limited
        assert httpx.get(base + "/v1/models/health").status_code == 429  # ...but a path that ends in it is
        limited = httpx.get(base + "/v1/models")
        assert limited.json()["error"]["type"] == "rate_limit_error"
        # without API keys the bucket is the client's address: a made-up header is no fresh bucket
        other_header = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer someone-else"})
        assert other_header.status_code == 429
    engine.close()


def test_rate_limits_are_per_key_however_the_header_is_spelled(checkpoint):
    """Rewriting the Authorization header (case, spacing) used to get a fresh bucket each time."""
    values = {("server", "rate_limit_per_minute"): 3, ("auth", "api_keys"): ["sk-a", "sk-b"]}
    loaded = settings_for(checkpoint, values)
    engine = make_engine(checkpoint)
    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
        spellings = ["Bearer sk-a", "bearer sk-a", "BEARER sk-a", "Bearer  sk-a", "bEaReR \tsk-a"]
        statuses = [httpx.get(base + "/v1/models", headers={"Authorization": h}).status_code for h in spellings]
        assert statuses == [200, 200, 200, 429, 429]
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer sk-b"}).status_code == 200
        for junk in ("Bearer nope-1", "Bearer nope-2"):  # unknown keys share the address's bucket
            assert httpx.get(base + "/v1/models", headers={"Authorization": junk}).status_code in (401, 429)
    engine.close()


def test_full_queue_answers_503_with_retry_after_and_recovers(checkpoint):
    loaded = settings_for(checkpoint, {("scheduler", "max_waiting_requests"): 4, ("scheduler", "max_num_seqs"): 1})
    engine = make_engine(checkpoint, scheduler__max_waiting_requests=4, scheduler__max_num_seqs=1)
    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"prompt": "Tell me", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
                return await asyncio.gather(*(client.post(base + "/v1/completions", json=body) for _ in range(20)))

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert 503 in codes and 200 in codes
        for response in responses:
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "queue_full"
            else:
                assert response.json()["usage"]["completion_tokens"] == 40  # admitted work is never dropped
        after = httpx.post(base + "/v1/completions", json={"prompt": "again", "max_tokens": 2}, timeout=60)
        assert after.status_code == 200
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
    engine.close()
