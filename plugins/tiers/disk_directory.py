"""The disk tier's directory: its settings, a ``diskcache.Cache`` that reads bytes only, and what a previous run left.

The tier keeps its own index and eviction policy over the directory, so
diskcache's own culling is off and lookups never touch SQLite; this module
is what touches the files and the SQLite table directly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import diskcache
import structlog
from pydantic import BaseModel, ConfigDict, Field

from tierserve.cache.codec import CorruptEntryError
from tierserve.core.errors import TierserveError
from tierserve.plugins.tiers.disk_counts import ACCESS_COUNTS_KEY
from tierserve.plugins.tiers.disk_recovery import check_index, is_corrupt_index

log = structlog.get_logger(__name__)

_DISKCACHE_SIZE_LIMIT = 2**62  # diskcache must never cull on its own; the tier's policy bounds the bytes

Row = tuple[object, object, int, float]  # (hex key, tag = hex parent, bytes on disk, store time)
Previous = tuple[bytes, bytes | None, int, float]  # (key, parent, bytes on disk, store time)


class DiskTierSettings(BaseModel):
    """A ``plugin = "disk"`` tier's own keys in its ``[[kv_cache.tiers]]`` entry."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="the cache directory (created if missing; ~ is expanded)")
    max_bytes: int = Field(10 * 1024**3, ge=0, description="bytes on disk; 0: no byte bound")
    persistent: bool = Field(
        False, description="keep entries across restarts and rebuild the index at start; false clears the directory"
    )
    compression_level: int = Field(3, ge=1, le=22, description="zstd level")
    write_queue: int = Field(256, gt=0, description="pending writes before new ones are dropped")
    writer_nice: int = Field(
        10, ge=0, le=19, description="added to the writer thread's niceness, so disk writes yield the CPU to decoding"
    )


class BytesOnlyDisk(diskcache.Disk):
    """Reads values as bytes only: a value stored any other way (a pickle) is refused, not loaded; writes
    a bytes value to its file in one call."""

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        # diskcache's own store iterates an io.BytesIO, which yields the bytes line by line: a KV block of
        # ~200-400 KB became ~800-1500 writes from a Python loop, on the writer thread, holding the GIL
        # between them, while decoding needs the CPU. The file's bytes and the row are the same.
        if type(value) is bytes and len(value) >= self.min_file_size:
            filename, full_path = self.filename(key, value)
            self._write(full_path, (value,), "xb")
            return len(value), diskcache.core.MODE_BINARY, filename, None
        return super().store(value, read, key)

    def fetch(self, mode, filename, value, read):
        if mode != diskcache.core.MODE_BINARY:
            raise CorruptEntryError(f"value stored in diskcache mode {mode}, not as a file of bytes")
        return super().fetch(mode, filename, value, read)


def open_directory(directory: Path, tier_name: str) -> diskcache.Cache:
    """The tier's ``diskcache.Cache`` in ``directory``, bytes only, never culling by itself.

    A corrupt index raises an error ``disk_recovery.is_corrupt_index`` recognises (checked on a
    connection of its own first); any other failure, ``TierserveError`` naming the directory."""
    try:
        check_index(directory)
        return diskcache.Cache(
            str(directory),
            disk=BytesOnlyDisk,
            eviction_policy="none",
            disk_min_file_size=0,
            size_limit=_DISKCACHE_SIZE_LIMIT,
        )
    except Exception as exc:
        if is_corrupt_index(exc):
            raise  # not a permission problem: the disk tier moves the index aside and starts again
        raise TierserveError(
            f"cannot open the cache directory {str(directory)!r} (path of tier {tier_name!r}): {exc}; "
            "point path at a writable directory"
        ) from exc


def previous_entries(cache: diskcache.Cache, on_unreadable: Callable[[], None]) -> tuple[list[Previous], int]:
    """The entries a previous run of the tier left, oldest first, and how many values were
    skipped as not its own (the access counts record is neither)."""
    entries, skipped = [], 0
    for hexkey, tag, size, store_time in stored_rows(cache, on_unreadable):
        if hexkey == ACCESS_COUNTS_KEY:
            continue
        try:
            key = bytes.fromhex(hexkey)
            parent = bytes.fromhex(tag) if tag else None
        except (TypeError, ValueError):
            key = parent = None
        if key is None or key.hex() != hexkey:
            skipped += 1  # not written by this tier; leave it alone
            continue
        entries.append((key, parent, size, store_time))
    return entries, skipped


def stored_rows(cache: diskcache.Cache, on_unreadable: Callable[[], None]) -> list[Row]:
    """Every stored value's key, tag, size and store time, oldest first.

    One SQL query over diskcache's table; if that fails, a walk over the keys
    that deletes (and reports through ``on_unreadable``) what it cannot read.
    """
    try:
        return _rows_from_sql(cache)
    except Exception as exc:
        if is_corrupt_index(exc):
            raise  # the disk tier moves the index aside (disk_recovery); a walk would fail the same way
        log.warning("kv_disk_index_sql_failed", error=repr(exc), fallback="diskcache iteration")
        return _rows_from_api(cache, on_unreadable)


def _rows_from_sql(cache: diskcache.Cache) -> list[Row]:
    # diskcache's table, read directly: one query instead of one per key.
    return cache._sql("SELECT key, tag, size, store_time FROM Cache WHERE raw = 1 ORDER BY store_time").fetchall()


def _rows_from_api(cache: diskcache.Cache, on_unreadable: Callable[[], None]) -> list[Row]:
    rows = []
    for hexkey in cache.iterkeys():
        try:
            handle, tag = cache.get(hexkey, default=None, read=True, tag=True)
            if handle is None:
                continue
            with handle:
                info = os.fstat(handle.fileno())
        except Exception as exc:
            log.warning("kv_disk_corrupt_entry", key=str(hexkey), reason=f"unreadable: {exc!r}")
            on_unreadable()
            try:
                cache.delete(hexkey)
            except Exception:
                pass  # already logged as corrupt; a delete that fails leaves an unindexed file
            continue
        rows.append((hexkey, tag, info.st_size, info.st_mtime))
    rows.sort(key=lambda row: row[3])
    return rows
