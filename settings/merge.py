"""Layers merged into one set of raw settings values, remembering the source of every key.

Later layers win key by key. Unknown sections, keys and plugin tables fail
here, naming the layer. An old key name that a plugin keeps as an alias (e.g.
``speculative.ngram_min``) lands on its new key (``plugins.ngram.min_n``) and
its source says so: ``config file x.toml, as speculative.ngram_min``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tierserve.core.errors import ConfigError
from tierserve.settings.layers import Layer
from tierserve.core.sections import Settings
from tierserve.core.tables import model_keys, suggest, unknown_key
from tierserve.core.tier_settings import FLAT_TIER_KEYS, SHORTHANDS

# old core key names that keep working: "section.key" -> (section, key) where the setting lives now
CORE_ALIASES: dict[str, tuple[str, str]] = {"server.served_model_name": ("model", "served_model_name")}


@dataclass
class Merged:
    """Raw values ready for ``Settings(**values)``, and where each came from.

    Attributes:
        values: ``{section: {key: value}}``; plugin tables under ``values["plugins"][name]``.
        sources: ``(section, key) -> label``; a plugin table's section is ``plugins.NAME``.
        ranks: ``(section, key) -> Layer.rank`` of the layer that set it.
    """

    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    sources: dict[tuple[str, str], str] = field(default_factory=dict)
    ranks: dict[tuple[str, str], int] = field(default_factory=dict)
    _spelled: dict[tuple[str, str, str], tuple[str, str]] = field(default_factory=dict)

    def put(self, section: str, key: str, value: Any, layer: Layer, written: str) -> None:
        """Set one key; ``written`` is how the layer named it (an alias, or ``section.key``)."""
        claim = (layer.group, section, key)
        earlier = self._spelled.get(claim)
        if earlier is not None and earlier[0] != written:
            raise ConfigError(
                f"{earlier[0]} (from {earlier[1]}) and {written} (from {layer.label}) are one setting, "
                f"{section}.{key}; set only {section}.{key}"
            )
        self._spelled[claim] = (written, layer.label)
        table = self.values
        for part in section.split("."):
            table = table.setdefault(part, {})
        table[key] = value
        canonical = written == f"{section}.{key}"
        self.sources[(section, key)] = layer.label if canonical else f"{layer.label}, as {written}"
        self.ranks[(section, key)] = layer.rank


def merge_layers(
    layers: list[Layer],
    tables: Mapping[str, type[BaseModel]],
    aliases: Mapping[str, tuple[str, str]],
    tier_plugins: Collection[str] = (),
) -> Merged:
    """Merge ``layers`` in order.

    Args:
        layers: from ``layers.read_layers``.
        tables: ``[plugins.NAME]`` tables the loaded plugins declare: name -> settings model.
        aliases: ``"section.key"`` -> ``(component name, key of its table)``.
        tier_plugins: cache tier names, for a hint when one is used as a plugin table.

    Raises:
        ConfigError: an unknown section, key or table, a section that is not a
            table, or an alias and its new key set in one layer.
    """
    merged = Merged()
    sections = Settings.model_fields
    for layer in layers:
        for section, table in layer.values.items():
            if section not in sections:
                raise ConfigError(
                    f"unknown section [{section}] in {layer.label}; available sections: "
                    f"{', '.join(sections)}{suggest(section, sections)}"
                )
            if section == "models":  # [[models]]: a later layer's list replaces an earlier one's
                if not isinstance(table, list) or not all(isinstance(entry, Mapping) for entry in table):
                    raise ConfigError(f"models in {layer.label} must be [[models]] tables, got {table!r}")
                merged.values["models"] = [dict(entry) for entry in table]  # type: ignore[assignment]
                merged.sources[("models", "")] = layer.label
                merged.ranks[("models", "")] = layer.rank
                continue
            if not isinstance(table, Mapping):
                raise ConfigError(f"[{section}] in {layer.label} must be a table of keys, got {table!r}")
            keys = model_keys(sections[section].annotation)
            for key, value in table.items():
                written = f"{section}.{key}"
                if key in keys or (section == "kv_cache" and key in FLAT_TIER_KEYS):
                    merged.put(section, key, value, layer, written)
                elif written in CORE_ALIASES:
                    merged.put(*CORE_ALIASES[written], value, layer, written)
                elif section == "plugins":
                    _merge_plugin_table(merged, key, value, layer, tables, tier_plugins)
                elif written in aliases:
                    name, target = aliases[written]
                    merged.put(f"plugins.{name}", target, value, layer, written)
                else:
                    old = [alias.split(".", 1)[1] for alias in aliases if alias.startswith(f"{section}.")]
                    shorthands = list(SHORTHANDS) if section == "kv_cache" else []
                    raise unknown_key(written, layer.label, f"[{section}]", keys + shorthands + sorted(old))
    return merged


def _merge_plugin_table(
    merged: Merged,
    written: str,
    table: Any,
    layer: Layer,
    tables: Mapping[str, type[BaseModel]],
    tier_plugins: Collection[str],
) -> None:
    name = written.strip().lower()
    if name not in tables:
        hint = ""
        if name in tier_plugins:
            hint = f"; a cache tier's keys go in its [[kv_cache.tiers]] entry (plugin = {name!r})"
        raise ConfigError(
            f"unknown plugin table [plugins.{written}] in {layer.label}; components with settings: "
            f"{', '.join(sorted(tables)) or '(none)'}{suggest(name, tables)}{hint}"
        )
    if not isinstance(table, Mapping):
        raise ConfigError(
            f"plugins.{written} in {layer.label} must be a table of keys ([plugins.{name}]), got {table!r}"
        )
    keys = model_keys(tables[name])
    for key, value in table.items():
        if key not in keys:
            raise unknown_key(f"plugins.{name}.{key}", layer.label, f"[plugins.{name}]", keys)
        merged.put(f"plugins.{name}", key, value, layer, f"plugins.{name}.{key}")
