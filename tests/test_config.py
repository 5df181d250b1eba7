"""Settings: presets, layering, provenance, and errors that name key, value and source."""

from __future__ import annotations


import pytest

from tierserve.settings.config import load_settings, preset_names
from tierserve.core.errors import ConfigError

pytestmark = pytest.mark.unit

# The original design's keys, exactly as DESIGN.md shows them.
ORIGINAL_DESIGN_TOML = """
[kv_cache]
l1_capacity = 5000
l2_capacity = 50000
max_memory_bytes = 1000000000
eviction_policy = "Adaptive"      # case-insensitive registry name
ttl_seconds = 3600
[speculative]
beam_width = 6
temperature = 0.8
top_k = 40
top_p = 0.9
[sliding_window]
window_size = 512
window_overlap = 64
use_flash_attention = true
[monitoring]
enabled = true
collection_interval_seconds = 30
detailed_profiling = true
"""


def test_original_design_keys_load_unchanged(toml_file):
    path = toml_file(ORIGINAL_DESIGN_TOML)
    loaded = load_settings(preset=None, config_file=path, environ={})
    s = loaded.settings
    [l2] = s.kv_cache.tiers  # l2_capacity and max_memory_bytes set the memory tier
    assert (s.kv_cache.l1_capacity, l2.options.capacity, l2.options.max_bytes) == (5000, 50000, 10**9)
    assert loaded.source_of("kv_cache.tiers[0]", "capacity") == f"config file {path}, as kv_cache.l2_capacity"
    assert s.kv_cache.eviction_policy == "adaptive"
    assert s.kv_cache.ttl_seconds == 3600
    assert (s.speculative.beam_width, s.speculative.temperature, s.speculative.top_k, s.speculative.top_p) == (
        6,
        0.8,
        40,
        0.9,
    )
    assert (s.sliding_window.window_size, s.sliding_window.window_overlap) == (512, 64)
    assert s.sliding_window.use_flash_attention is True
    assert s.monitoring.detailed_profiling is True
    assert loaded.source_of("kv_cache", "l1_capacity") == f"config file {path}"
    assert loaded.source_of("server", "port") == "default"


def test_presets_ship_and_differ():
    assert {"development", "production"} <= set(preset_names())
    dev = load_settings("development", environ={}).settings
    prod = load_settings("production", environ={}).settings
    assert prod.kv_cache.l1_capacity > dev.kv_cache.l1_capacity
    [prod_l2, prod_l3], [dev_l2] = prod.kv_cache.tiers, dev.kv_cache.tiers
    assert prod_l2.options.capacity > dev_l2.options.capacity
    assert (prod_l3.plugin, prod_l3.options.persistent, prod_l3.write_through) == ("disk", True, True)
    assert dev_l2.plugin == "memory"  # no disk tier: nothing persists
    assert prod.logging.format == "json" and dev.logging.format == "console"
    assert dev.model.path == "builtin:tiny"
    assert prod.monitoring.enabled


def test_unknown_policy_lists_available_names_and_suggests(toml_file):
    path = toml_file('[kv_cache]\neviction_policy = "lru2"\n')
    with pytest.raises(ConfigError) as info:
        load_settings("development", config_file=path, environ={})
    message = str(info.value)
    assert "kv_cache.eviction_policy" in message
    assert "'lru2'" in message
    assert str(path) in message
    assert "available: adaptive, clock, lfu, lru" in message
    assert "did you mean 'lru'?" in message


def test_wrong_type_names_key_value_and_file(toml_file):
    path = toml_file('[kv_cache]\nl1_capacity = "lots"\n')
    with pytest.raises(ConfigError) as info:
        load_settings("development", config_file=path, environ={})
    message = str(info.value)
    assert "kv_cache.l1_capacity = 'lots'" in message
    assert f"config file {path}" in message
    assert "integer" in message


def test_unknown_key_is_named_with_file_and_suggestion(toml_file):
    path = toml_file("[kv_cache]\nl1_capacty = 10\n")
    with pytest.raises(ConfigError) as info:
        load_settings("development", config_file=path, environ={})
    assert "unknown key kv_cache.l1_capacty" in str(info.value)
    assert str(path) in str(info.value)
    assert "did you mean 'l1_capacity'?" in str(info.value)


