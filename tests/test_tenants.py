"""Tenants: with API keys configured, each key's cache, cache keys, request ids and statistics are its own.

Regression tests for the hardening issue: user key A's cached prompt was an
oracle for key B (a right guess came back with more cached tokens), cache
keys and request ids were global, and any key read the global statistics.
"""

from __future__ import annotations

import httpx
import pytest

from tests.engine_helpers import build_checkpoint
from tests.server_helpers import server_starter
from tierserve.server.tenants import key_id

pytestmark = pytest.mark.integration

SECRET = "Confidential: the merger with Initech closes on the fifth of March, tell no one outside the board."
ADMIN = {"Authorization": "Bearer sk-admin"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


@pytest.fixture
def serve(checkpoint):
    """A server on an in-process engine with these ``[auth]`` settings; yields its URL."""
    with server_starter(checkpoint) as start:
        yield lambda **auth: start(**{f"auth__{key}": value for key, value in auth.items()})


def cached(base: str, key: str, prompt: str = SECRET, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(f"{base}/v1/cached/completions", json=body, headers=bearer(key), timeout=120)


def cached_tokens(base: str, key: str, prompt: str = SECRET, **fields) -> int:
    reply = cached(base, key, prompt, **fields)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["cached_tokens"]


def test_a_tenants_prefixes_are_no_oracle_for_another(serve):
    with serve(api_keys=["sk-a", "sk-b"], tenants={"team": ["sk-c", "sk-d"]}, shared_cache_keys=["sk-e", "sk-f"]) as base:
        assert cached_tokens(base, "sk-a") == 0
        assert cached_tokens(base, "sk-b") == 0  # the same prompt, another key: nothing of A's is visible
        forged = f"{key_id('sk-a')}\x00"  # a salt spelling A's scope is still B's own
        assert cached_tokens(base, "sk-b", cache_salt=forged) == 0
        assert cached_tokens(base, "sk-a") > 0  # A's own prefix is still there for A
        # sharing happens where the operator says so: keys of one tenant, or the shared keys
        assert cached_tokens(base, "sk-c") == 0 and cached_tokens(base, "sk-d") > 0
        assert cached_tokens(base, "sk-e") == 0 and cached_tokens(base, "sk-f") > 0
        assert cached_tokens(base, "sk-c", cache_salt="x") == 0  # a salt still splits a tenant


def test_tenant_keys_without_admin_keys_cannot_administer(serve):
    """With API keys and no ``auth.admin_api_keys``, admin routes are refused (403 naming the setting), where
    they used to make every tenant an admin (one tenant cleared every tenant's caches)."""
    with serve(api_keys=["sk-a", "sk-b"]) as base:
        assert cached_tokens(base, "sk-a") == 0
        for method, path in (("POST", "/v1/cache/clear"), ("POST", "/v1/cache/flush")):
            refused = httpx.request(method, base + path, json={}, headers=bearer("sk-b"))
            assert refused.status_code == 403, (path, refused.text)
            assert "auth.admin_api_keys" in refused.json()["error"]["message"]
        assert cached_tokens(base, "sk-a") > 0  # A's cache is still there


def test_without_api_keys_every_request_shares_the_cache_as_before(serve):
    with serve() as base:
        assert cached_tokens(base, "anything") == 0 and cached_tokens(base, "other") > 0


def test_cache_keys_and_request_ids_are_per_tenant(serve):
    with serve(api_keys=["sk-a", "sk-b"], admin_api_keys=["sk-admin"]) as base:
        assert cached(base, "sk-a", cache_key="support").status_code == 200
        mine = httpx.get(f"{base}/v1/cache/keys", headers=bearer("sk-b"), timeout=30).json()["data"]
        assert mine == []  # B sees none of A's keys
        reply = cached(base, "sk-b", "Hello there, how are you today? " * 4, cache_key="support").json()
        assert SECRET[:20] not in reply["text"] and reply["usage"]["cached_tokens"] == 0
        [b_key] = httpx.get(f"{base}/v1/cache/keys", headers=bearer("sk-b"), timeout=30).json()["data"]
        assert b_key["tenant"] == key_id("sk-b") and b_key["requests"] == 1
        everyone = httpx.get(f"{base}/v1/cache/keys", headers=ADMIN, timeout=30).json()["data"]
        assert sorted(entry["tenant"] for entry in everyone) == sorted([key_id("sk-a"), key_id("sk-b")])
        peek = httpx.get(f"{base}/v1/cache/keys", params={"tenant": key_id("sk-a")}, headers=bearer("sk-b"))
        assert peek.status_code == 403 and peek.json()["error"]["param"] == "tenant"
        # B deletes its own "support"; A's stays pinned and cached
        gone = httpx.delete(f"{base}/v1/cache/keys/support", headers=bearer("sk-b"), timeout=30)
        assert gone.status_code == 200
        assert cached_tokens(base, "sk-a", cache_key="support") > 0
        # a request id in flight for A neither blocks nor shows up for B
        slow = {"prompt": "count slowly", "max_tokens": 400, "ignore_eos": True, "stream": True, "request_id": "same"}
        with httpx.stream("POST", f"{base}/v1/cached/completions", json=slow, headers=bearer("sk-a"), timeout=60) as s:
            lines = s.iter_lines()
            next(lines)  # A's request is in flight
            other = httpx.post(f"{base}/v1/cached/completions", json={**slow, "stream": False, "max_tokens": 2},
                               headers=bearer("sk-b"), timeout=60)  # fmt: skip
            twin = httpx.post(f"{base}/v1/cached/completions", json={**slow, "stream": False, "max_tokens": 2},
                              headers=bearer("sk-a"), timeout=60)  # fmt: skip
        assert other.status_code == 200 and other.json()["request_id"] == "same"
        assert twin.status_code == 400 and twin.json()["error"]["param"] == "request_id"


def test_a_tenant_reads_its_own_statistics_and_the_global_ones_need_an_admin_key(serve):
    with serve(api_keys=["sk-a", "sk-b"], admin_api_keys=["sk-admin"]) as base:
        cached_tokens(base, "sk-a")
        cached_tokens(base, "sk-a")
        own = httpx.get(f"{base}/v1/cache/stats", headers=bearer("sk-b"), timeout=30).json()
        assert own["scope"] == "tenant" and own["tenant"] == key_id("sk-b") and own["requests"] == 0
        a = httpx.get(f"{base}/v1/cache/stats", headers=bearer("sk-a"), timeout=30).json()
        assert a["requests"] == 2 and a["cached_tokens"] > 0 and 0 < a["hit_rate"] <= 100
        assert "cache_manager" not in a
        full = httpx.get(f"{base}/v1/cache/stats", headers=ADMIN, timeout=30).json()
        assert full["overall"]["prompt_tokens"] > 0 and "cache_manager" in full
    with serve(api_keys=["sk-a"], public_stats=True) as base:
        assert "cache_manager" in httpx.get(f"{base}/v1/cache/stats", headers=bearer("sk-a"), timeout=30).json()


def test_a_non_ascii_authorization_header_is_a_401(serve):
    with serve(api_keys=["sk-a"]) as base:
        for raw in (b"Bearer sk-\xe9", b"Bearer \xff\xfe", b"\xc3\xa9"):
            reply = httpx.get(f"{base}/v1/models", headers=[(b"authorization", raw)], timeout=30)
            assert reply.status_code == 401, (raw, reply.text)
            assert reply.json()["error"]["code"] == "invalid_api_key"
