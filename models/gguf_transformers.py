"""A GGUF file's transformers config and tokenizer: built once by transformers' GGUF support, then cached.

transformers turns GGUF metadata into a config and a tokenizer (its per-architecture key maps and its GGUF
tokenizer converters); that is kept, not re-implemented. Two costs are not: transformers opens the file with
``gguf.GGUFReader``, seconds per open on a real vocabulary, so while it converts it is handed this project's
reader (``models.gguf_reader``, the file parsed once in ~0.1 s) behind the same field interface; and the result
is saved under ``<cache root>/gguf-meta/<key>/`` (``save_pretrained``), so every later load of the same file —
the server's tokenizer, the engine's config, each restart — reads a few JSON files instead. The key is the
file's fingerprint (its quantization, size, sampled bytes and tensor layout) plus transformers' version and
``CONVERSION_VERSION``: a changed file or a new transformers converts again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from tierserve.models.gguf_reader import ARRAY, STRING, GGUFFile

log = structlog.get_logger(__name__)

CONVERSION_VERSION = 1  # bump when what is saved here changes
_PATCH_LOCK = threading.Lock()


class _FieldView:
    """What transformers reads of a ``gguf.ReaderField``: ``types``, ``parts`` and the ``data`` indices into them."""

    __slots__ = ("data", "parts", "types")

    def __init__(self, types: list[int], parts: list[Any]) -> None:
        self.types, self.parts, self.data = types, parts, range(len(parts))


def _part(value: Any, value_type: int) -> Any:
    return value.encode("utf-8") if value_type == STRING else (value,)


class _ReaderView:
    """A parsed ``GGUFFile`` behind the attributes transformers' GGUF loader uses (``fields``, ``tensors``)."""

    def __init__(self, parsed: GGUFFile) -> None:
        self.tensors = parsed.tensors
        self.fields: dict[str, _FieldView] = {}
        for key, field in parsed.fields.items():
            if field.value_type == ARRAY:
                parts = [_part(item, field.item_type) for item in field.value]
                self.fields[key] = _FieldView([ARRAY, field.item_type], parts)
            else:
                self.fields[key] = _FieldView([field.value_type], [_part(field.value, field.value_type)])


@contextlib.contextmanager
def gguf_module_patched(**replacements: Any) -> Iterator[None]:
    """While inside, the ``gguf`` module's attributes ``replacements`` name are these objects. transformers imports
    what it uses from ``gguf`` at each call, so this is how its GGUF code gets a faster part; a lock keeps two
    patched calls from interleaving."""
    import gguf

    with _PATCH_LOCK:
        originals = {name: getattr(gguf, name) for name in replacements}
        for name, value in replacements.items():
            setattr(gguf, name, value)
        try:
            yield
        finally:
            for name, value in originals.items():
                setattr(gguf, name, value)


@contextlib.contextmanager
def parsed_once(path: Path) -> Iterator[None]:
    """While inside, transformers' ``GGUFReader(path)`` gets this project's parse of ``path`` (other paths, the
    real reader)."""
    import gguf

    parsed = GGUFFile(path)
    view = _ReaderView(parsed)
    original = gguf.GGUFReader

    def reader(target: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(target).resolve() == path.resolve() and not args and not kwargs:
            return view
        return original(target, *args, **kwargs)

    try:
        with gguf_module_patched(GGUFReader=reader):
            yield
    finally:
        parsed.close()


@contextlib.contextmanager
def name_maps_built_once() -> Iterator[None]:
    """While inside, ``gguf.get_tensor_name_map(arch, layers)`` is built once per argument pair: transformers'
    ``get_gguf_hf_weights_map`` recurses over every module and builds it anew for each (397 times, ~7 s, for
    SmolLM2's 30 layers). The map is only read, so sharing one is safe."""
    import functools

    import gguf

    with gguf_module_patched(get_tensor_name_map=functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)):
        yield


def cache_dir_for(path: Path) -> Path:
    """Where this file's converted config and tokenizer are kept."""
    from importlib.metadata import version

    from tierserve.models.builtin_models import cache_root
    from tierserve.models.gguf import gguf_fingerprint

    key = gguf_fingerprint(path, f"transformers-{version('transformers')}", f"conversion-{CONVERSION_VERSION}")
    return cache_root() / "gguf-meta" / key


def cached_config_file(path: Path) -> Path | None:
    """The cached config.json of the GGUF file ``path``, or None before its first conversion. Cheap: no
    transformers import (the key needs only its version string)."""
    found = cache_dir_for(path) / "config.json"
    return found if found.is_file() else None


def converted_config(path: Path) -> Any:
    """The transformers config of the GGUF file ``path`` (from the cache, or converted now with its tokenizer)."""
    from transformers import AutoConfig

    return _converted(path, "config.json", AutoConfig.from_pretrained, 0)


def converted_tokenizer(path: Path) -> Any:
    """The transformers tokenizer (chat template included) of the GGUF file ``path``, as ``converted_config``."""
    from tierserve.models.checkpoints import tokenizer_from_directory

    return _converted(path, "tokenizer_config.json", tokenizer_from_directory, 1)


def _converted(path: Path, marker: str, load: Any, which: int) -> Any:
    """Raises whatever transformers raises for a file it cannot convert (the caller names the file)."""
    where = cache_dir_for(path)
    if (where / marker).is_file():
        try:
            loaded = load(where)
            loaded.name_or_path = str(path.parent)  # as a conversion from the file names it
            return loaded
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged cache entry is converted again
            log.warning("gguf_meta_cache_unreadable", path=str(where), error=str(exc))
            shutil.rmtree(where, ignore_errors=True)
    from transformers import AutoConfig, AutoTokenizer

    with parsed_once(path):
        both = (
            AutoConfig.from_pretrained(path.parent, gguf_file=path.name),
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name),
        )
    _save(where, *both, path)
    return both[which]


def _save(where: Path, config: Any, tokenizer: Any, source: Path) -> None:
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".partial-", dir=where.parent))
        config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / "source.txt").write_text(f"{source}\n")
        try:
            os.rename(scratch, where)  # atomic: a concurrent converter's copy, if first, stays
        except OSError:
            shutil.rmtree(scratch, ignore_errors=True)
            if not where.is_dir():
                raise
        log.info("gguf_meta_cached", path=str(where), source=str(source))
    except OSError as exc:  # a read-only or full cache costs the next load a conversion, nothing more
        log.warning("gguf_meta_cache_not_written", path=str(where), error=str(exc))
