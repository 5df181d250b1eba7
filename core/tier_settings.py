"""``[[kv_cache.tiers]]``: the ordered cache tiers below L1, and the legacy ``[kv_cache]`` keys mapped onto them.

Each entry is a table of core keys (``name``, ``plugin``, ``eviction_policy``,
``ttl_seconds``, ``write_through``) plus the tier plugin's own keys, which the
settings model it registered validates::

    [[kv_cache.tiers]]                [[kv_cache.tiers]]
    name = "l2"                       name = "l3"
    plugin = "memory"                 plugin = "disk"
    capacity = 50000                  path = "~/.cache/tierserve/kv"
                                      persistent = true
                                      write_through = true
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator, model_validator

from tierserve.core.tables import validate_table

if TYPE_CHECKING:
    from tierserve.core.sections import KVCacheSettings

M = TypeVar("M", bound=BaseModel)

TIER_KEYS = ("name", "plugin", "eviction_policy", "ttl_seconds", "write_through")
RESERVED_TIER_NAMES = ("l1", "all")

# The original design described at most two tiers with [kv_cache] keys; they
# still build the list when [[kv_cache.tiers]] is absent. Entry key -> legacy
# key; "name" maps to the key that switches the tier on. This is the one place
# core names tier plugins' keys, so that old presets load unchanged.
LEGACY_TIERS: dict[str, dict[str, str]] = {
    "l2": {
        "name": "l2_capacity",
        "plugin": "l2_tier",
        "eviction_policy": "l2_eviction_policy",
        "capacity": "l2_capacity",
        "max_bytes": "max_memory_bytes",
    },
    "l3": {
        "name": "disk_path",
        "plugin": "l3_tier",
        "eviction_policy": "l3_eviction_policy",
        "write_through": "persistence",
        "path": "disk_path",
        "max_bytes": "max_disk_bytes",
        "persistent": "persistence",
        "compression_level": "compression_level",
        "write_queue": "l3_write_queue",
        "writer_nice": "l3_writer_nice",
    },
}
LEGACY_TIER_KEYS: frozenset[str] = frozenset(key for keys in LEGACY_TIERS.values() for key in keys.values())


class TableOptions(BaseModel):
    """A tier's own keys before the tier plugin's settings model has checked them."""

    model_config = ConfigDict(extra="allow")


class LegacyOptions(TableOptions):
    """Own keys built from legacy ``[kv_cache]`` keys: the plugin takes those its model declares,
    as tiers of the original design read only the ``[kv_cache]`` keys they used."""


class TierSettings(BaseModel):
    """One ``[[kv_cache.tiers]]`` entry after validation.

    Attributes:
        name: unique, lower-case; ``"l1"`` and ``"all"`` are reserved.
        plugin: the ``cache_tiers`` registry name of the tier's plugin.
        eviction_policy: resolved (``kv_cache.eviction_policy`` unless set), canonical lower case.
        ttl_seconds: resolved (``kv_cache.ttl_seconds`` unless set); None or 0: never expire.
        write_through: every newly computed block is also written to this tier.
        options: the plugin's own validated settings (an instance of the model it registered).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    plugin: str = Field(min_length=1)
    eviction_policy: str
    ttl_seconds: float | None = Field(ge=0)
    write_through: bool = False
    options: SerializeAsAny[BaseModel] = Field(default_factory=TableOptions)

    @model_validator(mode="before")
    @classmethod
    def _own_keys_to_options(cls, data: Any) -> Any:
        # TOML gives one flat table; the plugin's keys travel apart from the core ones.
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        options = data.get("options")
        if isinstance(options, Mapping):
            data["options"] = TableOptions.model_validate(dict(options))
        elif "options" not in data:
            own = {key: data.pop(key) for key in list(data) if key not in TIER_KEYS}
            data["options"] = TableOptions.model_validate(own)
        return data

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        value = value.lower()
        if value in RESERVED_TIER_NAMES:
            raise ValueError(f"{value!r} is reserved ('l1' is the live block pool, 'all' means every tier)")
        return value

    def as_table(self) -> dict[str, Any]:
        """The entry as TOML would write it: core keys, then the plugin's own (JSON values)."""
        core = self.model_dump(mode="json", exclude={"options"})
        return core | self.options.model_dump(mode="json")

    def options_as(self, model: type[M]) -> M:
        """The plugin's own settings as ``model``: as validated by ``load_settings``, or
        validated now when these settings were built directly."""
        if isinstance(self.options, model):
            return self.options
        raw = self.options.model_dump()
        if isinstance(self.options, LegacyOptions):
            raw = {key: value for key, value in raw.items() if key in model.model_fields}
        return validate_table(
            model, raw, f"kv_cache.tiers[{self.name}]", lambda key: "the Settings object", extra_keys=TIER_KEYS
        )


def legacy_tiers(kv: KVCacheSettings) -> list[TierSettings]:
    """The tier list the legacy keys describe: ``l2`` if ``l2_capacity > 0 and max_memory_bytes > 0``,
    ``l3`` if ``disk_path`` is set."""
    present = {"l2": kv.l2_capacity > 0 and kv.max_memory_bytes > 0, "l3": bool(kv.disk_path)}
    tiers = []
    for name, keys in LEGACY_TIERS.items():
        if not present[name]:
            continue
        values = {key: getattr(kv, legacy) for key, legacy in keys.items()}
        own = {key: value for key, value in values.items() if key not in TIER_KEYS}
        tiers.append(
            TierSettings(
                name=name,
                plugin=values["plugin"],
                eviction_policy=values["eviction_policy"] or kv.eviction_policy,
                ttl_seconds=kv.ttl_seconds,
                write_through=values.get("write_through", False),
                options=LegacyOptions.model_validate(own),
            )
        )
    return tiers


def unique_names(tiers: list[TierSettings]) -> list[TierSettings]:
    """``tiers`` unchanged, or ValueError naming a tier name used twice."""
    seen: set[str] = set()
    for tier in tiers:
        if tier.name in seen:
            raise ValueError(f"tier names must be unique: {tier.name!r} is used twice")
        seen.add(tier.name)
    return tiers
