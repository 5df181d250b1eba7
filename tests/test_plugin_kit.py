"""A plugin under development loads without packaging (``--plugin`` a file, a package folder or a module name),
in the server's process and again in the engine core's, and a mistake in it stops the command with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from tests.server_helpers import running_server
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.integration

COUNTING_TIER = '''
    """A memory tier that counts what it stores: a plugin being written, not installed."""
    from tierserve.plugin_api import hookimpl
    from tierserve.plugins.tiers.memory import MemoryTier, MemoryTierSettings


    class CountingTier(MemoryTier):
        def __init__(self, tier, policy_factory, fingerprint):
            super().__init__(tier, policy_factory, fingerprint)
            self.stored = self.figures.counter("blocks_stored", "blocks handed to the tier")

        def put(self, entry):
            self.stored.inc()
            return super().put(entry)


    @hookimpl
    def register_cache_tiers(register):
        register("counting", CountingTier, settings=MemoryTierSettings, description="counts its puts")
'''


def tierserve(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSERVE_")}
    return subprocess.run([sys.executable, "-m", "tierserve.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)  # fmt: skip


def test_plugins_lists_a_file_and_a_package_folder_given_with_plugin(tmp_path):
    (tmp_path / "counting_tier.py").write_text(textwrap.dedent(COUNTING_TIER))
    package = tmp_path / "my_tiers"
    package.mkdir()
    (package / "__init__.py").write_text("from .tiers import register_cache_tiers  # noqa: F401\n")
    (package / "tiers.py").write_text(textwrap.dedent(COUNTING_TIER).replace('"counting"', '"counting2"'))
    result = tierserve("plugins", "--json", "--plugin", str(tmp_path / "counting_tier.py"), "--plugin", str(package))
    assert result.returncode == 0, result.stderr
    listed = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert listed["counting_tier"]["components"] == {"cache_tiers": ["counting"]}
    assert listed["counting_tier"]["source"] == f"--plugin {tmp_path / 'counting_tier.py'}"
    assert listed["my_tiers"]["components"] == {"cache_tiers": ["counting2"]}  # its relative import worked


def test_a_plugin_that_does_not_load_stops_the_command_with_the_reason(tmp_path):
    missing = tierserve("config", "show", "--plugin", str(tmp_path / "nowhere.py"))
    assert missing.returncode != 0
    assert f"--plugin {tmp_path / 'nowhere.py'}: ImportError: plugin {tmp_path / 'nowhere.py'}: no such file" in missing.stderr
    (tmp_path / "typo.py").write_text("from tierserve.plugin_api import hookimpl\n\n@hookimpl\ndef register_cache_tier(register):\n    pass\n")
    typo = tierserve("serve", "--plugin", str(tmp_path / "typo.py"))
    assert typo.returncode != 0
    assert "unknown hook 'register_cache_tier' (did you mean 'register_cache_tiers'?)" in typo.stderr


def test_the_engine_process_loads_the_plugin_too_and_its_figures_reach_the_server(tmp_path):
    (tmp_path / "counting_tier.py").write_text(textwrap.dedent(COUNTING_TIER))
    overrides = {
        ("model", "path"): "builtin:tiny", ("model", "device"): "cpu", ("server", "engine_process"): True,
        ("kv_cache", "block_size"): 4, ("kv_cache", "l1_capacity"): 8, ("logging", "level"): "warning",
        ("kv_cache", "tiers"): [{"name": "spill", "plugin": "counting", "capacity": 64}],
    }  # fmt: skip
    loaded = load_settings(None, environ={}, overrides=overrides, plugin_modules=[str(tmp_path / "counting_tier.py")])
    with running_server(loaded, plugins=loaded.plugins) as base:
        for prompt in ["the first prompt fills several KV blocks", "a second one, different from the start"] * 2:
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        figures = httpx.get(f"{base}/v1/cache/stats", timeout=10).json()["plugin_figures"]
    assert figures["counting_tier"]["spill"]["blocks_stored"] > 0
