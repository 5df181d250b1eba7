"""A cache tier whose faults stay inside it: every tier the store uses is wrapped in ``GuardedTier``.

A tier is a plugin's code (the built-in ones go through the same hook as any installed one), and a bug or an
outage there must not fail the requests it was meant to speed up. When a call into the tier raises, the call
is answered as a miss (``get``: ``None``; ``contains``: ``False``), a dropped write (``put``: nothing stored,
nothing evicted) or nothing done; the exception is logged with the tier, its plugin and the traceback, counted
(``errors`` in the tier's statistics, which ``/health`` reports as a degraded cache) and the tier is left alone
for a back-off (1 s, doubling up to 60 s while its calls keep failing), so a tier that fails on every call
costs one logged traceback per back-off, not one per request. The first call after a back-off tries the tier
again; a success ends the back-off.

The built-in tiers count their own expected faults (a full disk, an unreachable Redis) and do not raise, so
this is what catches the unexpected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import structlog

from tierserve.cache.tier import CacheEntry, CacheTier, TierCapacity, WriteTally
from tierserve.cache.figures import Figures

log = structlog.get_logger(__name__)

T = TypeVar("T")
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 60.0


class GuardedTier(CacheTier):
    """``tier`` (built by ``plugin``), with each call's exceptions contained (see the module docstring).

    Its name, medium, sharing, statistics and lock are the tier's own."""

    def __init__(self, tier: CacheTier, tier_name: str, plugin: str) -> None:
        self.inner = tier
        self.tier_name = tier_name
        self.plugin = plugin
        self.name, self.medium, self.shared = tier.name, tier.medium, tier.shared
        self.stats = tier.stats
        self.lock = tier.lock
        self.figures = getattr(tier, "figures", None) or Figures()
        self._backoff = 0.0
        self._resume_at = 0.0

    @property
    def backing_off(self) -> bool:
        """Whether the tier is being left alone after a failure."""
        return time.monotonic() < self._resume_at

    def _call(self, method: str, call: Callable[[], T], fallback: T) -> T:
        if self._resume_at and self.backing_off:
            return fallback
        try:
            result = call()
        except Exception:  # noqa: BLE001 - a plugin may raise anything; that is what is contained here
            self._backoff = min(MAX_BACKOFF_SECONDS, self._backoff * 2 or FIRST_BACKOFF_SECONDS)
            self._resume_at = time.monotonic() + self._backoff
            self.stats.errors += 1
            log.exception("cache_tier_failed", tier=self.tier_name, plugin=self.plugin, method=method,
                          errors=self.stats.errors, skipped_for_seconds=self._backoff)  # fmt: skip
            return fallback
        if self._resume_at:
            log.info("cache_tier_recovered", tier=self.tier_name, plugin=self.plugin, method=method)
            self._backoff = self._resume_at = 0.0
        return result

    # ---- reads and writes: a miss, or a dropped write ----------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self._call("contains", lambda: self.inner.contains(key), False)

    def get(self, key: bytes) -> CacheEntry | None:
        return self._call("get", lambda: self.inner.get(key), None)

    def get_many(self, keys: list[bytes]) -> list[CacheEntry]:
        return self._call("get_many", lambda: self.inner.get_many(keys), [])

    def put(self, entry: CacheEntry) -> list[CacheEntry]:
        return self._call("put", lambda: self.inner.put(entry), [])

    def put_many(self, entries: list[CacheEntry]) -> list[CacheEntry]:
        return self._call("put_many", lambda: self.inner.put_many(entries), [])

    def put_waiting(self, entry: CacheEntry, tally: WriteTally, deadline: float) -> list[CacheEntry]:
        evicted = self._call("put_waiting", lambda: self.inner.put_waiting(entry, tally, deadline), None)
        if evicted is None:  # it raised (or is backed off): the write is given up
            tally.dropped += 1
            return []
        return evicted

    def parent_of(self, key: bytes) -> bytes | None:
        return self._call("parent_of", lambda: self.inner.parent_of(key), None)

    # ---- bookkeeping: nothing done ----------------------------------------------------------------------

    def remove(self, key: bytes) -> None:
        self._call("remove", lambda: self.inner.remove(key), None)

    def clear(self) -> int:
        return self._call("clear", self.inner.clear, 0)

    def keys(self) -> Iterator[bytes]:
        return iter(self._call("keys", lambda: list(self.inner.keys()), []))

    def __len__(self) -> int:
        return self._call("len", lambda: len(self.inner), 0)

    @property
    def bytes_used(self) -> int:
        return self._call("bytes_used", lambda: self.inner.bytes_used, 0)

    @property
    def capacity(self) -> TierCapacity:
        return self._call("capacity", lambda: self.inner.capacity, TierCapacity())

    def access_count(self, key: bytes) -> int:
        return self._call("access_count", lambda: self.inner.access_count(key), 0)

    def add_accesses(self, key: bytes, count: int) -> None:
        self._call("add_accesses", lambda: self.inner.add_accesses(key, count), None)

    def pin(self, key: bytes) -> None:
        self._call("pin", lambda: self.inner.pin(key), None)

    def unpin(self, key: bytes) -> None:
        self._call("unpin", lambda: self.inner.unpin(key), None)

    def hold(self, key: bytes) -> None:
        self._call("hold", lambda: self.inner.hold(key), None)

    def note_removed(self, key: bytes) -> None:
        self.inner.note_removed(key)

    def drain_removed(self) -> list[bytes]:
        return self._call("drain_removed", self.inner.drain_removed, [])

    def flush(self, timeout: float | None = None) -> None:
        self._call("flush", lambda: self.inner.flush(timeout), None)

    def close(self) -> None:
        self._resume_at = 0.0  # closing is tried whatever came before
        self._call("close", self.inner.close, None)

    def writes_pending(self) -> int:
        return self._call("writes_pending", self.inner.writes_pending, 0)

    def release_thread(self) -> None:
        self._call("release_thread", self.inner.release_thread, None)

    def __getattr__(self, name: str) -> object:
        # what a tier offers beyond the interface (a disk tier's directory, a tier's own test hooks)
        return getattr(self.inner, name)
