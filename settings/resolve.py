"""After the plugins load: component names, tier entries and plugin tables checked against what they registered.

Every error names the full key, the value, its source and the reason, e.g.
``kv_cache.tiers[1].plugin = 'dsik' (from config file x.toml): unknown cache tier 'dsik'; ...; did you mean 'disk'?``
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from tierserve.models.backend_choice import AUTO
from tierserve.core.errors import ConfigError, UnknownComponentError
from tierserve.settings.merge import Merged
from tierserve.core.plugins import PluginManager
from tierserve.core.registry import Component
from tierserve.core.sections import Settings
from tierserve.core.tables import DEFAULT_SOURCE, validate_table
from tierserve.core.tier_settings import FLAT_TIER_KEYS, TIER_KEYS, Landing, apply_shorthands

# (section, key) -> registry kind whose names the value must be
COMPONENT_KEYS: dict[tuple[str, str], str] = {
    ("model", "backend"): "backends",
    ("scheduler", "name"): "schedulers",
    ("kv_cache", "eviction_policy"): "eviction_policies",
    ("speculative", "method"): "speculators",
}
INHERITED_TIER_KEYS = ("eviction_policy", "ttl_seconds")  # from [kv_cache] unless the entry sets them


class NoSettings(BaseModel):
    """The settings of a tier plugin that registered no model: no keys of its own."""

    model_config = ConfigDict(extra="forbid")


def _component(plugins: PluginManager, kind: str, name: str, key: str, source: str) -> Component:
    try:
        return plugins.registry(kind).get(name)
    except UnknownComponentError as exc:
        raise ConfigError(f"{key} = {name!r} (from {source}): {exc}") from None


def check_components(settings: Settings, plugins: PluginManager, sources: Mapping[tuple[str, str], str]) -> None:
    """Fail on a component name no plugin registered; store names in canonical (lower) case."""
    for (section, key), kind in COMPONENT_KEYS.items():
        value = getattr(getattr(settings, section), key)
        if value is None or ((section, key) == ("model", "backend") and value.lower() == AUTO):
            continue
        where = sources.get((section, key), DEFAULT_SOURCE)
        component = _component(plugins, kind, value, f"{section}.{key}", where)
        setattr(getattr(settings, section), key, component.name)


def check_model_keys(merged: Merged) -> None:
    """``[[models]]`` replaces ``[model]``: its keys from earlier layers (a preset's) are marked unused;
    set in the same layer or a later one (``--model``), they contradict it."""
    models_key = ("models", "")
    if models_key not in merged.sources:
        return
    for (section, key), source in list(merged.sources.items()):
        if section != "model":
            continue
        if merged.ranks[(section, key)] >= merged.ranks[models_key]:
            raise ConfigError(
                f"model.{key} (from {source}) and [[models]] (from {merged.sources[models_key]}) both describe "
                f"the served model; with [[models]], give each entry its own {key}"
            )
        merged.sources[(section, key)] += "; not used: [[models]] replaces [model]"


def fold_shorthands(merged: Merged) -> list[Landing]:
    """Write the ``[kv_cache]`` shorthands into ``kv_cache.tiers`` (``tier_settings.apply_shorthands``) and
    record the source of every entry's keys as ``("kv_cache.tiers[i]", key)``.

    A shorthand set before the layer that set the list (a preset's, under a file's list) is
    replaced by it, as any earlier value is; set in that layer or a later one, it sets the list's tier.
    """
    kv = merged.values.setdefault("kv_cache", {})
    tiers_key = ("kv_cache", "tiers")
    replaced = []
    for key in sorted(FLAT_TIER_KEYS & kv.keys()):
        if tiers_key in merged.sources and merged.ranks[("kv_cache", key)] < merged.ranks[tiers_key]:
            how = f"not used: kv_cache.tiers (from {merged.sources[tiers_key]}) replaces it"
            replaced.append(Landing(key, kv.pop(key), merged.sources[("kv_cache", key)], how))
            merged.sources[("kv_cache", key)] += "; not used: kv_cache.tiers replaces it"
    folded = apply_shorthands(kv, lambda key: merged.sources.get(("kv_cache", key), DEFAULT_SOURCE))
    merged.values["kv_cache"] = folded.table
    for index, keys in enumerate(folded.sources):
        for key, source in keys.items():
            merged.sources[(f"kv_cache.tiers[{index}]", key)] = source
    return replaced + folded.landings


def _tier_source(merged: Merged, path: str, raw: Mapping[str, Any], key: str) -> str:
    """Where one key of a tier entry came from: the list (or a shorthand), else ``[kv_cache]``, else the default."""
    if key in raw and not (key == "eviction_policy" and raw[key] is None):
        return merged.sources.get((path, key), DEFAULT_SOURCE)
    if key in INHERITED_TIER_KEYS:
        return f"{merged.sources.get(('kv_cache', key), DEFAULT_SOURCE)}, via kv_cache.{key}"
    return DEFAULT_SOURCE


def resolve_tiers(settings: Settings, plugins: PluginManager, merged: Merged) -> None:
    """Check each tier's plugin and policy names and validate its own keys by the model its
    plugin registered; record the source of every key as ``("kv_cache.tiers[i]", key)``."""
    kv = settings.kv_cache
    raw_entries = merged.values["kv_cache"]["tiers"]
    resolved = []
    for index, tier in enumerate(kv.tiers):
        path = f"kv_cache.tiers[{index}]"
        raw = raw_entries[index]

        def source_of(key: str, path: str = path, raw: Mapping[str, Any] = raw) -> str:
            return _tier_source(merged, path, raw, key)

        component = _component(plugins, "cache_tiers", tier.plugin, f"{path}.plugin", source_of("plugin"))
        policy = _component(
            plugins, "eviction_policies", tier.eviction_policy, f"{path}.eviction_policy", source_of("eviction_policy")
        )
        server_evicts = bool(component.metadata.get("server_evicts"))
        if server_evicts:
            _refuse_own_eviction(raw, path, component.name)
        options = validate_table(
            component.settings or NoSettings, tier.options.model_dump(), path, source_of,
            owner=f"a {component.name!r} tier", extra_keys=TIER_KEYS,
        )  # fmt: skip
        update = {"plugin": component.name, "eviction_policy": policy.name, "options": options}
        shared = bool(getattr(component.factory, "shared", False))
        if tier.write_through is None:  # a shared tier publishes every computed block unless told not to
            update["write_through"] = shared
        entry = tier.model_copy(update=update)
        resolved.append(entry)
        for key in entry.as_table():
            merged.sources[(path, key)] = source_of(key)
        if tier.write_through is None:
            merged.sources[(path, "write_through")] = f"default ({'a shared' if shared else 'not a shared'} tier)"
        if server_evicts:
            merged.sources[(path, "eviction_policy")] += "; not used: the server evicts"
    kv.tiers = resolved


def _refuse_own_eviction(raw: Mapping[str, Any], path: str, plugin: str) -> None:
    """A tier whose server evicts by itself (a remote tier) takes no ``eviction_policy`` in its entry."""
    if raw.get("eviction_policy") is not None:
        raise ConfigError(
            f"{path}.eviction_policy: a {plugin!r} tier's server evicts by its own policy (for Redis, "
            f"maxmemory-policy = allkeys-lru); remove eviction_policy from this entry"
        )


def resolve_plugin_tables(settings: Settings, plugins: PluginManager, sources: Mapping[tuple[str, str], str]) -> None:
    """Validate every ``[plugins.NAME]`` table (defaults too) by its component's model; keep the results
    on ``settings`` for ``Settings.plugin_options``."""
    for name, component in plugins.settings_components().items():
        section = f"plugins.{name}"
        options = validate_table(
            component.settings,
            settings.plugins.table(name),
            section,
            lambda key, section=section: sources.get((section, key), DEFAULT_SOURCE),
        )
        settings.set_plugin_options(name, options)
