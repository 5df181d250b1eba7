"""Where settings come from: presets, TOML files, ``TIERSERVE_*`` variables and ``--set``, as labelled layers.

A layer is raw nested tables (nothing validated yet) plus the label that
errors and ``config show`` print as its source. Sources, later wins:
preset -> ``--config FILE`` -> environment -> command line.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tierserve.core.errors import ConfigError
from tierserve.core.tables import suggest

ENV_PREFIX = "TIERSERVE_"
ENV_DELIMITER = "__"
GROUPS = ("preset", "config file", "environment", "command line")


@dataclass(frozen=True, slots=True)
class Layer:
    """One source of settings.

    Attributes:
        label: what errors name as the source, e.g. ``config file x.toml``.
        values: ``{section: {key: value}}``; ``plugins`` may nest ``{name: {key: value}}``.
        group: one of ``GROUPS``: the environment's variables are one group,
            so setting an old key and its new name there is one conflict.
    """

    label: str
    values: dict[str, Any]
    group: str

    @property
    def rank(self) -> int:
        return GROUPS.index(self.group)


def preset_names() -> list[str]:
    """The presets shipped in ``tierserve.configs``."""
    folder = resources.files("tierserve.configs")
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def preset_path(name: str) -> Path:
    """The file of a shipped preset, or a path given as the preset itself."""
    candidate = Path(name)
    if candidate.suffix == ".toml":
        if not candidate.is_file():
            raise ConfigError(f"preset file {name!r} does not exist")
        return candidate
    resource = resources.files("tierserve.configs") / f"{name}.toml"
    if not resource.is_file():
        available = preset_names()
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(available)}{suggest(name, available)}")
    return Path(str(resource))


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the bytes before it parses them
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None


def nest(path: list[str], value: Any) -> dict[str, Any]:
    """``["plugins", "ngram", "max_n"], 3`` -> ``{"plugins": {"ngram": {"max_n": 3}}}``."""
    for part in reversed(path[1:]):
        value = {part: value}
    return {path[0]: value}


def env_layers(environ: Mapping[str, str]) -> list[Layer]:
    """``TIERSERVE_SECTION__KEY=value`` (and ``TIERSERVE_PLUGINS__NAME__KEY``), one layer per variable.

    Values that look like JSON lists or objects are parsed as JSON; everything
    else stays a string for the settings model to coerce (``"8"`` -> 8).
    """
    layers = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX) or ENV_DELIMITER not in name:
            continue
        raw = environ[name]
        value: Any = raw
        if raw.strip().startswith(("[", "{")):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                raise ConfigError(f"environment variable {name}: invalid JSON value {raw!r}") from None
        path = name[len(ENV_PREFIX) :].lower().split(ENV_DELIMITER)
        layers.append(Layer(f"environment variable {name}", nest(path, value), "environment"))
    return layers


def parse_override(assignment: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` or ``"plugins.name.key=value"`` (value in TOML syntax, else a plain string).

    Returns ``(section, key, value)``; a plugin table's section is ``plugins.name``.
    """
    dotted, sep, raw = assignment.partition("=")
    section, dot, key = dotted.strip().rpartition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {assignment!r}: expected SECTION.KEY=VALUE, e.g. kv_cache.l1_capacity=1000")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section.strip(), key.strip(), value


def override_layer(overrides: Mapping[tuple[str, str], Any]) -> Layer:
    """The command line's ``(section, key) -> value`` as one layer (``section`` may be dotted)."""
    values: dict[str, Any] = {}
    for (section, key), value in overrides.items():
        table = values
        for part in section.split("."):
            if not isinstance(table.get(part), dict):
                table[part] = {}
            table = table[part]
        table[key] = value
    return Layer("command line", values, "command line")


def read_layers(
    preset: str | None,
    config_file: str | os.PathLike[str] | None,
    environ: Mapping[str, str],
    overrides: Mapping[tuple[str, str], Any] | None,
) -> list[Layer]:
    """Every layer, in the order they apply."""
    layers = []
    if preset is not None:
        path = preset_path(preset)
        layers.append(Layer(f"preset {preset} ({path})", read_toml(path), "preset"))
    if config_file is not None:
        path = Path(config_file)
        layers.append(Layer(f"config file {path}", read_toml(path), "config file"))
    layers += env_layers(environ)
    layers.append(override_layer(overrides or {}))
    return layers
