"""Where settings come from: presets, TOML files, ``TIERSERVE_*`` variables and ``--set``, as labelled layers.

A layer is raw nested tables (nothing validated yet) plus the label that
errors and ``config show`` print as its source. Sources, later wins:
preset -> ``--config FILE`` -> environment -> command line. Files and the
environment are read by pydantic-settings' own sources, one layer each, so
that every value keeps the label of the file or variable it came from.
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

from pydantic_settings import EnvSettingsSource, SettingsError, TomlConfigSettingsSource

from tierserve.core.errors import ConfigError
from tierserve.core.sections import Settings
from tierserve.core.tables import suggest

ENV_PREFIX = Settings.model_config["env_prefix"]
ENV_DELIMITER = Settings.model_config["env_nested_delimiter"]
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
    """A TOML file's tables as pydantic-settings' ``TomlConfigSettingsSource`` reads them (every key kept)."""
    # the source reads a missing file, or a folder, as an empty one
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path}: cannot read config file: not a file")
    try:
        return TomlConfigSettingsSource(Settings, toml_file=path).toml_data
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


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over the given variables, not the process's (tests pass their own)."""

    def __init__(self, variables: Mapping[str, str]) -> None:
        self._variables = variables
        super().__init__(Settings)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {name.lower(): value for name, value in self._variables.items()}


def env_layers(environ: Mapping[str, str]) -> list[Layer]:
    """``TIERSERVE_SECTION__KEY=value`` (and ``TIERSERVE_PLUGINS__NAME__KEY``), one layer per variable.

    Lists and tables are written as JSON (``TIERSERVE_AUTH__API_KEYS='["k1"]'``); everything
    else stays a string for the settings model to coerce (``"8"`` -> 8). Names without ``__``
    (``TIERSERVE_PLUGINS``, the allowlist) are not settings.
    """
    layers = []
    for name in sorted(environ):
        path = name[len(ENV_PREFIX) :].lower().split(ENV_DELIMITER)
        if not name.upper().startswith(ENV_PREFIX) or len(path) < 2:
            continue
        if path[0] not in Settings.model_fields:  # the source would skip it silently
            sections = list(Settings.model_fields)
            raise ConfigError(
                f"unknown section [{path[0]}] in environment variable {name}; available sections: "
                f"{', '.join(sections)}{suggest(path[0], sections)}"
            )
        raw = environ[name]
        try:
            if path[0] == "plugins" and path[1] != "enabled":
                # the source decodes JSON by the declared field's type; [plugins.NAME] tables are declared
                # by plugins, which load only once the allowlist is known
                values = nest(path, json.loads(raw) if raw.strip().startswith(("[", "{")) else raw)
            else:
                values = _Environment({name: raw})()
        except (SettingsError, json.JSONDecodeError):
            message = f"environment variable {name}: invalid JSON value {raw!r}; write a list or table as JSON"
            raise ConfigError(message) from None
        layers.append(Layer(f"environment variable {name}", values, "environment"))
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
