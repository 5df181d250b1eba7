"""``[[kv_cache.tiers]]``: the ordered cache tiers below L1, and the one place flat ``[kv_cache]`` keys map onto them.

Each entry is a table of core keys (``name``, ``plugin``, ``eviction_policy``,
``ttl_seconds``, ``write_through``) plus the tier plugin's own keys, which the
settings model it registered validates. The list is the only representation;
the serving spec's ``[kv_cache]`` keys and the original design's L3 keys are
shorthands that ``apply_shorthands`` writes into it::

    [kv_cache]                          the list's first tier of that plugin
    l2_capacity = 50000          ─►     plugin = "memory": capacity     (none: "l2" added first;
    max_memory_bytes = 10**9     ─►                        max_bytes     0 in either removes it)
    disk_path = "~/kv"           ─►     plugin = "disk":   path          (none: "l3" added last)
    persistence = true           ─►                        persistent, write_through
    max_disk_bytes = 2**34       ─►                        max_bytes

``eviction_policy`` and ``ttl_seconds`` stay ``[kv_cache]`` keys: L1's, and every
tier's unless its entry sets one.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from tierserve.core.errors import ConfigError
from tierserve.core.tables import validate_table

M = TypeVar("M", bound=BaseModel)

TIER_KEYS = ("name", "plugin", "eviction_policy", "ttl_seconds", "write_through")
RESERVED_TIER_NAMES = ("l1", "all")
DEFAULT_TIERS: tuple[dict[str, str], ...] = ({"name": "l2", "plugin": "memory"},)
EXAMPLE_DISK_PATH = "~/.cache/tierserve/kv"


@dataclass(frozen=True, slots=True)
class Shorthand:
    """A flat ``[kv_cache]`` key that sets ``keys`` of the list's first tier whose plugin is ``plugin``.

    Attributes:
        value: what the key accepts.
        adds: where the list has no such tier, the name of the one the key adds (a memory
            tier goes first, as L2; a disk tier last, as L3); None: without one, the key is not used.
        zero_removes: 0 removes that tier (the spec's way to switch L2 off).
    """

    plugin: str
    keys: tuple[str, ...]
    value: TypeAdapter[Any]
    adds: str | None = None
    zero_removes: bool = False


_COUNT = TypeAdapter(Annotated[int, Field(ge=0)])
SHORTHANDS: dict[str, Shorthand] = {
    "l2_capacity": Shorthand("memory", ("capacity",), _COUNT, adds="l2", zero_removes=True),
    "max_memory_bytes": Shorthand("memory", ("max_bytes",), _COUNT, adds="l2", zero_removes=True),
    "disk_path": Shorthand("disk", ("path",), TypeAdapter(Annotated[str, Field(min_length=1)]), adds="l3"),
    "persistence": Shorthand("disk", ("persistent", "write_through"), TypeAdapter(bool)),
    "max_disk_bytes": Shorthand("disk", ("max_bytes",), _COUNT),
}
# flat keys of the original design that picked one tier's plugin, policy or tuning: refused, and the
# error shows the entry to write. key -> (the tier's name in that design, its plugin, the entry's key)
REPLACED: dict[str, tuple[str, str, str]] = {
    "l2_tier": ("l2", "memory", "plugin"),
    "l2_eviction_policy": ("l2", "memory", "eviction_policy"),
    "l3_tier": ("l3", "disk", "plugin"),
    "l3_eviction_policy": ("l3", "disk", "eviction_policy"),
    "compression_level": ("l3", "disk", "compression_level"),
    "l3_write_queue": ("l3", "disk", "write_queue"),
    "l3_writer_nice": ("l3", "disk", "writer_nice"),
}
FLAT_TIER_KEYS = frozenset(SHORTHANDS) | frozenset(REPLACED)


@dataclass(frozen=True, slots=True)
class Landing:
    """Where one shorthand went, as ``config show`` prints it:
    ``kv_cache.l2_capacity = 50000 (preset production) -> kv_cache.tiers[0].capacity``."""

    key: str
    value: Any
    source: str
    landed: str

    def __str__(self) -> str:
        return f"kv_cache.{self.key} = {json.dumps(self.value)} ({self.source}) -> {self.landed}"


@dataclass
class FoldedTiers:
    """``[kv_cache]`` with its shorthands written into ``tiers``.

    Attributes:
        table: the ``[kv_cache]`` table, no flat tier keys left, ``tiers`` always set.
        sources: the source of each key of each entry, by index.
        landings: where each shorthand went.
    """

    table: dict[str, Any]
    sources: list[dict[str, str]]
    landings: list[Landing]


def _plugin_of(entry: Any) -> str | None:
    return str(entry.get("plugin", "")).strip().lower() if isinstance(entry, Mapping) else None


def _name_of(entry: Any) -> str | None:
    return str(entry.get("name", "")).strip().lower() if isinstance(entry, Mapping) else None


def apply_shorthands(kv: Mapping[str, Any], source_of: Callable[[str], str]) -> FoldedTiers:
    """Write the shorthands of ``kv`` into its tier list (``DEFAULT_TIERS`` when it sets none).

    A shorthand sets its keys on the list's first tier of its plugin. Where the list has
    none, ``l2_capacity`` or ``max_memory_bytes`` add a memory tier ``l2`` first and
    ``disk_path`` a disk tier ``l3`` last; ``persistence`` and ``max_disk_bytes`` alone
    are then not used. ``l2_capacity = 0`` or ``max_memory_bytes = 0`` removes the memory tier.

    Args:
        kv: a raw ``[kv_cache]`` table.
        source_of: the source of one of its keys (``"tiers"`` included), for errors and ``config show``.

    Raises:
        ConfigError: a shorthand's value is invalid, or a ``REPLACED`` key is set (the message
            shows the ``[[kv_cache.tiers]]`` entry to write instead).
    """
    table = dict(kv)
    flat = {key: table.pop(key) for key in (*SHORTHANDS, *REPLACED) if key in table}
    tiers = table.get("tiers", [dict(entry) for entry in DEFAULT_TIERS])
    if not isinstance(tiers, list):  # the model's own error names it
        return FoldedTiers(table, [], [])
    tiers = [dict(entry) if isinstance(entry, Mapping) else entry for entry in tiers]
    sources = [dict.fromkeys(entry, source_of("tiers")) if isinstance(entry, Mapping) else {} for entry in tiers]
    values = {
        key: _validated(key, value, source_of(key))
        for key, value in flat.items()
        if key in SHORTHANDS and value is not None
    }
    done: list[tuple[str, dict[str, Any] | str]] = []  # (shorthand, the entry it set, or what it did)
    for plugin in ("memory", "disk"):
        mine = [key for key in values if SHORTHANDS[key].plugin == plugin]
        index = next((i for i, entry in enumerate(tiers) if _plugin_of(entry) == plugin), None)
        if any(SHORTHANDS[key].zero_removes and values[key] == 0 for key in mine):
            did = f"nothing: kv_cache.tiers has no {plugin} tier"
            if index is not None:
                sources.pop(index)
                did = f"removes the list's {plugin} tier {_name_of(tiers.pop(index))!r} (0 switches it off)"
            done += [(key, did) for key in mine]
            continue
        adders = [key for key in mine if SHORTHANDS[key].adds]
        if mine and index is None and not adders:
            add = [f"set kv_cache.{key}" for key, short in SHORTHANDS.items() if short.plugin == plugin and short.adds]
            hint = " or ".join([*add, f'add a [[kv_cache.tiers]] entry with plugin = "{plugin}"'])
            done += [(key, f"not used: kv_cache.tiers has no {plugin} tier ({hint})") for key in mine]
            continue
        if mine and index is None:
            index = _add_tier(tiers, sources, adders[0], values[adders[0]], source_of(adders[0]))
        for key in mine:
            for entry_key in SHORTHANDS[key].keys:
                tiers[index][entry_key] = values[key]
                sources[index][entry_key] = f"{source_of(key)}, as kv_cache.{key}"
            done.append((key, tiers[index]))
    replaced = [key for key in REPLACED if key in flat]
    if replaced:
        raise _replaced_error(replaced[0], flat[replaced[0]], source_of(replaced[0]), tiers)
    table["tiers"] = tiers
    return FoldedTiers(table, sources, [_landing(key, values[key], source_of(key), did, tiers) for key, did in done])


def _validated(key: str, value: Any, source: str) -> Any:
    try:
        return SHORTHANDS[key].value.validate_python(value)
    except ValidationError as exc:
        raise ConfigError(
            f"invalid settings:\n  kv_cache.{key} = {value!r} (from {source}): {exc.errors()[0]['msg']}"
        ) from None


def _add_tier(tiers: list[Any], sources: list[dict[str, str]], key: str, value: Any, source: str) -> int:
    """Add the tier shorthand ``key`` describes where the list has none (memory first, disk last); its index."""
    shorthand = SHORTHANDS[key]
    name, plugin = shorthand.adds, shorthand.plugin
    clash = next((entry for entry in tiers if _name_of(entry) == name), None)
    if clash is not None:
        raise ConfigError(
            f"kv_cache.{key} = {value!r} (from {source}) sets the list's {plugin} tier; kv_cache.tiers has none, "
            f"and its tier named {name!r} is plugin {clash.get('plugin')!r}: add a [[kv_cache.tiers]] entry with "
            f'plugin = "{plugin}" (another name), or remove kv_cache.{key}'
        )
    index = 0 if plugin == "memory" else len(tiers)
    tiers.insert(index, {"name": name, "plugin": plugin})
    sources.insert(index, dict.fromkeys(("name", "plugin"), f"{source}, as kv_cache.{key}"))
    return index


def _landing(key: str, value: Any, source: str, did: dict[str, Any] | str, tiers: list[Any]) -> Landing:
    if isinstance(did, str):
        return Landing(key, value, source, did)
    index = next(i for i, entry in enumerate(tiers) if entry is did)
    return Landing(key, value, source, ", ".join(f"kv_cache.tiers[{index}].{k}" for k in SHORTHANDS[key].keys))


def _toml(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key} = {_toml(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return json.dumps(value)


def _literal(value: Any) -> Any:
    """An environment variable's text as the TOML value it spells (``"5"`` -> 5), for the entry to write."""
    if not isinstance(value, str):
        return value
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _replaced_error(key: str, value: Any, source: str, tiers: list[Any]) -> ConfigError:
    """``kv_cache.l3_writer_nice = 5 (from ...) is no longer a [kv_cache] key; ...`` with the entry to write."""
    name, plugin, entry_key = REPLACED[key]
    entries = [dict(entry) for entry in tiers if isinstance(entry, Mapping)]
    index = next((i for i, entry in enumerate(entries) if _name_of(entry) == name), None)
    if index is None:
        index = next((i for i, entry in enumerate(entries) if _plugin_of(entry) == plugin), None)
    if index is None:
        index = 0 if plugin == "memory" else len(entries)
        entries.insert(index, {"name": name, "plugin": plugin})
    if entry_key == "plugin":  # another plugin: the old one's own keys go
        entries[index] = {k: v for k, v in entries[index].items() if k in TIER_KEYS}
    entry = entries[index]
    entry[entry_key] = _literal(value)
    if _plugin_of(entry) == "disk":
        entry.setdefault("path", EXAMPLE_DISK_PATH)
    block = "\n".join(f"    {k} = {_toml(v)}" for k, v in entry.items())
    return ConfigError(
        f"kv_cache.{key} = {value!r} (from {source}) is no longer a [kv_cache] key: {entry_key} is a key of the "
        f"{entry.get('name', name)} tier's [[kv_cache.tiers]] entry; write\n    [[kv_cache.tiers]]\n{block}\n"
        f"  (in the environment or on the command line, the whole list: kv_cache.tiers = {_toml(entries)})"
    )


