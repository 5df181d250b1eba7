"""A tier's background writes (the disk and redis tiers): a bounded queue, the entries queued or being written, one thread.

    submit(entry) ──► queue (full: refused) ──► writer thread (lower CPU priority): write(entry)
                      pending[key] = entry       └► done: leaves pending; lost: lost(entry) is told
    wait_for_room(deadline) before a submit that should wait rather than be refused (a warm's write)
    request_task() ──► the same queue ──► task()   (e.g. save the access counts)

Every change to ``pending`` and the unwritten count happens under the tier's
lock, which the caller passes in; ``wait`` is ``flush``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from tierserve.cache.stats import TierStats
from tierserve.cache.tier import CacheEntry, WriteTally, read_until_miss

log = structlog.get_logger(__name__)

_TASK = object()  # a queue item: run the task instead of writing


class QueuedTier:
    """What the tiers whose writes queue in a ``TierWriter`` (disk, redis) share: what is queued
    (``_pending``, the writer's ``pending``) counts as held next to what is stored (``_stored``: a
    mapping from key to a record with ``parent`` and ``accesses``); ``get`` times and counts the tier's
    ``_lookup``; ``put`` and ``put_waiting`` hand the entry to its ``_put`` and return nothing (such a
    tier drops what it evicts). The tier sets ``lock``, ``stats``, ``_pending`` and ``_stored``; list
    this class before ``CacheTier``."""

    lock: threading.RLock
    stats: TierStats
    _pending: dict[bytes, CacheEntry]
    _stored: Any
    _writer: TierWriter
    _closed: bool

    def _stop_writes(self, last: Callable[[], None] | None = None) -> bool:
        """Write what is queued, refuse later puts and end the writer (``last`` runs on its thread);
        False when the tier was closed already. (``flush`` is the tier's: ``CacheTier.flush``.)"""
        with self.lock:
            if self._closed:
                return False
        self.flush()
        with self.lock:
            self._closed = True
        self._writer.stop(last=last)
        return True

    def writes_pending(self) -> int:
        return self._writer.unwritten

    def _lookup(self, key: bytes) -> CacheEntry | None:
        raise NotImplementedError

    def _put(self, entry: CacheEntry, tally: WriteTally | None = None, deadline: float = 0.0) -> None:
        raise NotImplementedError

    def get(self, key: bytes) -> CacheEntry | None:
        start = time.perf_counter()
        entry = self._lookup(key)
        with self.lock:
            if entry is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            self.stats.get_seconds += time.perf_counter() - start
        return entry

    def get_many(self, keys: list[bytes]) -> list[CacheEntry]:
        start = time.perf_counter()
        entries = self._lookup_many(keys)
        with self.lock:
            self.stats.hits += len(entries)
            self.stats.misses += len(entries) < len(keys)
            self.stats.get_seconds += time.perf_counter() - start
        return entries

    def _lookup_many(self, keys: list[bytes]) -> list[CacheEntry]:
        """``_lookup`` of each key up to the first miss; a tier with a batched read overrides it."""
        return read_until_miss(keys, self._lookup)

    def put(self, entry: CacheEntry) -> list[CacheEntry]:
        self._put(entry)
        return []

    def put_waiting(self, entry: CacheEntry, tally: WriteTally, deadline: float) -> list[CacheEntry]:
        """``put``, waiting for room in the write queue until ``deadline`` instead of dropping at once;
        ``tally`` learns whether the entry was written or dropped once the writer is done with it."""
        self._put(entry, tally, deadline)
        return []

    def keys(self) -> Iterator[bytes]:
        with self.lock:
            return iter(list(set(self._stored) | self._pending.keys()))

    def parent_of(self, key: bytes) -> bytes | None:
        """The parent hash of ``key``; ``None`` also when ``key`` is not held."""
        with self.lock:
            pending = self._pending.get(key)
            if pending is not None:
                return pending.parent
            stored = self._stored.get(key)
            return stored.parent if stored is not None else None

    def __len__(self) -> int:
        # O(queued writes), bounded by the queue, not by what is stored: stats read this per scrape
        with self.lock:
            return len(self._stored) + sum(1 for key in self._pending if key not in self._stored)

    def access_count(self, key: bytes) -> int:
        with self.lock:
            pending, stored = self._pending.get(key), self._stored.get(key)
            return (pending.accesses if pending else 0) + (stored.accesses if stored else 0)


class TierWriter(threading.Thread):
    """One daemon thread that writes queued entries in order.

    Args:
        lock: the tier's lock; guards ``pending`` and the unwritten count.
        size: queue capacity; ``submit`` refuses an entry when it is full.
        nice: added to the thread's niceness (Linux), so writes yield the CPU to the step loop.
        write: stores one entry; False if it could not be stored (it counts and logs its own
            failures; one that raises is logged here and treated as lost). Runs without the lock.
            ``None`` when ``write_many`` is given (it writes every batch, one entry or more).
        lost: called under the lock for an entry ``write`` failed on (or raised for),
            once it no longer counts as pending.
        task: what ``request_task`` runs on this thread.
        thread_name: the thread's name (``ps``, ``py-spy``).
        event_prefix: the start of this writer's log events, e.g. ``"kv_disk"``.
        write_many: stores several queued entries at once (one round trip to a server), with ``write``'s
            answer for each; when given, the writer takes up to ``batch`` entries queued back to back.
        batch: the most entries one ``write_many`` gets.
    """

    def __init__(
        self,
        lock: threading.RLock,
        size: int,
        nice: int,
        write: Callable[[CacheEntry], bool] | None,
        lost: Callable[[CacheEntry], None],
        task: Callable[[], None],
        thread_name: str = "tierserve-tier-writer",
        event_prefix: str = "kv_tier",
        write_many: Callable[[list[CacheEntry]], list[bool]] | None = None,
        batch: int = 64,
    ) -> None:
        super().__init__(name=thread_name, daemon=True)
        self._write_many, self.batch = write_many, max(1, batch)
        self.event_prefix = event_prefix
        self.lock = lock
        self.nice = nice
        self.pending: dict[bytes, CacheEntry] = {}  # queued or being written, newest put per key
        self._write, self._lost, self._task = write, lost, task
        self._queue: queue.Queue[CacheEntry | object | Callable[[], None]] = queue.Queue(maxsize=size)
        self._unwritten = 0  # entries accepted and not yet finished
        self._drained = threading.Condition(lock)  # notified as each entry finishes
        self._tallies: dict[int, WriteTally] = {}  # id(entry) -> the tally told how it ends

    def submit(self, entry: CacheEntry, tally: WriteTally | None = None) -> bool:
        """Queue ``entry`` (the caller holds the lock); False, and nothing queued, when the queue is full.

        ``tally`` counts the entry as pending until it is written (``written``) or lost (``dropped``).
        """
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            return False
        self.pending[entry.key] = entry
        self._unwritten += 1
        if tally is not None:
            tally.pending += 1
            self._tallies[id(entry)] = tally
        return True

    def wait_for_room(self, deadline: float) -> bool:
        """Wait until the queue has room or ``deadline`` (``time.monotonic()``) passes; False then.
        The caller holds the lock, which is released while waiting."""
        while self._queue.full():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._drained.wait(min(left, 0.05))  # a slot frees when the writer takes an entry, before it is done
        return True

    def request_task(self) -> None:
        """Run the task on this thread after what is queued; skipped when the queue is full."""
        try:
            self._queue.put_nowait(_TASK)
        except queue.Full:
            pass  # the queue drains; the owner asks again later

    @property
    def unwritten(self) -> int:
        """Entries accepted and not yet written (or dropped)."""
        return self._unwritten

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted entry is finished; False on timeout (logged)."""
        with self._drained:
            if self._drained.wait_for(lambda: self._unwritten == 0, timeout):
                return True
            log.warning(f"{self.event_prefix}_flush_timeout", unwritten=self._unwritten, timeout=timeout)
            return False

    def stop(self, last: Callable[[], None] | None = None) -> None:
        """Finish what is queued, run ``last`` on this thread (e.g. close what it opened), then end the thread."""
        self._queue.put(last or (lambda: None))
        self.join()

    def run(self) -> None:
        self._lower_priority()
        item = None
        while True:
            if item is None:
                item = self._queue.get()
            if callable(item):
                item()
                return
            if item is _TASK:
                self._task()
                item = None
                continue
            entries, item = [item], None
            while self._write_many is not None and len(entries) < self.batch:
                try:
                    queued = self._queue.get_nowait()
                except queue.Empty:
                    break
                if queued is _TASK or callable(queued):
                    item = queued  # after the batch, in queue order
                    break
                entries.append(queued)
            self._finish(entries)

    def _finish(self, entries: list[CacheEntry]) -> None:
        try:
            if self._write_many is not None:
                stored = self._write_many(entries)
            else:
                stored = [self._write(entries[0])]
        except Exception:
            log.exception(f"{self.event_prefix}_write_failed", keys=[entry.key.hex() for entry in entries])
            stored = [False] * len(entries)
        for entry, ok in zip(entries, stored):
            self._finished(entry, lost=not ok)

    def _finished(self, entry: CacheEntry, lost: bool) -> None:
        with self.lock:
            if self.pending.get(entry.key) is entry:
                del self.pending[entry.key]
            else:
                lost = False  # put again while queued: the newer write decides
            self._unwritten -= 1
            tally = self._tallies.pop(id(entry), None)
            if tally is not None:
                tally.pending -= 1
                if lost:
                    tally.dropped += 1
                else:
                    tally.written += 1
            # told only once it is no longer pending, so the owner's index can never
            # see "removed" while contains() still says yes
            if lost:
                self._lost(entry)
            self._drained.notify_all()

    def _lower_priority(self) -> None:
        """Compression and writes yield the CPU to the step loop (Linux: per-thread nice)."""
        if not self.nice or not hasattr(os, "setpriority"):
            return
        try:
            thread = threading.get_native_id()
            current = os.getpriority(os.PRIO_PROCESS, thread)
            os.setpriority(os.PRIO_PROCESS, thread, min(19, current + self.nice))
        except OSError as exc:
            log.info(f"{self.event_prefix}_writer_priority_unchanged", error=str(exc))
