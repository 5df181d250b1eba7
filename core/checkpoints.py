"""Where ``model.path`` points: builtin names and local Hugging Face checkpoint directories."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tierserve.core.errors import ConfigError

BUILTIN_PREFIX = "builtin:"

_HOW_TO_FIX = (
    "tierserve never downloads model weights: point model.path at a local Hugging Face "
    "checkpoint directory (with config.json, *.safetensors and tokenizer files), "
    "or use builtin:tiny"
)


def resolve_model_path(path: str | os.PathLike[str]) -> Path:
    """Turn a ``model.path`` value into a checkpoint directory.

    ``builtin:NAME`` is written on first use into the cache (see
    ``tierserve.core.builtin_models.ensure_builtin_checkpoint``); anything else
    is a local directory (``~`` expanded) that must contain ``config.json``.

    Raises:
        ConfigError: unknown builtin name, missing directory, or a directory
            without ``config.json``; the message says what to do instead.
    """
    text = os.fspath(path)
    if text.startswith(BUILTIN_PREFIX):
        from tierserve.core.builtin_models import ensure_builtin_checkpoint

        try:
            return ensure_builtin_checkpoint(text[len(BUILTIN_PREFIX) :])
        except ValueError as exc:
            raise ConfigError(f"model.path {text!r}: {exc}") from None

    directory = Path(text).expanduser()
    if not directory.exists():
        raise ConfigError(f"model.path {text!r}: {directory} does not exist; {_HOW_TO_FIX}")
    if not directory.is_dir():
        raise ConfigError(f"model.path {text!r}: {directory} is not a directory; {_HOW_TO_FIX}")
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model.path {text!r}: {directory} has no config.json, so it is not a Hugging Face "
            f"checkpoint directory; {_HOW_TO_FIX}"
        )
    return directory.absolute()


def context_length(requested: int | None, trained: int, directory: Path) -> int:
    """``model.max_model_len`` checked against the positions the checkpoint has (``requested`` unset: all of them).

    Raises:
        ConfigError: ``requested`` is longer than the checkpoint allows (it was once cut down without a word).
    """
    if requested is None:
        return trained
    if requested > trained:
        raise ConfigError(
            f"model.max_model_len = {requested} is longer than {directory} allows ({trained} positions, "
            f"config.json); set at most {trained} or leave it unset (sliding_window.enabled streams past it)"
        )
    return requested


def load_generation_eos_ids(directory: str | os.PathLike[str]) -> set[int]:
    """All end-of-sequence token ids a checkpoint declares.

    The union of ``eos_token_id`` in ``generation_config.json`` and in
    ``config.json`` (each an int, a list of ints, or absent; for multimodal
    configs also ``text_config.eos_token_id``). Missing files count as empty.
    """
    directory = Path(directory)
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        data = _read_json(directory / name)
        ids |= _as_ids(data.get("eos_token_id"), directory / name)
        text_config = data.get("text_config")
        if isinstance(text_config, dict):
            ids |= _as_ids(text_config.get("eos_token_id"), directory / name)
    return ids


def eos_token_ids(directory: str | os.PathLike[str], tokenizer: Any) -> frozenset[int]:
    """The ids that end generation: the checkpoint's declared ones plus the tokenizer's eos token."""
    ids = load_generation_eos_ids(directory)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def _as_ids(value: Any, source: Path) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return set(value)
    raise ConfigError(f"{source}: eos_token_id must be an int or a list of ints, got {value!r}")
