"""A disk tier directory whose SQLite index is damaged: move the index aside, index the value files again.

    PRAGMA quick_check, the open or the first read of the index fails as corrupt
        ──► cache.db (and its -wal, -shm) renamed to cache.db.corrupt-<UTC time>, kept for inspection
        ──► a fresh index ──► each value file, oldest first: an intact entry of this model (or the
            access-counts record) is stored again under its key; anything else is deleted and counted

The value files carry their own key and parent in the codec's header, so the
entries survive the loss of the index that named them.
"""

from __future__ import annotations

import sqlite3
import struct
import time
from pathlib import Path

import diskcache
import structlog

from tierserve.cache.codec import CorruptEntryError, KVCodec
from tierserve.plugins.tiers.disk_counts import ACCESS_COUNTS_KEY, decode_counts

log = structlog.get_logger(__name__)

INDEX_NAME = diskcache.core.DBNAME  # "cache.db"
_SIDECARS = ("", "-wal", "-shm")  # SQLite's write-ahead log and shared memory belong to the index
_CORRUPT_ERRORS = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


class CorruptIndexError(Exception):
    """SQLite's integrity check found the index damaged."""


def is_corrupt_index(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is SQLite finding a damaged or foreign database file."""
    while exc is not None:
        if isinstance(exc, CorruptIndexError):
            return True
        if isinstance(exc, sqlite3.DatabaseError):
            return getattr(exc, "sqlite_errorname", "").startswith(_CORRUPT_ERRORS)
        exc = exc.__cause__
    return False


def check_index(directory: Path) -> None:
    """Raise (``is_corrupt_index``) if the index in ``directory`` is damaged, checked on a connection
    of its own that is closed before this returns: a connection left open on a damaged index
    writes into it when collected, and deletes the WAL file of whatever index has its name by then."""
    path = directory / INDEX_NAME
    if not path.exists():
        return
    connection = sqlite3.connect(path)
    try:
        problems = [row[0] for row in connection.execute("PRAGMA quick_check").fetchall()]
    finally:
        connection.close()
    if problems != ["ok"]:
        raise CorruptIndexError(f"PRAGMA quick_check: {'; '.join(problems[:3])}")


def move_index_aside(directory: Path) -> Path:
    """Rename the index files with a ``.corrupt-<UTC time>`` suffix; returns where ``cache.db`` went."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    suffix, n = f".corrupt-{stamp}", 1
    while any((directory / f"{INDEX_NAME}{sidecar}{suffix}").exists() for sidecar in _SIDECARS):
        n += 1
        suffix = f".corrupt-{stamp}-{n}"
    for sidecar in _SIDECARS:
        path = directory / f"{INDEX_NAME}{sidecar}"
        if path.exists():
            path.rename(directory / f"{INDEX_NAME}{sidecar}{suffix}")
    return directory / f"{INDEX_NAME}{suffix}"


def value_files(directory: Path) -> list[Path]:
    """The value files under ``directory``, oldest first."""
    files = []
    for path in directory.rglob("*.val"):
        try:
            files.append((path.stat().st_mtime, path))
        except FileNotFoundError:
            continue
    return [path for _, path in sorted(files)]


def reindex_values(cache: diskcache.Cache, files: list[Path], codec: KVCodec) -> tuple[int, int]:
    """Store each file again in ``cache`` under the key its header names (an intact entry of
    ``codec``'s model), or as the access-counts record; then delete it. Returns
    (entries restored, files deleted as damaged, foreign or unwritable)."""
    restored = lost = 0
    for path in files:
        try:
            data = path.read_bytes()
            key, tag = _key_of(data, codec)
            if key is None:
                lost += 1
                log.warning("kv_disk_corrupt_entry", file=str(path), reason="not an intact entry of this model")
            else:
                cache.set(key, data, tag=tag, retry=True)
                restored += key != ACCESS_COUNTS_KEY
            path.unlink()
        except OSError as exc:  # unreadable, or the disk refused the copy: the entry is lost, not the start
            lost += 1
            log.warning("kv_disk_reindex_failed", file=str(path), error=repr(exc))
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # logged above; an unindexed file is left behind
    return restored, lost


def _key_of(data: bytes, codec: KVCodec) -> tuple[str | None, str | None]:
    """(diskcache key, tag) a value file is stored under; (None, None) for one to delete."""
    try:
        entry = codec.decode(data)
    except CorruptEntryError:
        pass
    else:
        return entry.key.hex(), entry.parent.hex() if entry.parent else None
    try:
        decode_counts(data)
    except (ValueError, struct.error):
        return None, None
    return ACCESS_COUNTS_KEY, None
