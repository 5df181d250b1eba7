"""GGUF model files (llama.cpp's format): find the file, check it whole, and read its metadata.

A ``.gguf`` file carries everything a Hugging Face directory splits over
config.json, tokenizer files and safetensors. It is parsed once by
``models.gguf_reader`` (header and metadata, tensors memory-mapped) and turned
into a transformers config and tokenizer by transformers' GGUF support, cached
after the first conversion (``models.gguf_transformers``); llama.cpp's ``gguf``
package supplies the type names and the dequantizers. ``check_gguf`` runs
before any weight is loaded, so a truncated or corrupt file, an architecture
transformers cannot read or a tensor type nothing can dequantize is refused up
front, not half-loaded.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierserve.core.errors import ConfigError
from tierserve.models.gguf_reader import ARRAY, GGUFFile, GGUFFormatError

SUFFIX = ".gguf"
FLOAT_TYPES = ("F32", "F16", "BF16")  # loaded as they are
INSTALL_HINT = "GGUF model files need the gguf package: pip install 'tierserve[gguf]'"


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where one tensor lies in a GGUF file and what it holds."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    offset: int
    n_bytes: int
    n_elements: int


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """What a GGUF file holds, as far as loading it needs to know.

    Attributes:
        path: the file.
        architecture: ``general.architecture`` as llama.cpp writes it (``llama``, ``qwen2``, ...).
        file_type: ``general.file_type`` by name (``MOSTLY_Q8_0``), or ``"unknown"``.
        tensor_types: how many tensors of each GGML type (``{"Q8_0": 84, "F32": 25}``).
        scalars: every metadata field that holds one number or string (arrays, the vocabulary, left out).
        tensors: each tensor's layout, in file order (what the fingerprint and the memory estimate read).
    """

    path: Path
    architecture: str
    file_type: str
    tensor_types: dict[str, int]
    scalars: dict[str, Any]
    tensors: tuple[TensorLayout, ...] = ()

    @property
    def quantization(self) -> str:
        """The tensor types, most common first (``Q8_0+F32``): the fingerprint names it."""
        return "+".join(name for name, _ in sorted(self.tensor_types.items(), key=lambda kv: (-kv[1], kv[0])))


def is_gguf(path: Path) -> bool:
    """Whether a resolved ``model.path`` is a GGUF file (else it is a checkpoint directory)."""
    return path.suffix.lower() == SUFFIX and path.is_file()


def find_gguf(directory: Path, gguf_file: str | None, shown: str) -> Path | None:
    """The GGUF file ``model.path`` (``shown``) and ``model.gguf_file`` name, or ``None`` for a Hugging Face directory.

    Raises:
        ConfigError: ``model.gguf_file`` set for a path that is not a directory, or naming no file in it.
    """
    if gguf_file is None:
        return directory.absolute() if directory.is_file() and directory.suffix.lower() == SUFFIX else None
    if not directory.is_dir():
        raise ConfigError(
            f"model.gguf_file = {gguf_file!r} names a file inside the directory model.path, but model.path "
            f"{shown!r} is not a directory; set model.path to the .gguf file itself, or to its directory"
        )
    file = directory / gguf_file
    if not file.is_file():
        found = sorted(p.name for p in directory.glob(f"*{SUFFIX}"))
        raise ConfigError(
            f"model.gguf_file = {gguf_file!r}: no such file in {directory}; "
            f"GGUF files there: {', '.join(found) or 'none'}"
        )
    if file.suffix.lower() != SUFFIX:
        raise ConfigError(
            f"model.gguf_file = {gguf_file!r}: a GGUF file's name ends in {SUFFIX}; rename the file to end in it"
        )
    return file.absolute()


def open_reader(path: Path) -> GGUFFile:
    """The file parsed (header and metadata read once, tensors memory-mapped); unreadable is a ``ConfigError``."""
    try:
        return GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError, OverflowError, MemoryError) as exc:
        raise ConfigError(
            f"model.path {str(path)!r} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "it may be truncated or corrupt: download or convert it again"
        ) from None


def check_gguf(path: Path) -> GGUFInfo:
    """Read and check a GGUF file's header: every tensor lies inside the file, every type is loadable,
    the architecture is one transformers reads from GGUF.

    Raises:
        ConfigError: naming what was found and what is supported.
    """
    return _checked(path, path.stat().st_size, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _checked(path: Path, size: int, mtime_ns: int) -> GGUFInfo:
    try:
        from gguf import GGMLQuantizationType, LlamaFileType
    except ImportError:
        raise ConfigError(f"model.path {str(path)!r}: {INSTALL_HINT}") from None

    reader = open_reader(path)  # every text field is decoded by the reader: corrupt metadata is refused here
    shown = str(path)
    try:
        scalars = {key: field.value for key, field in reader.fields.items() if field.value_type != ARRAY}
        architecture = scalars.get("general.architecture")
        if not isinstance(architecture, str):
            raise ConfigError(
                f"model.path {shown!r}: the GGUF file has no general.architecture; it is not a model file"
            )
        supported = supported_architectures()
        if architecture not in supported:
            raise ConfigError(
                f"model.path {shown!r}: GGUF architecture {architecture!r} cannot be loaded; "
                f"supported: {', '.join(sorted(supported))}"
            )
        loadable = loadable_types()
        types: Counter[str] = Counter()
        layout: list[TensorLayout] = []
        for tensor in reader.tensors:  # the reader checked each lies inside the file and is whole blocks
            try:
                kind_name = GGMLQuantizationType(tensor.tensor_type).name
            except ValueError:
                kind_name = f"type-{tensor.tensor_type}"
            if kind_name not in loadable:
                raise ConfigError(
                    f"model.path {shown!r}: tensor {tensor.name!r} has GGML type {kind_name}, which cannot be "
                    f"loaded; supported: {', '.join(loadable)}"
                )
            types[kind_name] += 1
            layout.append(TensorLayout(tensor.name, tensor.tensor_type, tensor.shape, tensor.offset, tensor.n_bytes,
                                       tensor.n_elements))  # fmt: skip
    finally:
        reader.close()
    if not types:
        raise ConfigError(f"model.path {shown!r}: the GGUF file holds no tensors")
    file_type = scalars.get("general.file_type")
    try:
        file_type_name = LlamaFileType(file_type).name if file_type is not None else "unknown"
    except ValueError:
        file_type_name = f"type-{file_type}"
    return GGUFInfo(path, architecture, file_type_name, dict(types), scalars, tuple(layout))


def supported_architectures() -> frozenset[str]:
    """``general.architecture`` values transformers builds a config from."""
    # the mapping transformers' GGUF loader takes its supported list from, without the loader itself (which
    # imports torch: the HTTP process checks files too)
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return frozenset(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}  # metadata sections, not models


def loadable_types() -> tuple[str, ...]:
    """GGML tensor types that load: the float ones as they are, the rest through the gguf package's dequantizers."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    names = [kind.name for kind in GGMLQuantizationType if kind.name in FLOAT_TYPES]
    for kind in GGMLQuantizationType:
        quant = getattr(gguf.quants, kind.name, None)
        if kind.name not in FLOAT_TYPES and quant is not None and hasattr(quant, "dequantize_blocks"):
            names.append(kind.name)
    return tuple(names)


