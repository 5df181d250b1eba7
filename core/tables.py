"""One settings table against its pydantic model, and errors that name key, value, source and reason.

Core sections, a plugin's ``[plugins.NAME]`` table and each ``[[kv_cache.tiers]]``
entry are all reported the same way::

    plugins.ngram.max_n = 0 (from config file x.toml): Input should be greater than or equal to 1
    unknown key plugins.ngram.maxn in config file x.toml; keys of [plugins.ngram]: min_n, max_n; did you mean 'max_n'?
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tierserve.core.errors import ConfigError

M = TypeVar("M", bound=BaseModel)
Loc = tuple[Any, ...]
DEFAULT_SOURCE = "default"
_MISSING = object()


def suggest(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, or ``""``."""
    hint = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {hint[0]!r}?" if hint else ""


def unknown_key(dotted: str, where: str, owner: str, keys: Iterable[str]) -> ConfigError:
    """``unknown key a.b in SOURCE; keys of OWNER: ...; did you mean ...?``"""
    keys = list(keys)
    key = dotted.rsplit(".", 1)[-1]
    listing = ", ".join(keys) or "(none)"
    return ConfigError(f"unknown key {dotted} in {where}; keys of {owner}: {listing}{suggest(key, keys)}")


def dotted(prefix: str, loc: Loc) -> str:
    """``kv_cache`` + ``("tiers", 1, "name")`` -> ``kv_cache.tiers[1].name``."""
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _dig(data: Any, loc: Loc) -> Any:
    for part in loc:
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return _MISSING
    return data


def _short(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_errors(
    exc: ValidationError,
    data: Mapping[str, Any],
    prefix: str,
    source_of: Callable[[Loc], str | None],
    sources_within: Callable[[Loc], list[str]],
) -> str:
    """One line per pydantic error, naming the key, the bad value and where it came from.

    Args:
        exc: what the model raised while validating ``data``.
        data: the raw table that was validated.
        prefix: the dotted name of ``data`` (``""`` for the whole settings).
        source_of: the source of the value at a location, ``None`` if unknown.
        sources_within: the sources of every value under a location (for
            rules across keys and for missing keys).
    """
    lines = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        value = _dig(data, loc)
        source = source_of(loc) if loc else None
        if value is not _MISSING and source is not None:
            lines.append(f"{dotted(prefix, loc)} = {_short(value)} (from {source}): {error['msg']}")
            continue
        # a missing key, or a rule across keys: name every source that fed the table
        table = loc[:-1] if value is _MISSING and loc else loc
        involved = [src for src in dict.fromkeys(sources_within(table)) if not src.startswith(DEFAULT_SOURCE)]
        where = "; ".join(involved) or DEFAULT_SOURCE
        name = dotted(prefix, loc) if value is _MISSING and loc else f"[{dotted(prefix, loc)}]"
        lines.append(f"{name} (from {where}): {error['msg']}")
    return "invalid settings:\n  " + "\n  ".join(lines)


def model_keys(model: type[BaseModel]) -> list[str]:
    """The keys a settings table of ``model`` may hold."""
    return list(model.model_fields)


def validate_table(
    model: type[M],
    table: Mapping[str, Any],
    path: str,
    source_of: Callable[[str], str],
    owner: str | None = None,
    extra_keys: Iterable[str] = (),
) -> M:
    """``table`` validated by ``model``; any unknown key or bad value is a ``ConfigError``.

    Args:
        model: the settings model (a plugin's own, e.g. ``NgramSettings``).
        table: the raw keys and values.
        path: the table's dotted name, e.g. ``plugins.ngram``.
        source_of: where the value of one key came from.
        owner: how to name the table in an unknown-key error (default ``[path]``).
        extra_keys: keys that are valid beside the model's own (listed in that error,
            and their sources named when a key is missing or a rule across keys fails).
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"{path} must be a table of keys, got {_short(table)}")
    extra_keys = list(extra_keys)
    keys = model_keys(model)
    for key in table:
        if key not in keys:
            raise unknown_key(f"{path}.{key}", source_of(key), owner or f"[{path}]", [*extra_keys, *keys])
    try:
        return model.model_validate(dict(table))
    except ValidationError as exc:
        message = describe_errors(
            exc,
            table,
            path,
            lambda loc: source_of(loc[0]) if loc and loc[0] in table else None,
            lambda loc: [source_of(key) for key in [*extra_keys, *table]],
        )
        raise ConfigError(message) from None
