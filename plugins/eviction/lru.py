"""LRU: evict the least recently used entry."""

from __future__ import annotations

from collections import OrderedDict

from tierserve.cache.eviction import EvictionPolicy, Key
from tierserve.core.hookspecs import hookimpl


class LRUPolicy(EvictionPolicy):
    """Least recently used first; every operation is O(1)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()  # unpinned, oldest first

    def on_insert(self, key: Key, size: int) -> None:
        self._order[key] = None

    def on_touch(self, key: Key, pinned: bool) -> None:
        if not pinned:
            self._order.move_to_end(key)

    def on_remove(self, key: Key, pinned: bool) -> None:
        if not pinned:
            del self._order[key]

    def choose_victim(self) -> Key:
        key, _ = self._order.popitem(last=False)
        return key

    def on_pin(self, key: Key) -> None:
        del self._order[key]

    def on_unpin(self, key: Key) -> None:
        self._order[key] = None


@hookimpl
def register_eviction_policies(register):
    register("lru", LRUPolicy, description="least recently used")