class TableOptions(BaseModel):
    """A tier's own keys before the tier plugin's settings model has checked them."""

    model_config = ConfigDict(extra="allow")


class TierSettings(BaseModel):
    """One ``[[kv_cache.tiers]]`` entry after validation.

    Attributes:
        name: unique, lower-case; ``"l1"`` and ``"all"`` are reserved.
        plugin: the ``cache_tiers`` registry name of the tier's plugin.
        eviction_policy: resolved (``kv_cache.eviction_policy`` unless set), canonical lower case.
        ttl_seconds: resolved (``kv_cache.ttl_seconds`` unless set); None or 0: never expire.
        write_through: every newly computed block is also written to this tier; None (unset): the tier's own
            default, true for a tier shared by processes (``CacheTier.shared``: Redis), false otherwise.
        options: the plugin's own validated settings (an instance of the model it registered).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    plugin: str = Field(min_length=1)
    eviction_policy: str
    ttl_seconds: float | None = Field(ge=0)
    write_through: bool | None = None
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
        return validate_table(
            model,
            self.options.model_dump(),
            f"kv_cache.tiers[{self.name}]",
            lambda key: "the Settings object",
            extra_keys=TIER_KEYS,
        )


def unique_names(tiers: list[TierSettings]) -> list[TierSettings]:
    """``tiers`` unchanged, or ValueError naming a tier name used twice."""
    seen: set[str] = set()
    for tier in tiers:
        if tier.name in seen:
            raise ValueError(f"tier names must be unique: {tier.name!r} is used twice")
        seen.add(tier.name)
    return tiers
