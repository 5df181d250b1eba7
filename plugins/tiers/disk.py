"""L3: KV blocks on local disk, one zstd file per block, written in the background; registers the "disk" tier.

The directory is a ``diskcache.Cache`` (SQLite index + one value file per
entry, keyed by the block hash in hex, tagged with the parent hash). This
tier keeps its own index and eviction policy over it, so lookups and
eviction choices never touch SQLite; diskcache's own culling is off.

    put ──► bounded queue (full: drop) ──► writer thread: encode, make room (none: drop), write, index
    get ──► queued? ──► indexed? ──► read file ──► decode (corrupt: delete, miss)

A persistent tier also keeps its entries' access counts across restarts, in
one record of the directory (``disk_counts``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import diskcache
import structlog

from tierserve.cache.codec import CorruptEntryError, KVCodec
from tierserve.cache.tier import CacheEntry, CacheTier, TierCapacity, WriteTally
from tierserve.cache.write_queue import QueuedTier, TierWriter
from tierserve.core.errors import TierserveError
from tierserve.core.hookspecs import hookimpl
from tierserve.plugins.tiers.disk_counts import CountsRecord
from tierserve.plugins.tiers.disk_directory import DiskTierSettings, open_directory, previous_entries
from tierserve.plugins.tiers.disk_recovery import (
    INDEX_NAME,
    is_corrupt_index,
    move_index_aside,
    reindex_values,
    value_files,
)
from tierserve.plugins.tiers.disk_index import DiskIndex, StoredEntry

if TYPE_CHECKING:
    from tierserve.cache.eviction import EvictionPolicy
    from tierserve.core.tier_settings import TierSettings

log = structlog.get_logger(__name__)


_UNBOUNDED = 2**63 - 1  # policy capacity (entries) when max_bytes is 0 (no byte bound)


class DiskTier(QueuedTier, CacheTier):
    """A persistent (or spill-only) tier in its ``path``, bounded by ``max_bytes`` (``DiskTierSettings``).

    ``put`` only enqueues: one writer thread encodes and writes, so callers
    never wait on the disk. A put that finds the queue
    (``write_queue`` entries) full is dropped and counted (``put_waiting``,
    a warm's write, waits for room until its deadline first); queued entries
    are already visible to ``contains``/``get``. A key already on disk is not
    rewritten (keys are content hashes, the bytes would be the same): it
    counts as a use. Evicted entries are deleted, not returned (there is no
    tier below).

    The files never add up to more than ``max_bytes``: the writer makes room
    before it writes, evicting what the policy chooses, then held entries
    (``hold``) leaves first; when only pinned entries are left the write is
    dropped and counted (``dropped_writes``), and a pinned entry stays.

    With ``persistent`` off the directory's entries are deleted at start; with
    it on, the index is rebuilt from what is there. A corrupt SQLite index is
    moved aside, logged and counted (``corrupt_indexes``), and the tier starts
    on a fresh one: holding the value files' entries again (persistent) or
    empty. Disk faults (full, read only, a missing, truncated, damaged or
    foreign file) are logged and counted, never raised: a bad entry is
    deleted and reads as a miss.
    ``max_bytes`` 0 means no byte bound; ``ttl_seconds`` None or 0, no expiry.
    A persistent tier saves its access counts at ``flush`` and ``close`` and in
    the background every ``disk_counts.SAVE_EVERY`` updates; a missing or
    damaged record reads as zeros.
    """

    name = "disk"
    medium = "disk"

    def __init__(
        self, tier: TierSettings, policy_factory: Callable[[int], EvictionPolicy], fingerprint: str
    ) -> None:
        super().__init__()
        options = tier.options_as(DiskTierSettings)
        self.directory = Path(options.path).expanduser()
        self.fingerprint = fingerprint
        self.persistent = options.persistent
        self.max_bytes = options.max_bytes
        self.ttl = tier.ttl_seconds or None
        self.codec = KVCodec(fingerprint, options.compression_level)
        self.policy = policy_factory(_UNBOUNDED)  # in entries: DiskIndex lowers it once it sees an entry's size
        self._index = DiskIndex(self.policy, self.max_bytes, self.stats)
        self._writer = TierWriter(
            self.lock,
            options.write_queue,
            options.writer_nice,
            self._write,
            self._lose,
            self._save_counts,
            thread_name="tierserve-l3-writer",
            event_prefix="kv_disk",
        )
        self._pending = self._writer.pending  # queued or being written, newest put per key
        self._stored = self._index
        self._closed = False
        cache = None
        try:
            cache = open_directory(self.directory, tier.name)
            self._load(cache)
        except Exception as exc:
            if not is_corrupt_index(exc):
                raise
            self._recover(exc, cache, tier.name)
        self._writer.start()

    # ---- CacheTier ---------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self.lock:
            pending = self._pending.get(key)
            if pending is not None:
                return not self._expire_pending_if_old(pending)
            stored = self._index.get(key)
            return stored is not None and not self._expire_if_old(key, stored)

    def _put(self, entry: CacheEntry, tally: WriteTally | None = None, deadline: float = 0.0) -> None:
        start = time.perf_counter()
        with self.lock:
            self.stats.puts += 1
            key = entry.key
            if tally is not None and not self._closed and key not in self._index:
                self._writer.wait_for_room(deadline)  # releases the lock while it waits
            if key in self._index and key not in self._pending:
                self._index.touch(key)
                self._credit(self._index.get(key), entry.accesses)
                if tally is not None:
                    tally.written += 1  # already stored
            elif self._closed:
                self.stats.dropped_writes += 1
                log.warning("kv_disk_write_after_close", key=key.hex())
                if tally is not None:
                    tally.dropped += 1
            else:
                earlier = self._pending.get(key)
                if not self._writer.submit(entry, tally):
                    self.stats.dropped_writes += 1
                    log.debug("kv_disk_write_dropped", key=key.hex(), reason="write queue full")
                    if tally is not None:
                        tally.dropped += 1
                else:  # the uses it came with, and those of a queued put it replaces
                    carried, entry.accesses = entry.accesses + (earlier.accesses if earlier else 0), 0
                    self._credit(entry, carried)
            self.stats.put_seconds += time.perf_counter() - start

    def remove(self, key: bytes) -> None:
        with self.lock:
            self._pending.pop(key, None)
            if key in self._index:
                self._index.remove(key)
                self._delete_file(key)
            else:
                self._index.unpin(key)

    def clear(self) -> int:
        with self.lock:
            removed = len(set(self._index) | self._pending.keys())
            self._index.clear()
            self._pending.clear()
            try:
                self._cache.clear()
            except Exception as exc:
                log.warning("kv_disk_clear_failed", directory=str(self.directory), error=repr(exc))
            return removed

    @property
    def bytes_used(self) -> int:
        return self._index.stored_bytes

    @property
    def capacity(self) -> TierCapacity:
        return TierCapacity(None, self.max_bytes or None)

    def add_accesses(self, key: bytes, count: int) -> None:
        with self.lock:
            self._credit(self._pending.get(key) or self._index.get(key), count)

    def pin(self, key: bytes) -> None:
        """Protect ``key`` from eviction and expiry (a queued key once written); a key not stored is ignored."""
        with self.lock:
            if key in self._index or key in self._pending:
                self._index.pin(key)

    def hold(self, key: bytes) -> None:
        """Protect ``key`` from eviction until only held entries are left to evict, leaves first (a queued key
        once written); not from expiry (its children are younger, so past the TTL too); a key not stored is ignored."""
        with self.lock:
            if key in self._index or key in self._pending:
                self._index.hold(key)

    def unpin(self, key: bytes) -> None:
        with self.lock:
            self._index.unpin(key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until queued writes are on disk, then save changed access counts (persistent only)."""
        self._writer.wait(timeout)
        self._save_counts()

    def close(self) -> None:
        """Write what is queued, stop the writer and close the directory; later puts are dropped."""
        # diskcache keeps a connection per thread and closes only the caller's: one left open would
        # write into the index when collected, even after the directory is reopened (or its index moved aside)
        if not self._stop_writes(last=self._cache.close):
            return
        self._save_counts()
        self._cache.close()

    def release_thread(self) -> None:
        """diskcache's connection of the calling thread (the store's loader reads here too), closed: one left
        open would write into the index when collected."""
        self._cache.close()

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless the index, the policy and the counters agree."""
        with self.lock:
            problems = self._index.problems(set(self._pending))
            if problems:
                raise AssertionError(f"{self.name} tier: " + "; ".join(problems))

    # ---- reading -----------------------------------------------------------

    def _lookup(self, key: bytes) -> CacheEntry | None:
        with self.lock:
            pending = self._pending.get(key)
            if pending is not None:
                if self._expire_pending_if_old(pending):
                    return None
                self._credit(pending, 1)
                # a new record around the queued tensor: the caller may reassign fields before it is written
                return replace(pending, accesses=0)
            stored = self._index.get(key)
            if stored is None or self._expire_if_old(key, stored):
                return None
            # Read under the lock: an evicted entry leaves the index before its
            # file is deleted, so a file read here is never one being deleted.
            try:
                data = self._cache.get(key.hex(), default=None)
            except Exception as exc:
                data, reason = None, f"unreadable: {exc!r}"
            else:
                reason = "value file or row missing"
            if not isinstance(data, bytes):
                self._drop_corrupt(key, reason)
                return None
        try:
            entry = self.codec.decode(data, expected_key=key)
        except CorruptEntryError as exc:
            with self.lock:
                if self._index.get(key) is stored:
                    self._drop_corrupt(key, str(exc))
            return None
        with self.lock:
            if self._index.get(key) is not stored:
                return entry  # removed while being decoded; what was read was intact
            self._index.read_back(stored, entry.nbytes, entry.created)
            if self._expire_if_old(key, stored):
                return None
            self._index.touch(key)
            self._credit(stored, 1)
        return entry

    def _drop_corrupt(self, key: bytes, reason: str) -> None:
        self.stats.corrupt += 1
        self.note_removed(key)
        log.warning("kv_disk_corrupt_entry", key=key.hex(), reason=reason, directory=str(self.directory))
        self._index.remove(key)
        self._delete_file(key)

    # ---- writing (the writer thread) ---------------------------------------

    def _lose(self, entry: CacheEntry) -> None:
        """A queued entry could not be written (the writer calls this under the lock)."""
        self.note_removed(entry.key)
        if entry.key not in self._index and entry.key not in self._pending:
            self._index.unpin(entry.key)

    def _write(self, entry: CacheEntry) -> bool:
        """Encode and store one queued entry; False if it could not be stored (the writer reports it lost)."""
        key = entry.key
        with self.lock:
            if self._pending.get(key) is not entry:
                return True  # removed, cleared or put again while queued: nothing was lost here
        try:
            data = self.codec.encode(entry)
        except Exception:
            log.exception("kv_disk_write_failed", key=key.hex())
            with self.lock:
                self.stats.write_errors += 1
            return False
        if self.max_bytes and len(data) > self.max_bytes:
            with self.lock:
                self.stats.dropped_writes += 1
            log.warning("kv_disk_entry_too_large", key=key.hex(), size=len(data), max_disk_bytes=self.max_bytes)
            return False
        with self.lock:
            if self._pending.get(key) is not entry:
                return True
            replaced = self._index.get(key)
            carried = 0  # the uses of the entry this one replaces
            if replaced is not None:  # its file is overwritten below, or deleted if there is no room
                carried = replaced.accesses
                self._index.remove(key, keep_pin=True)
            # room first, so the files never add up to more than the bound, even while this one is written
            victims = self._index.make_room(len(data), entry.parent)
            fits = self._index.has_room(len(data))
            if not fits:
                self.stats.dropped_writes += 1
        self._forget_files(victims)
        if not fits:
            if replaced is not None:
                self._delete_file(key)
            log.debug("kv_disk_write_dropped", key=key.hex(), reason="no room under max_bytes that is not pinned")
            return False
        try:
            self._cache.set(key.hex(), data, tag=entry.parent.hex() if entry.parent else None, retry=True)
        except Exception as exc:
            with self.lock:
                self.stats.write_errors += 1
            log.warning(
                "kv_disk_write_failed",
                key=key.hex(),
                error=repr(exc),
                errno=getattr(exc, "errno", None),
                directory=str(self.directory),
            )
            return False
        with self.lock:
            if self._pending.get(key) is not entry:
                if key not in self._pending:  # removed or cleared while being written
                    self._delete_file(key)
                return True  # else a newer put of the key is queued and will be written
            del self._pending[key]
            # entry.accesses read now, not before the file was written: uses credited meanwhile count too
            accesses = entry.accesses + carried
            self._index.add(key, StoredEntry(len(data), entry.nbytes, entry.parent, entry.created, accesses))
        return True

    def _forget_files(self, victims: list[bytes]) -> None:
        """Delete the files of entries the index evicted, and tell the store."""
        for victim in victims:
            self._delete_file(victim)
            self.note_removed(victim)

    # ---- expiry and files (callers hold self.lock, except during __init__) --------

    def _expired(self, created: float) -> bool:
        return self.ttl is not None and time.time() - created > self.ttl

    def _expire_if_old(self, key: bytes, stored: StoredEntry) -> bool:
        if not self._expired(stored.created) or key in self._index.pinned:  # a hold does not outlive the TTL
            return False
        self._index.remove(key)
        self._delete_file(key)
        self.stats.expirations += 1
        self.note_removed(key)
        return True

    def _expire_pending_if_old(self, entry: CacheEntry) -> bool:
        if not self._expired(entry.created) or entry.key in self._index.pinned:
            return False
        del self._pending[entry.key]  # the writer skips an entry no longer pending
        self.stats.expirations += 1
        self.note_removed(entry.key)
        return True

    def _delete_file(self, key: bytes) -> None:
        try:
            self._cache.delete(key.hex())
        except Exception as exc:
            log.warning("kv_disk_delete_failed", key=key.hex(), error=repr(exc), directory=str(self.directory))

    # ---- start-up ------------------------------------------------------------

    def _load(self, cache: diskcache.Cache) -> None:
        """Take what the directory holds (persistent), or clear it."""
        self._cache = cache
        self._counts = CountsRecord(cache, self.directory, enabled=self.persistent)
        if self.persistent:
            self._rebuild()
        else:
            cache.clear()

    def _recover(self, exc: Exception, cache: diskcache.Cache | None, tier_name: str) -> None:
        """The index is corrupt: keep it aside for inspection, then start on a fresh one holding
        the value files' entries again (persistent) or nothing. ``cache``: the directory, if it opened."""
        if cache is not None:
            try:
                cache.close()
            except Exception:
                pass  # the index is already known to be unreadable
        try:
            aside = move_index_aside(self.directory)
        except OSError as error:
            raise TierserveError(
                f"the cache index in {str(self.directory)!r} (path of tier {tier_name!r}) is corrupt ({exc}) and "
                f"cannot be moved aside: {error}; delete {str(self.directory / INDEX_NAME)!r} or point path elsewhere"
            ) from error
        self.stats.corrupt_indexes += 1
        log.warning(
            "kv_disk_index_corrupt",
            directory=str(self.directory),
            error=str(exc),
            moved_to=str(aside),
            action="rebuilding from the value files" if self.persistent else "starting empty",
        )
        cache = open_directory(self.directory, tier_name)
        files = value_files(self.directory)
        if self.persistent:
            restored, lost = reindex_values(cache, files, self.codec)
            self.stats.corrupt += lost
            log.info("kv_disk_values_reindexed", directory=str(self.directory), entries=restored, deleted=lost)
        else:
            for path in files:
                path.unlink(missing_ok=True)
        self._load(cache)

    def _rebuild(self) -> None:
        """Index what a previous run left, oldest first, with its access counts; then apply TTL and the byte bound."""
        rows, skipped = previous_entries(self._cache, self._count_unreadable)
        for key, parent, size, store_time in rows:
            if self._expired(store_time):
                self._delete_file(key)
                self.stats.expirations += 1
                continue
            self._index.add(key, StoredEntry(size, size, parent, store_time))
        self._index.restore_access_counts(self._counts.load())
        for victim in self._index.make_room(0):
            self._delete_file(victim)
        directory, entries, stored = str(self.directory), len(self._index), self._index.stored_bytes
        log.info("kv_disk_index_rebuilt", directory=directory, entries=entries, bytes=stored, skipped=skipped)

    def _count_unreadable(self) -> None:
        self.stats.corrupt += 1

    # ---- access counts (callers of _credit hold self.lock) ---------------------

    def _credit(self, record: CacheEntry | StoredEntry | None, count: int) -> None:
        """Add ``count`` to the access count of a queued or stored entry (never below 0)."""
        if record is not None and count:
            record.accesses = max(0, record.accesses + count)
            if self._counts.changed():
                self._writer.request_task()  # saved on the writer thread; skipped when its queue is full

    def _save_counts(self) -> None:
        self._counts.save(self.lock, self._index.access_counts)


@hookimpl
def register_cache_tiers(register):
    description = "local disk, zstd-compressed, persistent across restarts"
    register("disk", DiskTier, settings=DiskTierSettings, description=description)
