"""A tierserve cache tier that keeps KV blocks in SQLite.

Written from tierserve's plugin documentation (docs/plugins.md) and the
docstrings of ``tierserve.plugin_api`` only.

Layout: one table ``blocks`` keyed by ``(fingerprint, key)``. Each row holds
the block's parent hash, its token ids (JSON), its KV tensor as raw bytes
(with dtype and shape), a blake2b checksum of that blob, the time the block was first
stored (for TTL) and its access count. The tier keeps a small in-memory index
(parent, created, stored size, raw size, access count) of the rows of its own
fingerprint so ``contains``, ``parent_of``, ``keys``, ``__len__`` and
``access_count`` never touch the database; the eviction policy tierserve hands
us orders those keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field

from tierserve.plugin_api import CacheEntry, CacheTier, TierCapacity, hookimpl

__all__ = ["SqliteTier", "SqliteTierSettings", "register_cache_tiers"]


class SqliteTierSettings(BaseModel):
    """The sqlite tier's own keys in its ``[[kv_cache.tiers]]`` entry."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="the SQLite database file (created if missing)")
    max_entries: int = Field(10_000, ge=1, description="KV blocks held at most")
    persistent: bool = Field(
        False,
        description="keep this model's entries across restarts; false deletes them when the tier starts",
    )
    synchronous: str = Field(
        "NORMAL",
        pattern="^(OFF|NORMAL|FULL)$",
        description="SQLite's PRAGMA synchronous (WAL journal)",
    )


@dataclass
class _Meta:
    parent: bytes | None
    created: float
    stored: int  # bytes of the kv blob as stored
    raw: int  # kv.nbytes
    accesses: int


