"""Hypothesis over config files: ``load_settings`` returns valid settings or a ConfigError naming the key and file.

Documents cover core sections, plugins' own ``[plugins.NAME]`` tables, the old
key names plugins keep as aliases, and ``[[kv_cache.tiers]]`` lists.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tierserve.settings.config import LoadedSettings, Settings, load_settings
from tierserve.core.errors import ConfigError
from tierserve.core.plugins import load_plugins
from tierserve.core.tier_settings import TIER_KEYS

pytestmark = pytest.mark.unit

# the [section] tables ([[models]] is a list of tables: test_model_registry.py and the settings probes cover it)
SECTIONS = {name: list(field.annotation.model_fields) for name, field in Settings.model_fields.items() if name != "models"}


def _without_nulls(value: Any) -> Any:
    """``value`` with every None left out, as a TOML file would hold it (TOML has no null: unset keys are absent)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value if v is not None]
    return value


DEFAULTS = _without_nulls(Settings().model_dump(mode="json"))  # plausible values: the defaults, as TOML writes them
_BUILTINS = load_plugins(allowlist=[])
ALIASES = _BUILTINS.aliases()  # "section.key" -> (component, key)
PLUGIN_TABLES = {name: list(c.settings.model_fields) for name, c in _BUILTINS.settings_components().items()}
TIER_PLUGINS = {c.name: list(c.settings.model_fields) for c in _BUILTINS.registry("cache_tiers")}
BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---- a minimal TOML writer --------------------------------------------------------------------


def toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else toml_string(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # TOML has no null: a key whose value is None (unset) is left out
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(value)


def toml_document(doc: dict[str, Any]) -> str:
    """Top-level scalars first (TOML puts them before any table), then one ``[section]`` per table."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for section, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"\n[{toml_key(section)}]")
            lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# ---- documents drawn from the real settings model ----------------------------------------------

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
scalars = (
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.sampled_from([0, 1, -1, 2, 16, 512, 65536])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["", "auto", "cpu", "lru", "adaptive", "memory", "disk", "ngram", "fcfs", "info", "json"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def tables_of(draw, keys: list[str], good: dict[str, Any]) -> dict[str, Any]:
    """Mostly the given keys (a plausible value or anything), sometimes an unknown one."""
    table: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(keys)) if keys and draw(st.integers(0, 15)) else draw(names)
        plausible = good.get(key)
        table[key] = draw(st.just(plausible) | values) if plausible is not None else draw(values)
    return table


@st.composite
def tiers(draw) -> list[Any]:
    """A ``[[kv_cache.tiers]]`` list: entries of core keys plus a tier plugin's own."""
    entries: list[Any] = []
    for index in range(draw(st.integers(0, 3))):
        if draw(st.integers(0, 15)) == 0:
            entries.append(draw(scalars))
            continue
        plugin = draw(st.sampled_from(sorted(TIER_PLUGINS)))
        good = {"name": f"t{index}", "plugin": plugin, "eviction_policy": "lru", "path": "fuzz-l3", "capacity": 8}
        entry = {"name": f"t{index}", "plugin": plugin} if draw(st.booleans()) else {}
        entry |= draw(tables_of([*TIER_KEYS, *TIER_PLUGINS[plugin]], good))
        entries.append(entry)
    return entries


@st.composite
def documents(draw) -> dict[str, Any]:
    """Mostly real sections and keys (so values reach validation), sometimes unknown ones."""
    doc: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 4))):
        section = draw(names) if draw(st.integers(0, 15)) == 0 else draw(st.sampled_from(list(SECTIONS)))
        if draw(st.integers(0, 15)) == 0:  # a section that is not a table
            doc[section] = draw(scalars)
            continue
        old = [alias.split(".", 1)[1] for alias in ALIASES if alias.startswith(f"{section}.")]
        known = SECTIONS.get(section, []) + old
        table = doc.setdefault(section, {}) if isinstance(doc.get(section, {}), dict) else {}
        # the default is valid, so some documents load and the success path is fuzzed too
        table |= draw(tables_of(known, DEFAULTS.get(section, {})))
        if section == "kv_cache" and draw(st.integers(0, 3)) == 0:
            table["tiers"] = draw(tiers())
        if section == "plugins":
            for _ in range(draw(st.integers(0, 2))):
                name = draw(st.sampled_from(sorted(PLUGIN_TABLES))) if draw(st.integers(0, 7)) else draw(names)
                table[name] = draw(tables_of(PLUGIN_TABLES.get(name, []), {}))
        doc[section] = table
    return doc


def expected_sources(doc: dict[str, Any], label: str) -> dict[tuple[str, str], str]:
    """Where each key of ``doc`` should say it came from: plugin tables and aliases land on ``plugins.NAME``."""
    out = {}
    for section, table in doc.items():
        for key, value in table.items():
            if section == "plugins" and key != "enabled":
                out |= {(f"plugins.{key.lower()}", inner): label for inner in value}
            elif f"{section}.{key}" in ALIASES:
                name, target = ALIASES[f"{section}.{key}"]
                out[(f"plugins.{name}", target)] = f"{label}, as {section}.{key}"
            else:
                out[(section, key)] = label
    return out


def named_keys(doc: dict[str, Any]) -> list[str]:
    """Every way an error may name a part of ``doc``: ``section.key`` or ``[section]``."""
    out = [f"[{section}]" for section in doc]
    out += [f"{s}.{k}" for s, table in doc.items() if isinstance(table, dict) for k in table]
    return out


def load(path: Path) -> LoadedSettings | ConfigError:
    try:
        return load_settings(None, config_file=path, environ={})
    except ConfigError as exc:
        return exc


@FUZZ
@given(doc=documents())
def test_any_config_file_loads_or_names_the_bad_key(tmp_path: Path, doc: dict[str, Any]) -> None:
    path = tmp_path / "fuzz.toml"
    text = toml_document(doc)
    if "nan" not in repr(doc):  # nan != nan
        assert tomllib.loads(text) == doc, text
    path.write_text(text, encoding="utf-8")
    result = load(path)
    event("loaded" if isinstance(result, LoadedSettings) else "ConfigError: " + " ".join(str(result).split()[:2])[:40])
    if isinstance(result, LoadedSettings):
        assert all(section in SECTIONS and isinstance(table, dict) for section, table in doc.items()), text
        for (section, key), source in expected_sources(doc, f"config file {path}").items():
            assert result.source_of(section, key) == source, text
        return
    message = str(result)
    assert str(path) in message, f"{message}\n--- file:\n{text}"
    assert any(name in message for name in named_keys(doc)), f"{message}\n--- file:\n{text}"
    assert "Traceback" not in message


@FUZZ
@given(data=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_load_or_are_invalid_toml(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.toml"
    path.write_bytes(data)
    try:
        parsed = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        parsed = None
    result = load(path)
    if parsed is None:
        assert isinstance(result, ConfigError), data
        assert "invalid TOML" in str(result) and str(path) in str(result), str(result)
    elif isinstance(result, ConfigError):
        assert str(path) in str(result) and any(name in str(result) for name in named_keys(parsed)), str(result)


def test_writer_round_trips() -> None:
    doc = {"top": 1.5, "kv_cache": {"l1_capacity": 8, 'we"ird\n': [1, "a\x7f", {"x y": True}], "f": float("-inf")}}
    assert tomllib.loads(toml_document(doc)) == doc
