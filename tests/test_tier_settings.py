"""``[[kv_cache.tiers]]``: an ordered list of tier plugins, each validating its own keys;
the legacy ``[kv_cache]`` keys map onto it."""

from __future__ import annotations

import json

import pytest

from tierserve.settings.config import Settings, load_settings, parse_override
from tierserve.engine import EngineClient
from tierserve.core.errors import ConfigError
from tierserve.core.sampling_params import SamplingParams
from tierserve.plugins.tiers.disk import DiskTierSettings
from tierserve.plugins.tiers.memory import MemoryTierSettings
from tests.engine_helpers import build_checkpoint
from tests.test_cli import run
from tests.test_config import ORIGINAL_DESIGN_TOML

pytestmark = pytest.mark.unit


def error_of(path, preset=None, environ=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(preset, config_file=path, environ=environ or {})
    return str(info.value)


def tables(loaded) -> list[dict]:
    return [tier.as_table() for tier in loaded.settings.kv_cache.tiers]


THREE_TIERS = """
[kv_cache]
eviction_policy = "LRU"
ttl_seconds = 600

[[kv_cache.tiers]]
name = "ram"
plugin = "memory"
capacity = 1000

[[kv_cache.tiers]]
name = "ssd"
plugin = "Disk"
eviction_policy = "LFU"
path = "{ssd}"
max_bytes = 1000000

[[kv_cache.tiers]]
name = "archive"
plugin = "disk"
path = "{archive}"
persistent = true
write_through = true
ttl_seconds = 0
compression_level = 19
"""


def test_three_tiers_load_and_config_show_json_shows_them(toml_file, tmp_path):
    path = toml_file(THREE_TIERS.format(ssd=tmp_path / "ssd", archive=tmp_path / "archive"))
    result = run("config", "show", "--json", "--config", str(path))
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)["kv_cache.tiers"]
    values = [{key: item["value"] for key, item in tier.items()} for tier in shown]
    assert values == [
        {"name": "ram", "plugin": "memory", "eviction_policy": "lru", "ttl_seconds": 600.0, "write_through": False,
         "capacity": 1000, "max_bytes": 1_000_000_000},
        {"name": "ssd", "plugin": "disk", "eviction_policy": "lfu", "ttl_seconds": 600.0, "write_through": False,
         "path": str(tmp_path / "ssd"), "max_bytes": 1_000_000, "persistent": False, "compression_level": 3,
         "write_queue": 256, "writer_nice": 10},
        {"name": "archive", "plugin": "disk", "eviction_policy": "lru", "ttl_seconds": 0.0, "write_through": True,
         "path": str(tmp_path / "archive"), "max_bytes": 10 * 1024**3, "persistent": True, "compression_level": 19,
         "write_queue": 256, "writer_nice": 10},
    ]  # fmt: skip
    ram = shown[0]
    assert ram["capacity"]["source"] == f"config file {path}"
    assert ram["max_bytes"]["source"] == "default"
    assert ram["eviction_policy"]["source"] == f"config file {path}, via kv_cache.eviction_policy"
    text = run("config", "show", "--config", str(path)).stdout
    assert text.count("[[kv_cache.tiers]]") == 3
    assert 'name              = "archive"' in text


def test_unknown_tier_plugin_or_policy_suggests_a_name(toml_file):
    path = toml_file('[[kv_cache.tiers]]\nname = "l2"\nplugin = "memroy"\n')
    message = error_of(path)
    assert f"kv_cache.tiers[0].plugin = 'memroy' (from config file {path})" in message
    assert "unknown cache tier 'memroy'; available: disk, memory, redis; did you mean 'memory'?" in message
    path = toml_file('[[kv_cache.tiers]]\nname = "l2"\nplugin = "memory"\neviction_policy = "lruu"\n', "policy.toml")
    message = error_of(path)
    assert f"kv_cache.tiers[0].eviction_policy = 'lruu' (from config file {path})" in message
    assert "did you mean 'lru'?" in message


def test_a_tier_plugin_validates_its_own_keys(toml_file):
    path = toml_file('[[kv_cache.tiers]]\nname = "ram"\nplugin = "memory"\ncapacity = -1\n')
    assert f"kv_cache.tiers[0].capacity = -1 (from config file {path})" in error_of(path)
    path = toml_file('[[kv_cache.tiers]]\nname = "ram"\nplugin = "memory"\ncapasity = 5\n', "typo.toml")
    message = error_of(path)
    assert f"unknown key kv_cache.tiers[0].capasity in config file {path}" in message
    keys = "name, plugin, eviction_policy, ttl_seconds, write_through, capacity, max_bytes"
    assert f"keys of a 'memory' tier: {keys}" in message
    assert "did you mean 'capacity'?" in message
    path = toml_file('[[kv_cache.tiers]]\nname = "l3"\nplugin = "disk"\n', "nopath.toml")
    assert f"kv_cache.tiers[0].path (from config file {path}): Field required" in error_of(path)