def load_config(path: Path):
    """The transformers config transformers builds from the file's metadata (converted once, then cached)."""
    from tierserve.models.gguf_transformers import converted_config

    info = check_gguf(path)
    try:
        config = converted_config(path)
    except (ValueError, KeyError, TypeError, NotImplementedError, OSError) as exc:
        raise ConfigError(f"model.path {str(path)!r}: transformers cannot build a config from it: {exc}") from None
    # transformers maps head_dim from rope.dimension_count for llama only; qwen3's (128 by default) is wrong
    # whenever the file says otherwise, so the key length the file records wins
    key_length = info.scalars.get(f"{info.architecture}.attention.key_length")
    if isinstance(key_length, int) and hasattr(config, "head_dim"):
        config.head_dim = key_length
    return config


def config_dict(path: Path) -> dict[str, Any]:
    """The config's values as a dict: the cached conversion's config.json read as JSON (no transformers import,
    which the HTTP process's memory estimate would otherwise pay before the engine starts), else ``load_config``."""
    import json

    from tierserve.models.gguf_transformers import cached_config_file

    cached = cached_config_file(path)
    if cached is not None:
        try:
            return json.loads(cached.read_text())
        except (OSError, ValueError):
            pass
    return load_config(path).to_dict()


def load_tokenizer(path: Path):
    """The tokenizer (chat template included) transformers builds from the file's metadata (converted once, cached)."""
    from tierserve.models.gguf_transformers import converted_tokenizer

    check_gguf(path)
    try:
        return converted_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own bare Exception on a corrupt vocabulary
        raise ConfigError(f"model.path {str(path)!r}: transformers cannot build its tokenizer: {exc}") from None


def end_of_generation_ids(path: Path) -> set[int]:
    """The token ids llama.cpp ends generation on: the file's eos, eot and eom tokens."""
    scalars = check_gguf(path).scalars
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return {int(scalars[key]) for key in keys if isinstance(scalars.get(key), int)}


def gguf_fingerprint(path: Path, *extra: str) -> str:
    """A stable id for a GGUF file's weights plus ``extra``: its quantization types by name, its size,
    its first and last MiB (header, metadata, first and last tensors), and every tensor's name, type, shape,
    offset and first 4 KiB (in a real file the first MiB is all vocabulary, so each tensor is sampled too)."""
    from tierserve.models.fingerprint import hash_file_ends

    info = check_gguf(path)
    digest = hashlib.sha256(f"gguf:{info.architecture}:{info.file_type}:{info.quantization}".encode())
    with open(path, "rb") as handle:
        hash_file_ends(digest, path.name, handle, path.stat().st_size)
        for tensor in info.tensors:  # the layout the check read: the header is parsed once
            shape = ",".join(str(d) for d in tensor.shape)
            digest.update(f"{tensor.name}:{tensor.tensor_type}:{shape}:{tensor.offset}".encode())
            handle.seek(tensor.offset)
            digest.update(handle.read(min(4096, tensor.n_bytes)))
    for item in extra:
        digest.update(b"\0" + item.encode())
    return digest.hexdigest()[:32]
