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
from collections.abc import Callable

import structlog

from tierserve.cache.tier import CacheEntry, WriteTally

log = structlog.get_logger(__name__)

_TASK = object()  # a queue item: run the task instead of writing


class TierWriter(threading.Thread):
    """One daemon thread that writes queued entries in order.

    Args:
        lock: the tier's lock; guards ``pending`` and the unwritten count.
        size: queue capacity; ``submit`` refuses an entry when it is full.
        nice: added to the thread's niceness (Linux), so writes yield the CPU to the step loop.
        write: stores one entry; False if it could not be stored (it counts and logs its own
            failures; one that raises is logged here and treated as lost). Runs without the lock.
        lost: called under the lock for an entry ``write`` failed on (or raised for),
            once it no longer counts as pending.
        task: what ``request_task`` runs on this thread.
        thread_name: the thread's name (``ps``, ``py-spy``).
        event_prefix: the start of this writer's log events, e.g. ``"kv_disk"``.
    """

    def __init__(
        self,
        lock: threading.RLock,
        size: int,
        nice: int,
        write: Callable[[CacheEntry], bool],
        lost: Callable[[CacheEntry], None],
        task: Callable[[], None],
        thread_name: str = "tierserve-tier-writer",
        event_prefix: str = "kv_tier",
    ) -> None:
        super().__init__(name=thread_name, daemon=True)
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
        while True:
            item = self._queue.get()
            if callable(item):
                item()
                return
            if item is _TASK:
                self._task()
            else:
                self._finish(item)

    def _finish(self, entry: CacheEntry) -> None:
        lost = False
        try:
            lost = not self._write(entry)
        except Exception:
            log.exception(f"{self.event_prefix}_write_failed", key=entry.key.hex())
            lost = True
        finally:
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
