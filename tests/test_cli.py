"""The tierserve command as a user runs it (the installed console script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TIERSERVE = str(Path(sys.executable).parent / "tierserve")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSERVE_")}
    full_env.update(env or {})
    return subprocess.run([TIERSERVE, *args], capture_output=True, text=True, env=full_env, timeout=120)


def test_plugins_json_lists_the_four_policies_with_their_plugin():
    result = run("plugins", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    owners = {
        name: plugin["name"]
        for plugin in payload["plugins"]
        for name in plugin["components"].get("eviction_policies", [])
    }
    assert owners == {
        "lru": "tierserve.plugins.eviction.lru",
        "lfu": "tierserve.plugins.eviction.lfu",
        "adaptive": "tierserve.plugins.eviction.adaptive",
        "clock": "tierserve.plugins.eviction.clock",
    }
    for plugin in payload["plugins"]:
        assert plugin["version"] and plugin["source"] == "builtin"
        if plugin["name"] in owners.values():
            assert plugin["hooks"] == ["register_eviction_policies"]
    assert payload["failures"] == []


def test_plugins_text_output():
    result = run("plugins")
    assert result.returncode == 0
    assert "tierserve.plugins.eviction.adaptive" in result.stdout
    assert "eviction_policies: adaptive" in result.stdout


def test_config_show_production_prints_values_with_sources():
    result = run("config", "show", "--preset", "production")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "[kv_cache]" in lines
    policy = next(line for line in lines if line.startswith("eviction_policy"))
    assert '"adaptive"' in policy and "preset production" in policy
    port = next(line for line in lines if line.startswith("shutdown_grace_seconds"))
    assert port.endswith("# default")


def test_config_show_json_with_env_and_set():
    result = run(
        "config",
        "show",
        "--json",
        "--set",
        "kv_cache.l1_capacity=1234",
        env={"TIERSERVE_SERVER__PORT": "9001"},
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["kv_cache"]["l1_capacity"] == {"value": 1234, "source": "command line"}
    assert shown["server"]["port"] == {"value": 9001, "source": "environment variable TIERSERVE_SERVER__PORT"}


def test_bad_config_exits_2_with_message(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[kv_cache]\neviction_policy = "lru2"\n')
    result = run("config", "show", "--config", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "available: adaptive, clock, lfu, lru; did you mean 'lru'?" in result.stderr
    assert str(bad) in result.stderr


def test_serve_validates_settings_before_loading_anything(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = -1\n")
    result = run("serve", "--config", str(bad))
    assert result.returncode == 2 and "server.port = -1" in result.stderr
    result = run("serve", "--set", 'kv_cache.eviction_policy="lru2"')
    assert result.returncode == 2 and "did you mean 'lru'" in result.stderr


def test_serve_runs_the_embedded_model_and_stops_cleanly(tmp_path):
    import signal

    import httpx

    from tests.server_helpers import free_port, wait_ready

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSERVE_")}
    env["TIERSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    process = subprocess.Popen(
        [TIERSERVE, "serve", "--preset", "development", "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, 120)
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0}, timeout=60)
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "Traceback" not in output


def test_serve_ends_with_one_line_when_the_model_cannot_load(tmp_path):
    from tests.engine_helpers import build_checkpoint
    from tests.server_helpers import free_port

    bloom = build_checkpoint(tmp_path, "bloom", "bloom")  # ALiBi: the paged transformers backend refuses it
    result = run("serve", "--model", str(bloom), "--port", str(free_port()), "--set", 'model.backend="transformers"')
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tierserve serve: the model failed to load: ")
    assert "AttentionInterface" in last and 'model.backend = "transformers-unpaged"' in last
    assert "Traceback" not in result.stderr


def test_config_show_says_which_backend_auto_runs(tmp_path):
    from tests.engine_helpers import build_checkpoint
    from tierserve.models.backend_choice import backend_candidates
    from tierserve.settings.config import load_settings

    gemma = build_checkpoint(tmp_path, "gemma2", "gemma2")
    result = run("config", "show", "--set", f"model.path={json.dumps(str(gemma))}")
    assert result.returncode == 0, result.stderr
    assert '"auto"    # default; runs transformers for this checkpoint' in result.stdout
    chosen = {}
    for architecture in ("llama", "bloom"):
        path = build_checkpoint(tmp_path, architecture, architecture)
        loaded = load_settings(None, environ={}, overrides={("model", "path"): str(path)})
        chosen[architecture] = backend_candidates(loaded.settings, loaded.plugins.registry("backends"))[0]
    assert chosen == {"llama": "native", "bloom": "transformers-unpaged"}


def test_config_show_json_stays_json_when_the_builtin_model_is_written_first(tmp_path):
    """On a fresh cache ``config show`` writes the default builtin model; its log line goes to stderr."""
    result = run("config", "show", "--json", env={"TIERSERVE_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["server"]["host"]["value"] == "127.0.0.1"
    assert "writing builtin model" in result.stderr
