"""LFU: evict the least frequently used entry, least recently used among ties."""

from __future__ import annotations

import heapq
from collections import OrderedDict

from tierserve.cache.eviction import EvictionPolicy, Key
from tierserve.core.hookspecs import hookimpl


class LFUPolicy(EvictionPolicy):
    """Least frequently used first (counts since insertion), ties broken by recency.

    Unpinned keys sit in one bucket per use count, each bucket ordered by
    last use; a min-heap of counts (with lazy deletion of emptied buckets)
    finds the lowest non-empty bucket in amortised O(log n).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._count: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        self._heap: list[int] = []

    def _bucket_add(self, key: Key) -> None:
        count = self._count[key]
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedDict()
            heapq.heappush(self._heap, count)
            if len(self._heap) > 2 * len(self._buckets) + 8:
                # Stale counts above the minimum are never popped lazily (a
                # hot key climbing leaves one per touch): rebuild from the
                # live buckets. Amortised O(1), and the heap stays O(n).
                self._heap = list(self._buckets)
                heapq.heapify(self._heap)
        bucket[key] = None

    def _bucket_drop(self, key: Key) -> None:
        count = self._count[key]
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]  # its heap entry is dropped lazily

    def on_insert(self, key: Key, size: int) -> None:
        self._count[key] = 1
        self._bucket_add(key)

    def on_touch(self, key: Key, pinned: bool) -> None:
        if pinned:
            self._count[key] += 1
            return
        self._bucket_drop(key)
        self._count[key] += 1
        self._bucket_add(key)

    def on_remove(self, key: Key, pinned: bool) -> None:
        if not pinned:
            self._bucket_drop(key)
        del self._count[key]

    def choose_victim(self) -> Key:
        while self._heap[0] not in self._buckets:
            heapq.heappop(self._heap)
        key = next(iter(self._buckets[self._heap[0]]))
        self._bucket_drop(key)
        del self._count[key]
        return key

    def on_pin(self, key: Key) -> None:
        self._bucket_drop(key)

    def on_unpin(self, key: Key) -> None:
        self._bucket_add(key)


@hookimpl
def register_eviction_policies(register):
    register("lfu", LFUPolicy, description="least frequently used, LRU among ties")
