"""What the engine consumes from representative settings: both presets, the serving spec's own TOML, tier lists.

``python -m tests.effective_settings > tests/data/preset_effective_settings.json``
writes the fixture that ``test_effective_settings`` compares against; it was
written before the flat ``[kv_cache]`` tier keys became shorthands of
``[[kv_cache.tiers]]``, so the presets' rewrite into the tier-list form is
checked against what the flat form resolved to.
"""

from __future__ import annotations

import json
import sys
import tempfile
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierserve.settings.config import LoadedSettings, load_settings
from tests.test_config import ORIGINAL_DESIGN_TOML

# flat [kv_cache] tier keys: inputs that build the tier list, not settings the engine reads
FLAT_TIER_KEYS = frozenset({
    "l2_capacity", "max_memory_bytes", "l2_tier", "l3_tier", "l2_eviction_policy", "l3_eviction_policy",
    "disk_path", "max_disk_bytes", "persistence", "compression_level", "l3_write_queue", "l3_writer_nice",
})  # fmt: skip

TIER_LIST_TOML = """
[kv_cache]
eviction_policy = "lfu"

[[kv_cache.tiers]]
name = "ram"
plugin = "memory"
capacity = 1000

[[kv_cache.tiers]]
name = "ssd"
plugin = "disk"
path = "/srv/tierserve/ssd"
persistent = true
write_through = true
ttl_seconds = 0
"""

# name -> (preset, TOML layered over it as --config, --set overrides)
CASES: dict[str, tuple[str | None, str | None, dict[tuple[str, str], Any]]] = {
    "defaults": (None, None, {}),
    "development": ("development", None, {}),
    "production": ("production", None, {}),
    "spec example": (None, ORIGINAL_DESIGN_TOML, {}),
    "production + spec example": ("production", ORIGINAL_DESIGN_TOML, {}),
    "tier list": (None, TIER_LIST_TOML, {}),
    "production + tier list": ("production", TIER_LIST_TOML, {}),
    "development + disk tier by flat keys": (
        "development", None,
        {("kv_cache", "disk_path"): "/srv/tierserve/l3", ("kv_cache", "persistence"): True,
         ("kv_cache", "max_disk_bytes"): 123456789},
    ),  # fmt: skip
    "development without L2": ("development", None, {("kv_cache", "l2_capacity"): 0}),
    "production without L2": ("production", None, {("kv_cache", "max_memory_bytes"): 0}),
}


def _home_as_tilde(value: Any) -> Any:
    home = str(Path.home())
    if isinstance(value, str):
        return "~" + value[len(home) :] if value == home or value.startswith(home + "/") else value
    if isinstance(value, Mapping):
        return {key: _home_as_tilde(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_home_as_tilde(item) for item in value]
    return value


def effective(loaded: LoadedSettings) -> dict[str, Any]:
    """Every section as validated, the resolved tier list, and each component's resolved own settings."""
    settings = loaded.settings
    out: dict[str, Any] = {}
    for section, values in settings.model_dump(mode="json").items():
        if section == "kv_cache":
            values = {key: value for key, value in values.items() if key not in FLAT_TIER_KEYS and key != "tiers"}
            out["kv_cache.tiers"] = [tier.as_table() for tier in settings.kv_cache.tiers]
        if section == "plugins":
            values = {"enabled": values["enabled"]}
        out[section] = values
    for name, component in sorted(loaded.plugins.settings_components().items()):
        out[f"plugins.{name}"] = settings.plugin_options(name, component.settings).model_dump(mode="json")
    return _home_as_tilde(out)


def load_case(name: str, folder: Path) -> LoadedSettings:
    """The settings of ``CASES[name]``, its TOML written into ``folder``."""
    preset, toml, overrides = CASES[name]
    config_file = None
    if toml is not None:
        config_file = folder / "config.toml"
        config_file.write_text(textwrap.dedent(toml))
    return load_settings(preset, config_file=config_file, environ={}, overrides=overrides)


def snapshot() -> dict[str, Any]:
    """``{case name: effective settings}`` for every case."""
    with tempfile.TemporaryDirectory() as folder:
        return {name: effective(load_case(name, Path(folder))) for name in CASES}


if __name__ == "__main__":
    json.dump(snapshot(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
