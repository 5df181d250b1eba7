"""The serving spec's example requests (``../shared/reference/rtx-serving-api.txt``), copied verbatim, against
both shipped presets as they ship (their model, ``builtin:tiny``, answers the spec's example model names)."""

from __future__ import annotations

import httpx
import pytest

from tests.server_helpers import running_server
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.integration

TEXT_COMPLETION = {  # the spec's "Text Completion" example
    "model": "default-model",
    "prompt": "The weather today is",
    "max_tokens": 50,
    "temperature": 0.7,
    "stream": False,
}


@pytest.mark.parametrize("preset", ["development", "production"])
def test_the_spec_example_model_names_reach_the_presets_model(preset, tmp_path):
    overrides = {("server", "engine_process"): False, ("logging", "level"): "warning",
                 ("kv_cache", "disk_path"): str(tmp_path / "l3")}  # fmt: skip
    loaded = load_settings(preset, environ={}, overrides=overrides)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        answer = httpx.post(f"{base}/v1/completions", json=TEXT_COMPLETION, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] > 0
        advanced = httpx.post(f"{base}/v1/completions", json={**TEXT_COMPLETION, "model": "advanced-model"}, timeout=120)
        assert advanced.status_code == 200, advanced.text
        listed = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]]
        assert listed == ["builtin:tiny"]  # accepted, not listed: the model keeps its own name
        unknown = httpx.post(f"{base}/v1/completions", json={**TEXT_COMPLETION, "model": "no-such-model"}, timeout=30)
        assert unknown.status_code == 404 and "no-such-model" in unknown.json()["error"]["message"]
