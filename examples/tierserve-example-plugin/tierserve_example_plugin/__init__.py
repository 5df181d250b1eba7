"""An example tierserve plugin: FIFO eviction (oldest inserted goes first, hits change nothing)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from tierserve.cache.eviction import EvictionPolicy
from tierserve.core import hookimpl


class FifoPolicy(EvictionPolicy):
    """Evicts in insertion order; a pinned entry rejoins the queue at the back when unpinned."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._queue: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable, size: int) -> None:
        self._queue[key] = None

    def on_touch(self, key: Hashable, pinned: bool) -> None:
        pass  # FIFO ignores hits: that is the whole policy

    def on_remove(self, key: Hashable, pinned: bool) -> None:
        if not pinned:
            del self._queue[key]

    def choose_victim(self) -> Hashable:
        key, _ = self._queue.popitem(last=False)
        return key

    def on_pin(self, key: Hashable) -> None:
        del self._queue[key]

    def on_unpin(self, key: Hashable) -> None:
        self._queue[key] = None


@hookimpl
def register_eviction_policies(register):
    register("fifo", FifoPolicy, description="first in, first out (example plugin)")
