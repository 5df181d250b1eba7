"""The configuration reference page (``docs/settings.md``), generated from the settings models themselves.

Every ``[section]`` key with its type, its default, what the shipped presets set it to and its description, and
then every built-in plugin's ``[plugins.NAME]`` table. ``python -m tierserve.settings.reference > docs/settings.md``
writes it; ``tests/test_docs.py`` fails when the checked-in page differs from what this renders, so the page
cannot fall behind the code.
"""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

PRESETS = ("development", "production")
_WIDE = 48  # characters of a value shown before it is cut


def render() -> str:
    """The whole page, as markdown."""
    from tierserve.core.plugins import COMPONENT_KINDS, load_plugins
    from tierserve.settings.config import Settings, load_settings

    presets = {name: load_settings(name, environ={}).settings for name in PRESETS}
    out = [
        "# Settings reference\n\n",
        "Every key of every section, as `tierserve config show` resolves it. Settings come from a preset "
        "(`--preset development`, the default, or `production`), a `--config` TOML file, `TIERSERVE_SECTION__KEY` "
        "environment variables and `--set section.key=value` flags, later sources winning. The preset columns show "
        "a value only where the preset sets one other than the default. This page is generated from the settings "
        "models (`python -m tierserve.settings.reference`).\n\n",
    ]
    for section, field in Settings.model_fields.items():
        model = _model_of(field.annotation)
        if model is None or section == "plugins":
            continue
        doc = (model.__doc__ or "").strip().splitlines()[0].replace("``", "`") if model.__doc__ else ""
        out.append(f"## `[{section}]`\n\n{doc}\n\n" if section != "models" else f"## `[[models]]`\n\n{doc}\n\n")
        values = {name: _section_values(settings, section) for name, settings in presets.items()}
        out.append(_table(model, values))
    plugins = load_plugins(allowlist=[])
    out.append(_tier_entries(plugins))
    out.append("## `[plugins.NAME]`: the built-in plugins' tables\n\n")
    owners = plugins.table_owners()
    for name in sorted(owners):
        kind, component = owners[name]
        model = component.settings
        out.append(f"### `[plugins.{name}]`\n\nOf the {COMPONENT_KINDS[kind][1]} `{component.name}` "
                   f"({component.plugin}).\n\n")  # fmt: skip
        out.append(_table(model, {}))
    return "".join(out)


TIER_KEYS = {
    "name": "the tier's name in statistics and `POST /v1/cache/clear` (`l1` and `all` are reserved)",
    "plugin": "the cache tier plugin that stores it: memory, disk, redis or an installed one",
    "eviction_policy": "its policy (default: `kv_cache.eviction_policy`)",
    "ttl_seconds": "how long its entries live (default: `kv_cache.ttl_seconds`; 0: for ever)",
    "write_through": "also write every newly computed block here (default: true for a tier shared by processes, "
    "Redis, false otherwise)",
}


def _tier_entries(plugins: Any) -> str:
    """``[[kv_cache.tiers]]``: the keys of every entry, then each tier plugin's own."""
    out = ["## `[[kv_cache.tiers]]`\n\nThe tiers below L1, in order. Every entry takes these keys, then the "
           "keys of its plugin below.\n\n| key | description |\n|---|---|\n"]  # fmt: skip
    out += [f"| `{key}` | {_escape(text)} |\n" for key, text in TIER_KEYS.items()]
    out.append("\n")
    registry = plugins.registry("cache_tiers")
    for name in registry.names():
        component = registry.get(name)
        if component.settings is not None:
            out.append(f"### `plugin = \"{name}\"`\n\n{component.metadata.get('description', '')} "
                       f"({component.plugin}).\n\n")  # fmt: skip
            out.append(_table(component.settings, {}))
    return "".join(out)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):  # list[ModelEntry]
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _section_values(settings: Any, section: str) -> dict[str, Any]:
    value = getattr(settings, section)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else {}


def _table(model: type[BaseModel], presets: dict[str, dict[str, Any]]) -> str:
    names = list(presets)
    header = "| key | type | default | " + "".join(f"{name} | " for name in names) + "description |\n"
    rule = "|---|---|---|" + "---|" * len(names) + "---|\n"
    rows = []
    for key, field in model.model_fields.items():
        default = _default(field)
        cells = [f"`{key}`", _type(field.annotation), _value(default)]
        for name in names:
            value = presets[name].get(key, default)
            cells.append(_value(value) if value != default else "")
        cells.append(_escape(field.description or ""))
        rows.append("| " + " | ".join(cells) + " |\n")
    return header + rule + "".join(rows) + "\n"


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return [item.model_dump(mode="json") for item in value]
    return value


def _type(annotation: Any) -> str:
    text = _type_text(annotation)
    return _escape(f"`{text}`") if text else ""


def _type_text(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(arg) for arg in args)
    if origin is not None:
        inner = ", ".join(_type_text(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, list) and value and all(isinstance(v, dict) and {"name", "plugin"} <= set(v) for v in value):
        return _escape(", ".join(f"`{v['name']}` ({v['plugin']})" for v in value))  # a tier list: what and where
    text = json.dumps(value, default=str)
    if len(text) > _WIDE:
        text = text[: _WIDE - 1] + "…"
    return _escape(f"`{text}`")


def _escape(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("|", "\\|")).strip()


if __name__ == "__main__":
    print(render(), end="")