def test_tier_names_are_unique_and_l1_all_are_reserved(toml_file):
    path = toml_file('[[kv_cache.tiers]]\nname = "L1"\nplugin = "memory"\n')
    message = error_of(path)
    assert f"kv_cache.tiers[0].name = 'L1' (from config file {path})" in message and "reserved" in message
    path = toml_file('[[kv_cache.tiers]]\nname = "a"\nplugin = "memory"\n' * 2, "twice.toml")
    message = error_of(path)
    assert "kv_cache.tiers" in message and str(path) in message and "'a' is used twice" in message


def test_the_shorthands_build_the_same_list(toml_file):
    # the production preset as it was written before [[kv_cache.tiers]]: flat [kv_cache] keys
    flat = toml_file(
        """
        [kv_cache]
        l2_capacity = 100000
        max_memory_bytes = 8000000000
        eviction_policy = "Adaptive"
        persistence = true
        disk_path = "~/.cache/tierserve/kv"
        max_disk_bytes = 10000000000
        """,
        "flat.toml",
    )
    explicit = toml_file(
        """
        [kv_cache]
        eviction_policy = "adaptive"
        [[kv_cache.tiers]]
        name = "l2"
        plugin = "memory"
        capacity = 100000
        max_bytes = 8000000000
        [[kv_cache.tiers]]
        name = "l3"
        plugin = "disk"
        path = "~/.cache/tierserve/kv"
        max_bytes = 10000000000
        persistent = true
        write_through = true
        """
    )
    from_flat = load_settings(None, config_file=flat, environ={})
    assert tables(from_flat) == tables(load_settings(None, config_file=explicit, environ={}))
    assert tables(from_flat) == tables(load_settings("production", environ={}))
    assert from_flat.source_of("kv_cache.tiers[1]", "persistent").endswith(", as kv_cache.persistence")
    assert [t["name"] for t in tables(load_settings("development", environ={}))] == ["l2"]
    original = load_settings(None, config_file=toml_file(ORIGINAL_DESIGN_TOML, "design.toml"), environ={})
    assert tables(original) == [
        {"name": "l2", "plugin": "memory", "eviction_policy": "adaptive", "ttl_seconds": 3600.0,
         "write_through": False, "capacity": 50000, "max_bytes": 1_000_000_000},
    ]  # fmt: skip
    no_l2 = load_settings(None, environ={}, overrides={("kv_cache", "l2_capacity"): 0, ("kv_cache", "disk_path"): "/x"})
    assert [t["name"] for t in tables(no_l2)] == ["l3"]


def test_flat_keys_that_are_not_shorthands_are_refused_with_the_entry_to_write(tmp_path):
    environ = {"TIERSERVE_KV_CACHE__L3_WRITER_NICE": "5"}
    with pytest.raises(ConfigError) as info:
        load_settings("production", environ=environ)
    message = str(info.value)
    assert message.startswith(
        "kv_cache.l3_writer_nice = '5' (from environment variable TIERSERVE_KV_CACHE__L3_WRITER_NICE) "
        "is no longer a [kv_cache] key: writer_nice is a key of the l3 tier's [[kv_cache.tiers]] entry; write"
    )
    assert '    [[kv_cache.tiers]]\n    name = "l3"\n    plugin = "disk"\n    path = "~/.cache/tierserve/kv"' in message
    assert "    writer_nice = 5\n" in message
    # what the message says to write loads, with the value where the flat key used to put it
    [inline] = [line for line in message.splitlines() if "the whole list: kv_cache.tiers = " in line]
    written = inline.split("kv_cache.tiers = ", 1)[1][:-1]
    loaded = load_settings("production", environ={}, overrides={("kv_cache", "tiers"): parse_override(f"a.b={written}")[2]})
    assert loaded.settings.kv_cache.tiers[1].options_as(DiskTierSettings).writer_nice == 5
    with pytest.raises(ConfigError, match=r"kv_cache.l3_tier = 'memory' \(from command line\) is no longer"):
        load_settings("production", environ={}, overrides={("kv_cache", "l3_tier"): "memory"})