def test_unknown_section_and_bad_toml(toml_file):
    with pytest.raises(ConfigError, match=r"unknown section \[kv_cach\].*did you mean 'kv_cache'"):
        load_settings(None, config_file=toml_file("[kv_cach]\nblock_size = 8\n"), environ={})
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_settings(None, config_file=toml_file("[kv_cache\n"), environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(None, config_file="/nonexistent/tierserve.toml", environ={})


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="unknown preset 'prod'.*development.*production.*did you mean 'production'"):
        load_settings("prod", environ={})


def test_cross_field_rule_names_section_and_source(toml_file):
    path = toml_file("[sliding_window]\nwindow_size = 64\nwindow_overlap = 64\n")
    with pytest.raises(ConfigError) as info:
        load_settings(None, config_file=path, environ={})
    assert "[sliding_window]" in str(info.value)
    assert str(path) in str(info.value)
    assert "window_overlap (64) must be smaller than window_size (64)" in str(info.value)


def test_sources_layer_in_order_preset_file_env_cli(toml_file):
    path = toml_file("[kv_cache]\nl1_capacity = 111\nl2_capacity = 222\nblock_size = 8\n")
    environ = {"TIERSERVE_KV_CACHE__L2_CAPACITY": "333", "TIERSERVE_KV_CACHE__BLOCK_SIZE": "32"}
    loaded = load_settings(
        "production", config_file=path, environ=environ, overrides={("kv_cache", "block_size"): 64}
    )
    s = loaded.settings.kv_cache
    l2 = s.tiers[0].options
    assert (s.l1_capacity, l2.capacity, s.block_size) == (111, 333, 64)
    assert l2.max_bytes == 8_000_000_000  # from the preset
    assert loaded.source_of("kv_cache.tiers[0]", "max_bytes").startswith("preset production")
    assert loaded.source_of("kv_cache", "l1_capacity") == f"config file {path}"
    assert loaded.source_of("kv_cache", "l2_capacity") == "environment variable TIERSERVE_KV_CACHE__L2_CAPACITY"
    assert loaded.source_of("kv_cache.tiers[0]", "capacity") == (
        "environment variable TIERSERVE_KV_CACHE__L2_CAPACITY, as kv_cache.l2_capacity"
    )
    assert loaded.source_of("kv_cache", "block_size") == "command line"


def test_environment_errors_name_the_variable():
    with pytest.raises(ConfigError, match="TIERSERVE_SERVER__PORT"):
        load_settings(None, environ={"TIERSERVE_SERVER__PORT": "99999"})
    with pytest.raises(ConfigError, match="unknown key server.prot in environment variable TIERSERVE_SERVER__PROT"):
        load_settings(None, environ={"TIERSERVE_SERVER__PROT": "1"})
    with pytest.raises(ConfigError, match=r"unknown section \[kv_cach\] in environment variable TIERSERVE_KV_CACH__X.*'kv_cache'"):
        load_settings(None, environ={"TIERSERVE_KV_CACH__X": "1"})
    message = "environment variable TIERSERVE_AUTH__API_KEYS: invalid JSON value 'k1'; write a list or table as JSON"
    with pytest.raises(ConfigError, match=message):
        load_settings(None, environ={"TIERSERVE_AUTH__API_KEYS": "k1"})
    loaded = load_settings(None, environ={"TIERSERVE_AUTH__API_KEYS": '["k1"]', "TIERSERVE_PLUGINS": "ngram"})
    assert loaded.settings.auth.api_keys == ["k1"]  # TIERSERVE_PLUGINS is the allowlist, not the [plugins] table
    loaded = load_settings(None, environ={"TIERSERVE_AUTH__API_KEYS": '["k1", "k2"]'})
    assert loaded.settings.auth.api_keys == ["k1", "k2"]


def test_plugin_allowlist_variable_is_not_a_settings_section(install_fake_plugin, toml_file):
    install_fake_plugin(
        "tierserve-mru",
        "tierserve_mru_config",
        """
        from tierserve.core import hookimpl
        from tierserve.plugins.eviction.lru import LRUPolicy
        @hookimpl
        def register_eviction_policies(register):
            register("mru", LRUPolicy)
        """,
    )
    path = toml_file('[kv_cache]\neviction_policy = "MRU"\n')
    assert load_settings(None, config_file=path, environ={}).settings.kv_cache.eviction_policy == "mru"
    with pytest.raises(ConfigError, match="unknown eviction policy 'MRU'"):
        load_settings(None, config_file=path, environ={"TIERSERVE_PLUGINS": ""})
    blocked = toml_file('[plugins]\nenabled = []\n[kv_cache]\neviction_policy = "mru"\n', "blocked.toml")
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        load_settings(None, config_file=blocked, environ={})