_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    fingerprint TEXT NOT NULL,
    key         BLOB NOT NULL,
    parent      BLOB,
    token_ids   TEXT NOT NULL,
    kv          BLOB NOT NULL,
    dtype       TEXT NOT NULL,
    shape       TEXT NOT NULL,
    checksum    BLOB NOT NULL,
    created     REAL NOT NULL,
    accesses    INTEGER NOT NULL DEFAULT 0,
    raw_bytes   INTEGER NOT NULL,
    PRIMARY KEY (fingerprint, key)
) WITHOUT ROWID
"""


def _fingerprint_text(fingerprint: object) -> str:
    # The docs do not say what type ``fingerprint`` is; accept str or bytes (or anything with a stable str()).
    if isinstance(fingerprint, (bytes, bytearray)):
        return bytes(fingerprint).hex()
    return str(fingerprint)


_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8)}


def _dump(kv: torch.Tensor) -> tuple[bytes, str, str]:
    """The tensor's raw bytes, dtype and shape. Only the view's own bytes are written (the ``kv`` handed to
    ``put`` may be a view of a larger storage, which ``torch.save`` would write whole)."""
    kv = kv.detach().to("cpu").contiguous()
    blob = kv.reshape(-1).view(torch.uint8).numpy().tobytes()
    return blob, str(kv.dtype), json.dumps(list(kv.shape))


def _load(blob: bytes, dtype: str, shape: str) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return flat.view(_DTYPES[dtype]).reshape(json.loads(shape))


def _checksum(blob: bytes) -> bytes:
    return hashlib.blake2b(blob, digest_size=16).digest()


class SqliteTier(CacheTier):
    """KV blocks in one SQLite file, bounded by ``max_entries``, ordered by the configured eviction policy."""

    medium = "disk"
    shared = False

    def __init__(self, tier, policy_factory, fingerprint) -> None:
        super().__init__()
        options = tier.options_as(SqliteTierSettings)
        self.name = tier.name
        self.options = options
        self.path = os.path.expanduser(options.path)
        self.fingerprint = _fingerprint_text(fingerprint)
        ttl = tier.ttl_seconds
        self.ttl: float | None = float(ttl) if ttl else None
        self.max_entries = options.max_entries
        self.policy = policy_factory(options.max_entries)

        self._index: dict[bytes, _Meta] = {}
        self._pinned: set[bytes] = set()
        self._stored_bytes = 0
        self._raw_bytes = 0
        self._closed = False

        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        # One connection shared by every thread, always used under self.lock.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={options.synchronous}")
        if self._db.execute("PRAGMA user_version").fetchone()[0] != _SCHEMA_VERSION:
            self._db.execute("DROP TABLE IF EXISTS blocks")  # another layout: its rows are of no use
            self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        self._db.execute(_SCHEMA)

        # Figures of our own (docs/plugins.md, "Publishing your own figures").
        self.rows_written = self.figures.counter("rows_written", "KV blocks written to SQLite")
        self.rows_read = self.figures.counter("rows_read", "KV blocks read from SQLite (hits)")
        self.rows_deleted = self.figures.counter("rows_deleted", "rows deleted: evicted, expired, corrupt or removed")
        self.figures.gauge("file_bytes", "size of the database file and its WAL", read=self._file_bytes)
        self.figures.gauge("rows", "rows of this model held", read=lambda: float(len(self._index)))

        with self.lock:
            if options.persistent:
                self._load_index()
            else:
                self._db.execute("DELETE FROM blocks WHERE fingerprint = ?", (self.fingerprint,))
            self._update_stats()

    # ------------------------------------------------------------------ helpers (call under self.lock)

    def _file_bytes(self) -> float:
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.path.getsize(self.path + suffix)
            except FileNotFoundError:
                pass
        return float(total)

    def _load_index(self) -> None:
        rows = self._db.execute(
            "SELECT key, parent, created, length(kv), raw_bytes, accesses FROM blocks WHERE fingerprint = ?"
            " ORDER BY created",
            (self.fingerprint,),
        ).fetchall()
        for key, parent, created, stored, raw, accesses in rows:
            if len(self._index) >= self.max_entries:
                self._db.execute("DELETE FROM blocks WHERE fingerprint = ? AND key = ?", (self.fingerprint, key))
                continue
            key = bytes(key)
            self._index[key] = _Meta(bytes(parent) if parent is not None else None, created, stored, raw, accesses)
            self._stored_bytes += stored
            self._raw_bytes += raw
            self.policy.insert(key, 1)

    def _update_stats(self) -> None:
        self.stats.stored_bytes = self._stored_bytes
        self.stats.raw_bytes = self._raw_bytes

    def _forget(self, key: bytes) -> _Meta | None:
        """Drop ``key`` from the index, the policy, the pins and the database."""
        meta = self._index.pop(key, None)
        if meta is None:
            return None
        if key in self.policy:
            self.policy.remove(key)
        self._pinned.discard(key)
        self._stored_bytes -= meta.stored
        self._raw_bytes -= meta.raw
        self._db.execute("DELETE FROM blocks WHERE fingerprint = ? AND key = ?", (self.fingerprint, key))
        self.rows_deleted.inc()
        self._update_stats()
        return meta

    def _expired(self, key: bytes, meta: _Meta) -> bool:
        return self.ttl is not None and key not in self._pinned and time.time() - meta.created > self.ttl

    def _expire_if_due(self, key: bytes) -> bool:
        """Delete ``key`` if its TTL ran out (pinned keys never expire); True if it did."""
        meta = self._index.get(key)
        if meta is None or not self._expired(key, meta):
            return False
        self._forget(key)
        self.stats.expirations += 1
        self.note_removed(key)
        return True

    def _expire_all(self) -> None:
        if self.ttl is None:
            return
        for key, meta in list(self._index.items()):
            if self._expired(key, meta):
                self._expire_if_due(key)

    def _read(self, key: bytes) -> CacheEntry | None:
        """Read the stored entry (``accesses`` = 0), or delete it as corrupt and return None."""
        row = self._db.execute(
            "SELECT parent, token_ids, kv, dtype, shape, checksum, created FROM blocks WHERE fingerprint = ? AND key = ?",
            (self.fingerprint, key),
        ).fetchone()
        try:
            if row is None:
                raise ValueError("row missing")
            parent, token_ids, blob, dtype, shape, checksum, created = row
            blob = bytes(blob)
            if _checksum(blob) != bytes(checksum):
                raise ValueError("checksum mismatch")
            kv = _load(blob, dtype, shape)
            tokens = tuple(int(t) for t in json.loads(token_ids))
        except Exception:
            self._forget(key)
            self.stats.corrupt += 1
            self.note_removed(key)
            return None
        return CacheEntry(
            key=key,
            parent=bytes(parent) if parent is not None else None,
            token_ids=tokens,
            kv=kv,
            created=created,
            accesses=0,
        )

    def _take_out(self, key: bytes) -> CacheEntry | None:
        """An evicted key: read its entry (carrying its access count) and delete it."""
        meta = self._index.get(key)
        entry = self._read(key) if meta is not None else None
        if entry is None:  # corrupt: already deleted, counted and noted
            return None
        entry.accesses = meta.accesses
        self._forget(key)
        return entry

    # ------------------------------------------------------------------ CacheTier

    @property
    def capacity(self) -> TierCapacity:
        return TierCapacity(entries=self.max_entries, bytes=None)

    def put(self, entry: CacheEntry) -> list[CacheEntry]:
        key = bytes(entry.key)
        blob, dtype, shape = _dump(entry.kv)
        raw = int(entry.kv.nelement() * entry.kv.element_size())
        tokens = json.dumps([int(t) for t in entry.token_ids])
        parent = bytes(entry.parent) if entry.parent is not None else None
        started = time.perf_counter()
        evicted: list[CacheEntry] = []
        with self.lock:
            if self._closed:
                return [entry]
            old = self._index.get(key)
            if old is None:
                if len(self._index) >= self.max_entries:
                    self._expire_all()  # expired entries make room before live ones are evicted
                # Make room; a tier whose other entries are all pinned gives up the newcomer.
                while len(self._index) >= self.max_entries:
                    victim = self.policy.evict()
                    if victim is None:
                        return evicted + [entry]
                    gone = self._take_out(victim)
                    self.stats.evictions += 1
                    if gone is not None:
                        evicted.append(gone)
                created = entry.created
                accesses = max(0, int(entry.accesses))
            else:
                created = old.created  # "created: when first stored": a replacement keeps it
                accesses = max(0, old.accesses + int(entry.accesses))
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO blocks"
                    " (fingerprint, key, parent, token_ids, kv, dtype, shape, checksum, created, accesses, raw_bytes)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (self.fingerprint, key, parent, tokens, blob, dtype, shape, _checksum(blob), created, accesses, raw),
                )
            except sqlite3.Error:
                self.stats.write_errors += 1
                if old is not None:
                    self._forget(key)
                    self.note_removed(key)
                return evicted + [entry]
            if old is not None:
                self._stored_bytes -= old.stored
                self._raw_bytes -= old.raw
            self._index[key] = _Meta(parent, created, len(blob), raw, accesses)
            self._stored_bytes += len(blob)
            self._raw_bytes += raw
            self.policy.insert(key, 1)
            self.stats.puts += 1
            self.stats.put_seconds += time.perf_counter() - started
            self.rows_written.inc()
            self._update_stats()
        return evicted

    def get(self, key: bytes) -> CacheEntry | None:
        key = bytes(key)
        started = time.perf_counter()
        with self.lock:
            try:
                if self._closed or key not in self._index or self._expire_if_due(key):
                    self.stats.misses += 1
                    return None
                entry = self._read(key)
                if entry is None:
                    self.stats.misses += 1
                    return None
                meta = self._index[key]
                meta.accesses += 1
                self._db.execute(
                    "UPDATE blocks SET accesses = ? WHERE fingerprint = ? AND key = ?",
                    (meta.accesses, self.fingerprint, key),
                )
                self.policy.touch(key)
                self.stats.hits += 1
                self.rows_read.inc()
                return entry
            finally:
                self.stats.get_seconds += time.perf_counter() - started

    def contains(self, key: bytes) -> bool:
        key = bytes(key)
        with self.lock:
            return key in self._index and not self._expire_if_due(key)

    def parent_of(self, key: bytes) -> bytes | None:
        with self.lock:
            meta = self._index.get(bytes(key))
            return meta.parent if meta is not None else None

    def remove(self, key: bytes) -> None:
        with self.lock:
            if not self._closed:
                self._forget(bytes(key))

    def clear(self) -> int:
        with self.lock:
            count = len(self._index)
            for key in list(self._index):
                if key in self.policy:
                    self.policy.remove(key)
            self._index.clear()
            self._pinned.clear()
            self._stored_bytes = 0
            self._raw_bytes = 0
            if not self._closed:
                self._db.execute("DELETE FROM blocks WHERE fingerprint = ?", (self.fingerprint,))
            self.rows_deleted.inc(count)
            self._update_stats()
            return count

    def keys(self) -> Iterator[bytes]:
        with self.lock:
            return iter(list(self._index))

    def __len__(self) -> int:
        with self.lock:
            return len(self._index)

    @property
    def bytes_used(self) -> int:
        with self.lock:
            return self._stored_bytes

    def access_count(self, key: bytes) -> int:
        with self.lock:
            meta = self._index.get(bytes(key))
            return meta.accesses if meta is not None else 0

    def add_accesses(self, key: bytes, count: int) -> None:
        key = bytes(key)
        with self.lock:
            meta = self._index.get(key)
            if meta is None:
                return
            meta.accesses = max(0, meta.accesses + int(count))
            if not self._closed:
                self._db.execute(
                    "UPDATE blocks SET accesses = ? WHERE fingerprint = ? AND key = ?",
                    (meta.accesses, self.fingerprint, key),
                )

    def pin(self, key: bytes) -> None:
        key = bytes(key)
        with self.lock:
            if key not in self._index or key in self._pinned:
                return
            self._pinned.add(key)
            self.policy.pin(key)

    def unpin(self, key: bytes) -> None:
        key = bytes(key)
        with self.lock:
            if key not in self._pinned:
                return
            self._pinned.discard(key)
            if key in self._index:
                self.policy.unpin(key)

    def flush(self, timeout: float | None = None) -> None:
        with self.lock:
            if not self._closed:
                self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                self._db.close()


@hookimpl
def register_cache_tiers(register):
    register("sqlite", SqliteTier, settings=SqliteTierSettings, description="KV blocks in SQLite")
