"""The serving spec's example requests (``../shared/reference/rtx-serving-api.txt``), copied verbatim, against
both shipped presets as they ship (their model, ``builtin:tiny``, answers the spec's example model names), and
the spec's sliding window as a client of either preset meets it."""

from __future__ import annotations

import httpx
import pytest

from tests.server_helpers import running_server
from tests.test_cached_api import SPEC_EXAMPLE
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.integration

TEXT_COMPLETION = {  # the spec's "Text Completion" example
    "model": "default-model",
    "prompt": "The weather today is",
    "max_tokens": 50,
    "temperature": 0.7,
    "stream": False,
}
CACHED_COMPLETION = SPEC_EXAMPLE  # the spec's "Enhanced Cached Inference" example, verbatim


@pytest.fixture(scope="module", params=["development", "production"])
def preset(request, tmp_path_factory):
    """A server running one shipped preset as it ships (the persistent tier in a temporary folder)."""
    overrides = {("server", "engine_process"): False, ("logging", "level"): "warning",
                 ("kv_cache", "disk_path"): str(tmp_path_factory.mktemp("l3"))}  # fmt: skip
    loaded = load_settings(request.param, environ={}, overrides=overrides)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        yield base


def test_the_spec_example_model_names_reach_the_presets_model(preset):
    answer = httpx.post(f"{preset}/v1/completions", json=TEXT_COMPLETION, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0
    advanced = httpx.post(f"{preset}/v1/completions", json={**TEXT_COMPLETION, "model": "advanced-model"}, timeout=120)
    assert advanced.status_code == 200, advanced.text
    listed = [m["id"] for m in httpx.get(f"{preset}/v1/models", timeout=30).json()["data"]]
    assert listed == ["builtin:tiny"]  # accepted, not listed: the model keeps its own name
    unknown = httpx.post(f"{preset}/v1/completions", json={**TEXT_COMPLETION, "model": "no-such-model"}, timeout=30)
    assert unknown.status_code == 404 and "no-such-model" in unknown.json()["error"]["message"]


def test_every_example_request_of_the_spec_succeeds(preset):
    for path in ("/health", "/health/ready", "/health/live", "/v1/models", "/v1/cache/stats"):
        answer = httpx.get(f"{preset}{path}", timeout=30)
        assert answer.status_code == 200, (path, answer.text)
    assert httpx.get(f"{preset}/health", timeout=30).json()["status"] == "healthy"
    first = httpx.post(f"{preset}/v1/cached/completions", json=CACHED_COMPLETION, timeout=120)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["request_id"] == "req-123" and body["cache_stats"]["window_reuse"] == 0
    assert {"cache_stats", "performance", "usage"} <= set(body)
    again = httpx.post(f"{preset}/v1/cached/completions", json={**CACHED_COMPLETION, "request_id": "req-124"}, timeout=120)
    assert again.status_code == 200, again.text
    stats = httpx.get(f"{preset}/v1/cache/stats", timeout=30).json()
    assert {"kv_cache", "radix_tree", "speculation", "sliding_window"} <= set(stats["cache_manager"])
    assert {"overall", "alerts", "trends"} <= set(stats)
    assert httpx.post(f"{preset}/v1/cache/warm", json={"prompts": ["Explain quantum computing"]}, timeout=120).status_code == 200
    assert httpx.post(f"{preset}/v1/cache/clear", timeout=60).status_code == 200


def test_a_request_may_turn_the_window_on_and_size_it_within_the_specs_range(preset):
    windowed = {"model": "advanced-model", "prompt": "Tell me about the railway station.", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "enable_sliding_window": True, "window_size": 64}  # fmt: skip
    answer = httpx.post(f"{preset}/v1/cached/completions", json=windowed, timeout=120)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["usage"]["completion_tokens"] == 400 and body["cache_stats"]["windows_slid"] > 0
    # the KV it held at most: its window (64 tokens, 4 sinks, an overlap of at most 32) and the block being
    # filled (8 blocks of 16 tokens), not every block it wrote (26) as the same request without a window holds
    plain = {key: value for key, value in windowed.items() if key not in ("enable_sliding_window", "window_size")}
    unbounded = httpx.post(f"{preset}/v1/cached/completions", json=plain, timeout=120)
    assert unbounded.status_code == 200, unbounded.text
    memory, everything = body["performance"]["memory_usage_bytes"], unbounded.json()["performance"]["memory_usage_bytes"]
    assert 0 < memory and 3 * memory < everything

    # a windowed prompt sent again: its attention states come from the cache (window_reuse, in blocks)
    long_prompt = {**windowed, "prompt": "Tell me about the history of the station and its clocks. " * 8, "max_tokens": 4}
    for _ in range(2):
        again = httpx.post(f"{preset}/v1/cached/completions", json=long_prompt, timeout=120)
        assert again.status_code == 200, again.text
    assert again.json()["cache_stats"]["window_reuse"] == again.json()["cache_stats"]["cache_hits"] > 0
    plain_again = httpx.post(f"{preset}/v1/cached/completions", json=plain | {"max_tokens": 4, "prompt": long_prompt["prompt"]}, timeout=120)
    assert plain_again.json()["cache_stats"]["cache_hits"] > 0 and plain_again.json()["cache_stats"]["window_reuse"] == 0

    for size in (32, 2048):
        refused = httpx.post(f"{preset}/v1/cached/completions", json={**windowed, "window_size": size}, timeout=30)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "window_size" and "64 to 1024" in error["message"]
    unwindowed = {**windowed, "enable_sliding_window": False}
    refused = httpx.post(f"{preset}/v1/cached/completions", json=unwindowed, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "window_size"


def test_a_window_the_kv_cache_cannot_hold_is_a_400_naming_window_size_and_what_fits():
    from tierserve.testing import http_client

    with http_client({"kv_cache.l1_capacity": 64}) as client:  # 64 blocks of 16: 1,024 tokens of KV
        body = {"prompt": "Hello there", "max_tokens": 8, "enable_sliding_window": True, "window_size": 1024}
        refused = client.post("/v1/cached/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "window_size"
        largest = int(refused.json()["error"]["message"].rsplit(" to ", 1)[1].split()[0])
        assert 64 <= largest < 1024
        fits = client.post("/v1/cached/completions", json={**body, "window_size": largest})
        assert fits.status_code == 200, fits.text
