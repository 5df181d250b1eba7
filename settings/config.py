"""Settings: load them from every source, validate them (plugins' own tables too), and say where each value came from.

Sources, later wins: the Settings defaults -> a preset (``configs/NAME.toml``)
-> ``--config FILE`` -> environment ``TIERSERVE_SECTION__KEY`` -> CLI flags.
Every error names the key, the bad value and the source it came from.

    layers.read_layers (pydantic-settings' TOML and env sources) ─► plugins load (allowlist)
        ─► merge.merge_layers (aliases, unknown keys) ─► resolve.fold_shorthands ([kv_cache] shorthands
        into [[kv_cache.tiers]]) ─► Settings(**values) ─► resolve: component names, tiers, [plugins.NAME]

The schema lives in ``sections`` (re-exported here), tier entries and shorthands in ``tier_settings``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from tierserve.core.errors import ConfigError
from tierserve.settings.layers import Layer, parse_override, preset_names, preset_path, read_layers, read_toml
from tierserve.settings.merge import Merged, merge_layers
from tierserve.core.plugins import ALLOWLIST_ENV, TIER_KIND, PluginManager, load_plugins, parse_allowlist
from tierserve.settings.resolve import (
    check_components,
    check_model_keys,
    fold_shorthands,
    resolve_plugin_tables,
    resolve_tiers,
)
from tierserve.settings.secrets import redact_auth
from tierserve.core.sections import (
    AuthSettings,
    KVCacheSettings,
    LoggingSettings,
    ModelSettings,
    MonitoringSettings,
    PluginSettings,
    SchedulerSettings,
    Section,
    ServerSettings,
    Settings,
    SlidingWindowSettings,
    SpeculativeSettings,
)
from tierserve.core.tables import DEFAULT_SOURCE, describe_errors
from tierserve.core.tier_settings import Landing, TierSettings

__all__ = [
    "AuthSettings",
    "ConfigError",
    "KVCacheSettings",
    "LoadedSettings",
    "LoggingSettings",
    "ModelSettings",
    "MonitoringSettings",
    "PluginSettings",
    "SchedulerSettings",
    "Section",
    "ServerSettings",
    "Settings",
    "SlidingWindowSettings",
    "SpeculativeSettings",
    "TierSettings",
    "load_settings",
    "parse_override",
    "preset_names",
    "preset_path",
    "read_toml",
]


@dataclass
class LoadedSettings:
    """Validated settings, the source of every value, and the plugins they were checked against.

    ``sources`` is keyed by ``(section, key)``; a plugin table's section is
    ``plugins.NAME``, a tier entry's ``kv_cache.tiers[i]``. ``shorthands`` says
    where each ``[kv_cache]`` shorthand given went in the tier list.
    """

    settings: Settings
    sources: dict[tuple[str, str], str]
    plugins: PluginManager
    layers: list[str] = field(default_factory=list)
    shorthands: list[Landing] = field(default_factory=list)

    def source_of(self, section: str, key: str) -> str:
        if section == "models":  # [[models]] comes whole from one layer
            return self.sources.get(("models", ""), DEFAULT_SOURCE)
        return self.sources.get((section, key), DEFAULT_SOURCE)

    def explain(self) -> dict[str, Any]:
        """Every setting as ``{"value": ..., "source": ...}``, by section.

        Sections are ``{key: item}``; ``kv_cache.tiers`` is a list of such
        tables, one per tier; each component that declares settings has its
        ``plugins.NAME`` section (defaults included). ``shorthands`` lists each
        ``[kv_cache]`` shorthand given: ``{"key", "value", "source", "landed"}``.
        """
        out: dict[str, Any] = {}
        for section, values in self.settings.model_dump(mode="json").items():
            if section == "models":
                out[section] = [self._items("models", entry) for entry in values]
                continue
            if section == "plugins":
                values = {"enabled": values["enabled"]}
            values.pop("tiers", None)
            if section == "auth":  # a settings dump never shows a key
                values = redact_auth(values)
            out[section] = self._items(section, values)
            if section == "kv_cache":
                out["kv_cache.tiers"] = [
                    self._items(f"kv_cache.tiers[{index}]", tier.as_table())
                    for index, tier in enumerate(self.settings.kv_cache.tiers)
                ]
                out["shorthands"] = [
                    {"key": f"kv_cache.{s.key}", "value": s.value, "source": s.source, "landed": s.landed}
                    for s in self.shorthands
                ]
            if section == "plugins":
                for name, component in sorted(self.plugins.settings_components().items()):
                    options = self.settings.plugin_options(name, component.settings)
                    out[f"plugins.{name}"] = self._items(f"plugins.{name}", options.model_dump(mode="json"))
        return out

    def _items(self, section: str, values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        return {key: {"value": value, "source": self.source_of(section, key)} for key, value in values.items()}


def _allowlist(layers: list[Layer], environ: Mapping[str, str]) -> frozenset[str] | list[str] | None:
    """``TIERSERVE_PLUGINS``, else the last ``[plugins] enabled``: needed before the rest can be checked."""
    if environ.get(ALLOWLIST_ENV) is not None:
        return parse_allowlist(environ[ALLOWLIST_ENV])
    enabled, label = None, None
    for layer in layers:
        table = layer.values.get("plugins")
        if isinstance(table, Mapping) and "enabled" in table:
            enabled, label = table["enabled"], layer.label
    try:
        return TypeAdapter(list[str] | None).validate_python(enabled)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"]
        raise ConfigError(f"invalid settings:\n  plugins.enabled = {enabled!r} (from {label}): {reason}") from None


def _validate(merged: Merged) -> Settings:
    try:
        return Settings(**merged.values)
    except ValidationError as exc:
        sources = merged.sources

        def source_of(loc: tuple[Any, ...]) -> str | None:
            if loc and loc[0] == "models":
                return sources.get(("models", ""))
            return sources.get((loc[0], loc[1])) if len(loc) > 1 else None

        def sources_within(loc: tuple[Any, ...]) -> list[str]:
            return sorted({src for (section, _), src in sources.items() if section == loc[0]}) if loc else []

        raise ConfigError(describe_errors(exc, merged.values, "", source_of, sources_within)) from None


def load_settings(
    preset: str | None = "development",
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[tuple[str, str], Any] | None = None,
    plugins: PluginManager | None = None,
    plugin_modules: Sequence[str] = (),
) -> LoadedSettings:
    """Resolve settings from all sources and validate them, components and plugin tables included.

    Args:
        preset: a shipped preset name (``development``, ``production``) or a
            path to a TOML file; ``None`` starts from the defaults alone.
        config_file: a TOML file layered over the preset.
        environ: environment to read ``TIERSERVE_*`` from (default ``os.environ``).
        overrides: ``(section, key) -> value`` from command-line flags; a plugin
            table's section is ``plugins.NAME`` (``("plugins.ngram", "max_n")``).
        plugins: the plugin manager to validate against; by default one is
            loaded with the allowlist these settings resolve to.
        plugin_modules: plugins under development to load beside the installed
            ones (``tierserve serve --plugin``): files, package folders or module names.

    Raises:
        ConfigError: naming the key, the bad value and its source.
    """
    environ = os.environ if environ is None else environ
    layers = read_layers(preset, config_file, environ, overrides)
    if plugins is None:
        plugins = load_plugins(allowlist=_allowlist(layers, environ), modules=plugin_modules)
        asked = [f for f in plugins.failures if f.source.startswith("--plugin ")]
        if asked:  # a plugin named on the command line that does not load is not one to serve without
            raise ConfigError("; ".join(f"{f.source}: {f.error}" for f in asked))
    merged = merge_layers(
        layers, {name: c.settings for name, c in plugins.settings_components().items()},
        plugins.aliases(), plugins.registry(TIER_KIND).names(),
    )  # fmt: skip
    shorthands = fold_shorthands(merged)
    check_model_keys(merged)
    settings = _validate(merged)
    check_components(settings, plugins, merged.sources)
    resolve_tiers(settings, plugins, merged)
    resolve_plugin_tables(settings, plugins, merged.sources)
    return LoadedSettings(settings, merged.sources, plugins, [layer.label for layer in layers], shorthands)
