"""Where ``model.path`` points: builtin names, local Hugging Face checkpoint directories and GGUF files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import structlog

from tierserve.core.errors import ConfigError

log = structlog.get_logger(__name__)

BUILTIN_PREFIX = "builtin:"

_HOW_TO_FIX = (
    "point model.path at a local Hugging Face checkpoint directory (with config.json, *.safetensors and "
    "tokenizer files), at a .gguf file (or its directory, with model.gguf_file naming it), at a catalogue "
    "model (smollm2; see `tierserve models`), at a Hugging Face id (org/name or org/name:file.gguf), "
    "or use builtin:tiny"
)


def resolve_model_path(path: str | os.PathLike[str], gguf_file: str | None = None) -> Path:
    """Turn a ``model.path`` value into a checkpoint directory or a GGUF file.

    ``builtin:NAME`` is written on first use into the cache (see
    ``tierserve.models.builtin_models.ensure_builtin_checkpoint``); a catalogue name
    (``smollm2``) or a Hugging Face id that is no local path is fetched on first use
    (``tierserve.models.catalogue``); a ``.gguf``
    file (or a directory and ``gguf_file``, ``model.gguf_file``, naming one in
    it) is returned as the file (``models.gguf.is_gguf`` tells); anything else is
    a local directory (``~`` expanded) that must contain ``config.json``.

    Raises:
        ConfigError: unknown builtin name, missing directory or file, or a directory
            without ``config.json``; the message says what to do instead.
    """
    from tierserve.models.gguf import find_gguf

    text = os.fspath(path)
    if gguf_file is not None and text.startswith(BUILTIN_PREFIX):
        raise ConfigError(f"model.gguf_file = {gguf_file!r} is set but model.path {text!r} is a builtin checkpoint")
    if text.startswith(BUILTIN_PREFIX):
        from tierserve.models.builtin_models import ensure_builtin_checkpoint

        try:
            return ensure_builtin_checkpoint(text[len(BUILTIN_PREFIX) :])
        except ValueError as exc:
            raise ConfigError(f"model.path {text!r}: {exc}") from None

    directory = Path(text).expanduser()
    if not directory.exists():
        from tierserve.models.catalogue import is_named_model, resolve_named_model

        if not is_named_model(text):
            raise ConfigError(f"model.path {text!r}: {directory} does not exist; {_HOW_TO_FIX}")
        directory = resolve_named_model(text)  # fetched on first use, its sha256 checked
    gguf = find_gguf(directory, gguf_file, text)
    if gguf is not None:
        return gguf
    if not directory.is_dir():
        raise ConfigError(f"model.path {text!r}: {directory} is not a directory; {_HOW_TO_FIX}")
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model.path {text!r}: {directory} has no config.json, so it is not a Hugging Face "
            f"checkpoint directory; {_HOW_TO_FIX}"
        )
    return directory.absolute()


def load_config(path: Path):
    """The checkpoint's transformers config: ``config.json``, or a GGUF file's metadata."""
    from tierserve.models.gguf import is_gguf

    if is_gguf(path):
        from tierserve.models.gguf import load_config as gguf_config

        return gguf_config(path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_causal_lm(path: Path, **kwargs: Any):
    """``AutoModelForCausalLM.from_pretrained`` on a checkpoint directory or a GGUF file (transformers
    dequantizes a GGUF file's quantized tensors to ``kwargs["dtype"]``; a log line says so)."""
    from transformers import AutoModelForCausalLM

    from tierserve.models.gguf import FLOAT_TYPES, check_gguf, is_gguf

    if not is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    info = check_gguf(path)
    quantized = sorted(set(info.tensor_types) - set(FLOAT_TYPES))
    if quantized:
        log.warning(
            "gguf_dequantized",
            path=str(path),
            types=quantized,
            to=str(kwargs.get("dtype")),
            why="the transformers backends hold float weights; model.quantization = 'int8' quantizes them again",
        )
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=load_config(path), **kwargs)


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, chat template included: its tokenizer files, or a GGUF file's metadata."""
    from tierserve.models.gguf import is_gguf

    if is_gguf(path):
        from tierserve.models.gguf import load_tokenizer as gguf_tokenizer

        return gguf_tokenizer(path)
    return tokenizer_from_directory(path)


def tokenizer_from_directory(directory: Path) -> Any:
    """A directory's tokenizer, by the class its ``tokenizer_config.json`` names, imported alone.

    ``AutoTokenizer`` would do the same, but importing it imports transformers' config machinery and with it
    torch (~250 MB): the HTTP process, which tokenizes and never runs the model, would carry torch for nothing.
    A directory that names no class transformers exports (or has no ``tokenizer.json``) goes through
    ``AutoTokenizer``."""
    import transformers

    try:
        named = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    tokenizer_class = getattr(transformers, named, None) if isinstance(named, str) and named.isidentifier() else None
    if tokenizer_class is None or not (directory / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    return tokenizer_class.from_pretrained(directory)


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
    A GGUF file's are its eos, eot and eom tokens (llama.cpp's end-of-generation set).
    """
    from tierserve.models.gguf import end_of_generation_ids, is_gguf

    directory = Path(directory)
    if is_gguf(directory):
        return end_of_generation_ids(directory)
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