def test_a_tier_list_and_shorthands_combine(toml_file, tmp_path):
    path = toml_file(f'[kv_cache]\ndisk_path = "{tmp_path}"\n[[kv_cache.tiers]]\nname = "ram"\nplugin = "memory"\n')
    loaded = load_settings(None, config_file=path, environ={})
    assert [(t["name"], t["plugin"]) for t in tables(loaded)] == [("ram", "memory"), ("l3", "disk")]
    assert loaded.source_of("kv_cache.tiers[1]", "path") == f"config file {path}, as kv_cache.disk_path"
    tiers_file = toml_file('[[kv_cache.tiers]]\nname = "ram"\nplugin = "memory"\n', "tiers.toml")
    loaded = load_settings(None, config_file=tiers_file, environ={"TIERSERVE_KV_CACHE__L2_CAPACITY": "7"})
    assert tables(loaded)[0]["capacity"] == 7
    assert [str(landing) for landing in loaded.shorthands] == [
        "kv_cache.l2_capacity = 7 (environment variable TIERSERVE_KV_CACHE__L2_CAPACITY) -> kv_cache.tiers[0].capacity"
    ]
    # a list set after a preset's flat keys replaces them, and config show says they are not used
    flat_preset = toml_file(f'[kv_cache]\ndisk_path = "{tmp_path}"\nl2_capacity = 9\n', "flat.toml")
    loaded = load_settings(str(flat_preset), config_file=tiers_file, environ={})
    assert [t["name"] for t in tables(loaded)] == ["ram"] and tables(loaded)[0]["capacity"] == 50000
    assert loaded.source_of("kv_cache", "disk_path").endswith("; not used: kv_cache.tiers replaces it")
    shown = run("config", "show", "--preset", str(flat_preset), "--config", str(tiers_file), "--set", "kv_cache.max_memory_bytes=0")
    assert shown.returncode == 0, shown.stderr
    assert f"kv_cache.disk_path = \"{tmp_path}\" (preset {flat_preset} ({flat_preset})) -> not used: kv_cache.tiers " in shown.stdout
    assert "kv_cache.max_memory_bytes = 0 (command line) -> removes the list's memory tier" in shown.stdout
    assert "# [[kv_cache.tiers]]: none" in shown.stdout


def test_tiers_from_environment_and_command_line(tmp_path):
    tiers = [{"name": "ram", "plugin": "memory", "capacity": 9}]
    loaded = load_settings(None, environ={"TIERSERVE_KV_CACHE__TIERS": json.dumps(tiers)})
    assert loaded.settings.kv_cache.tiers[0].options == MemoryTierSettings(capacity=9)
    assert loaded.source_of("kv_cache.tiers[0]", "capacity") == "environment variable TIERSERVE_KV_CACHE__TIERS"
    assignment = f'kv_cache.tiers=[{{name="d", plugin="disk", path="{tmp_path}"}}]'
    result = run("config", "show", "--json", "--preset", "production", "--set", assignment)
    assert result.returncode == 0, result.stderr
    [disk] = json.loads(result.stdout)["kv_cache.tiers"]
    assert disk["path"] == {"value": str(tmp_path), "source": "command line"}


def test_settings_built_directly_resolve_tiers_on_access():
    settings = Settings(kv_cache={"ttl_seconds": 5, "tiers": [{"name": "RAM", "plugin": "memory", "capacity": 3}]})
    [tier] = settings.kv_cache.tiers
    assert (tier.name, tier.eviction_policy, tier.ttl_seconds) == ("ram", "adaptive", 5)
    assert tier.options_as(MemoryTierSettings) == MemoryTierSettings(capacity=3)
    [disk] = Settings(kv_cache={"l2_capacity": 0, "disk_path": "/d", "persistence": True}).kv_cache.tiers
    assert (disk.name, disk.write_through) == ("l3", True)
    assert disk.options_as(DiskTierSettings) == DiskTierSettings(path="/d", persistent=True)
    tiers = [{"name": "l3", "plugin": "disk", "path": "/d", "writer_nice": 4}]
    [disk] = Settings(kv_cache={"tiers": tiers}).kv_cache.tiers
    assert disk.options_as(DiskTierSettings).writer_nice == 4
    [bad] = Settings(kv_cache={"tiers": [{"name": "ram", "plugin": "memory", "capacity": -2}]}).kv_cache.tiers
    with pytest.raises(ConfigError, match=r"kv_cache.tiers\[ram\].capacity = -2"):
        bad.options_as(MemoryTierSettings)


def test_engine_builds_the_tiers_of_the_list(tmp_path, toml_file):
    model = build_checkpoint(tmp_path, "m", "llama")
    path = toml_file(
        f"""
        [model]
        path = "{model}"
        device = "cpu"
        [kv_cache]
        block_size = 4
        l1_capacity = 64
        [[kv_cache.tiers]]
        name = "ram"
        plugin = "memory"
        capacity = 7
        [[kv_cache.tiers]]
        name = "ssd"
        plugin = "disk"
        path = "{tmp_path / 'ssd'}"
        persistent = true
        write_through = true
        """
    )
    loaded = load_settings(None, config_file=path, environ={})
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
    try:
        assert engine.info.tier_names == ("l1", "ram", "ssd")
        engine.generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        engine.flush_cache()
        stats = engine.stats().cache.tiers
        assert list(stats) == ["l1", "ram", "ssd"]
        assert stats["ssd"].entries >= 9  # every full block written through to the persistent tier
        engine.offload_cache()  # the 9 blocks go down to "ram", which holds 7 entries
        assert engine.stats().cache.tiers["ram"].entries == 7
    finally:
        engine.close()
    assert any((tmp_path / "ssd").iterdir())
