"""The disk tier's access counts at rest: one checksummed record under a reserved key of its directory.

The record sits beside the entries, under a key that is not a block hash in
hex, so the index rebuild skips it. It is rewritten whole (at ``flush``,
``close`` and every ``SAVE_EVERY`` count updates); a missing or damaged
record reads as no counts, and a failed write is logged, never raised::

    "TSAC" | u16 version | u32 n | n × (u8 key length, key, u64 count) | blake2b-16 of all before
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import diskcache
import structlog

log = structlog.get_logger(__name__)

ACCESS_COUNTS_KEY = "tierserve-access-counts"  # never a hex block hash: the index rebuild skips it
SAVE_EVERY = 1000  # count updates between background saves; flush and close save what is left

_MAGIC = b"TSAC"
_VERSION = 1
_HEADER = struct.Struct("<4sHI")
_KEY_LENGTH = struct.Struct("<B")
_COUNT = struct.Struct("<Q")
_CHECKSUM_SIZE = 16


def encode_counts(counts: Mapping[bytes, int]) -> bytes:
    """The record of ``counts`` (keys of at most 255 bytes, counts >= 0)."""
    parts = [_HEADER.pack(_MAGIC, _VERSION, len(counts))]
    for key, count in counts.items():
        parts += [_KEY_LENGTH.pack(len(key)), key, _COUNT.pack(count)]
    body = b"".join(parts)
    return body + hashlib.blake2b(body, digest_size=_CHECKSUM_SIZE).digest()


def decode_counts(data: bytes) -> dict[bytes, int]:
    """The counts in a record; ``ValueError`` says what is wrong with one that is damaged."""
    if len(data) < _HEADER.size + _CHECKSUM_SIZE:
        raise ValueError(f"{len(data)} bytes: shorter than a header and a checksum")
    body, checksum = data[:-_CHECKSUM_SIZE], data[-_CHECKSUM_SIZE:]
    if hashlib.blake2b(body, digest_size=_CHECKSUM_SIZE).digest() != checksum:
        raise ValueError("checksum mismatch")
    magic, version, n = _HEADER.unpack_from(body)
    if magic != _MAGIC or version != _VERSION:
        raise ValueError(f"magic {magic!r} version {version}, expected {_MAGIC!r} version {_VERSION}")
    counts: dict[bytes, int] = {}
    pos = _HEADER.size
    for _ in range(n):
        (length,) = _KEY_LENGTH.unpack_from(body, pos)
        pos += _KEY_LENGTH.size
        key = body[pos : pos + length]
        pos += length
        (counts[key],) = _COUNT.unpack_from(body, pos)
        pos += _COUNT.size
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} bytes after the last count")
    return counts


def load_counts(cache: diskcache.Cache, directory: Path) -> dict[bytes, int]:
    """The counts a previous run saved in ``cache``; none (logged) when the record is missing or damaged."""
    try:
        data = cache.get(ACCESS_COUNTS_KEY, default=None)
    except Exception as exc:
        data, reason = None, f"unreadable: {exc!r}"
    else:
        reason = "no record"
    if data is not None and not isinstance(data, bytes):
        reason, data = f"stored as {type(data).__name__}, not bytes", None
    if data is None:
        log.info("kv_disk_access_counts_missing", directory=str(directory), reason=reason, counts="zeros")
        return {}
    try:
        return decode_counts(data)
    except (ValueError, struct.error) as exc:
        log.warning("kv_disk_access_counts_damaged", directory=str(directory), reason=str(exc), counts="zeros")
        return {}


def save_counts(cache: diskcache.Cache, counts: Mapping[bytes, int], directory: Path) -> bool:
    """Write the record of ``counts``; False (logged) if the disk refused it."""
    try:
        cache.set(ACCESS_COUNTS_KEY, encode_counts(counts), retry=True)
    except Exception as exc:
        log.warning("kv_disk_access_counts_write_failed", directory=str(directory), error=repr(exc))
        return False
    return True


class CountsRecord:
    """A disk tier's counts record: whether the counts changed since the last save, and saving them.

    Args:
        cache: the tier's directory.
        directory: its path, for log lines.
        enabled: False for a tier that does not persist (nothing is saved or loaded).
    """

    def __init__(self, cache: diskcache.Cache, directory: Path, enabled: bool) -> None:
        self.cache = cache
        self.directory = directory
        self.enabled = enabled
        self.updates = 0  # count changes since the last save; the caller's lock guards it
        self._saving = threading.Lock()  # one save at a time, so the newest snapshot is written last

    def changed(self) -> bool:
        """Note one count change (caller holds the tier's lock); True when a background save is due."""
        self.updates += 1
        return self.enabled and self.updates % SAVE_EVERY == 0

    def save(self, lock: threading.RLock, snapshot: Callable[[], Mapping[bytes, int]]) -> None:
        """Write ``snapshot()`` (taken under ``lock``) if anything changed since the last save."""
        if not self.enabled:
            return
        with self._saving:
            with lock:
                if not self.updates:
                    return
                counts, self.updates = snapshot(), 0
            if not save_counts(self.cache, counts, self.directory):
                with lock:
                    self.updates += 1  # try again at the next flush

    def load(self) -> dict[bytes, int]:
        """What the previous run saved (none when disabled, missing or damaged)."""
        return load_counts(self.cache, self.directory) if self.enabled else {}
