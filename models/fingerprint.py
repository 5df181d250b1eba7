"""Checkpoint fingerprints: the id a backend puts into every cache key, so KV from other weights never matches."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tierserve.models.gguf import gguf_fingerprint, is_gguf


def hash_file_ends(digest, name: str, handle, size: int, sample: int = 1 << 20) -> None:
    """Feed ``digest`` a weight file's name, size and up to ``sample`` bytes from its start and its end."""
    digest.update(f"{name}:{size}".encode())
    handle.seek(0)
    digest.update(handle.read(sample))
    if size > 2 * sample:
        handle.seek(size - sample)
        digest.update(handle.read(sample))


def checkpoint_fingerprint(directory, *extra: str) -> str:
    """A stable id for a checkpoint's weights plus ``extra`` (dtype, backend, ...).

    Hashes config.json, each weight file's name and size, its safetensors
    header (tensor names, shapes, offsets) and up to 1 MiB from its start and
    end: cheap even for large checkpoints, and any retrained or re-quantised
    weights change it. A GGUF file's names its quantization types
    (``models.gguf.gguf_fingerprint``).
    """
    root = Path(directory)
    if is_gguf(root):
        return gguf_fingerprint(root, *extra)
    digest = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(list(root.glob("*.safetensors")) + list(root.glob("*.bin"))):
        with open(path, "rb") as handle:
            hash_file_ends(digest, path.name, handle, path.stat().st_size)
    for item in extra:
        digest.update(b"\0" + item.encode())
    return digest.hexdigest()[:32]
