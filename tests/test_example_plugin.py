"""The example plugin package, installed with pip as a user would, then used by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.integration

EXAMPLE = REPO_ROOT / "examples" / "tierserve-example-plugin"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """pip-install the example plugin into its own folder (not the test environment)."""
    site = tmp_path_factory.mktemp("example-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(EXAMPLE)],
        check=True,
        timeout=300,
    )
    return site


def run_with_plugin(site, args, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSERVE_")}
    full_env["PYTHONPATH"] = str(site)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=full_env, timeout=120, cwd=site
    )


def test_installed_plugin_is_listed(plugin_site):
    result = run_with_plugin(plugin_site, ["-m", "tierserve.cli.main", "plugins", "--json"])
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    # two entry points of one distribution: each is dist:entry, whatever else is installed or allowed
    fifo, sjf = plugins["tierserve-example-plugin:fifo"], plugins["tierserve-example-plugin:sjf"]
    assert fifo["version"] == "0.1.0"
    assert fifo["components"] == {"eviction_policies": ["fifo"]} and sjf["components"] == {"schedulers": ["sjf"]}
    assert fifo["source"] == "entry point tierserve_example_plugin"


def test_allowlist_can_exclude_it_or_take_one_entry_point_by_its_listed_name(plugin_site):
    command = ["-m", "tierserve.cli.main", "plugins", "--json"]
    result = run_with_plugin(plugin_site, command, env={"TIERSERVE_PLUGINS": ""})
    assert "tierserve-example-plugin" not in result.stdout
    result = run_with_plugin(plugin_site, command, env={"TIERSERVE_PLUGINS": "tierserve-example-plugin:sjf"})
    names = [p["name"] for p in json.loads(result.stdout)["plugins"] if p["source"] != "builtin"]
    assert names == ["tierserve-example-plugin:sjf"]  # the same name as when both load


def test_the_example_plugins_own_tests_pass_with_tierserve_testing(plugin_site):
    """The package's tests (examples/tierserve-example-plugin/tests) use tierserve.testing's suites and fixtures."""
    result = run_with_plugin(plugin_site, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(EXAMPLE)],
                             env={"PYTEST_ADDOPTS": "", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "5 passed" in result.stdout


def test_selected_by_name_from_toml_and_exercised(plugin_site, tmp_path):
    config = tmp_path / "fifo.toml"
    config.write_text('[kv_cache]\neviction_policy = "FIFO"\nl1_capacity = 3\n')
    script = textwrap.dedent(
        f"""
        import json
        from tierserve.settings.config import load_settings
        loaded = load_settings(None, config_file={str(config)!r}, environ={{}})
        name = loaded.settings.kv_cache.eviction_policy
        component = loaded.plugins.registry("eviction_policies").get(name)
        policy = component.factory(loaded.settings.kv_cache.l1_capacity)
        for key in "abcd":
            policy.insert(key)
        policy.touch("a")          # FIFO ignores hits
        policy.pin("b")            # pinned entries are never victims
        victims = [policy.evict(), policy.evict(), policy.evict()]
        print(json.dumps({{"name": name, "plugin": component.plugin, "victims": victims}}))
        """
    )
    result = run_with_plugin(plugin_site, ["-c", script])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "name": "fifo",
        "plugin": "tierserve-example-plugin:fifo",
        "victims": ["a", "c", "d"],
    }


def test_example_scheduler_serves_shortest_prompts_first_with_unchanged_outputs(plugin_site, tmp_path):
    """The ``sjf`` scheduler, written from the scheduler contract alone, drives a real engine."""
    from tests.engine_helpers import build_checkpoint

    checkpoint = build_checkpoint(tmp_path, "llama", "llama")
    script = textwrap.dedent(
        f"""
        import json
        from tierserve.settings.config import load_settings
        from tierserve.engine import EngineClient
        from tierserve.core.sampling_params import SamplingParams

        prompts = ["a much longer prompt than the others, " * 4, "mid-sized prompt here", "hi"]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

        def engine(scheduler, extra=None):
            overrides = {{("model", "path"): {str(checkpoint)!r}, ("model", "device"): "cpu",
                         ("scheduler", "name"): scheduler, ("kv_cache", "block_size"): 4, **(extra or {{}})}}
            loaded = load_settings(None, environ={{}}, overrides=overrides)
            return EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)

        sjf = engine("sjf", {{("scheduler", "max_num_seqs"): 1}})
        submitted = [sjf.submit(sjf.encode_prompt(p), params) for p in prompts]
        order = []
        while sjf.has_work():
            sjf.step()
            for index, (_, stream) in enumerate(submitted):
                try:
                    while True:
                        if stream.get(timeout=0).finished:
                            order.append(index)
                except Exception:
                    pass
        # a pool too small for all of them at once: the longest yields, and is recomputed later
        tight = engine("sjf", {{("kv_cache", "l1_capacity"): 12, ("scheduler", "max_num_batched_tokens"): 8}})
        outputs = [r.token_ids for r in tight.generate(prompts, params)]
        reference = [r.token_ids for r in engine("fcfs").generate(prompts, params)]
        stats = tight.stats()
        print(json.dumps({{"order": order, "same": outputs == reference, "preemptions": stats.counters.preemptions,
                          "free": stats.kv_blocks_free == stats.kv_blocks_total}}))
        """
    )
    result = run_with_plugin(plugin_site, ["-c", script])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["order"] == [2, 1, 0]  # shortest prompt first
    assert report["same"] and report["free"]
    assert report["preemptions"] > 0


def test_the_sqlite_tier_written_from_the_docs_keeps_the_tier_rules_and_publishes_its_figures():
    """examples/tierserve-sqlite-tier was written from docs/plugins.md and the plugin API's docstrings alone; its
    tests run check_cache_tier and read its own counters back from /v1/cache/stats and /metrics."""
    example = REPO_ROOT / "examples" / "tierserve-sqlite-tier"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERSERVE_", "PYTEST_"))}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(example)],
        capture_output=True, text=True, timeout=300, cwd=example, env={**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "6 passed" in result.stdout
