"""CLOCK (second chance): an LRU approximation with one reference bit per entry."""

from __future__ import annotations

from collections import OrderedDict

from tierserve.cache.eviction import EvictionPolicy, Key
from tierserve.core.hookspecs import hookimpl


class ClockPolicy(EvictionPolicy):
    """Entries sit on a ring in insertion order; a use sets the entry's bit.

    The hand (the front of the ring) clears set bits and moves those entries
    behind it until it finds a clear one: that is the victim. Each bit is
    cleared at most once per use, so eviction is amortised O(1); hits are
    O(1) and never reorder the ring, which is why CLOCK is cheap under
    contention.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._ring: OrderedDict[Key, bool] = OrderedDict()  # unpinned key -> referenced
        self._pinned_bits: dict[Key, bool] = {}

    def on_insert(self, key: Key, size: int) -> None:
        self._ring[key] = False

    def on_touch(self, key: Key, pinned: bool) -> None:
        if pinned:
            self._pinned_bits[key] = True
        else:
            self._ring[key] = True

    def on_remove(self, key: Key, pinned: bool) -> None:
        if pinned:
            del self._pinned_bits[key]
        else:
            del self._ring[key]

    def choose_victim(self) -> Key:
        while True:
            key, referenced = next(iter(self._ring.items()))
            if not referenced:
                del self._ring[key]
                return key
            self._ring[key] = False
            self._ring.move_to_end(key)

    def on_pin(self, key: Key) -> None:
        self._pinned_bits[key] = self._ring.pop(key)

    def on_unpin(self, key: Key) -> None:
        self._ring[key] = self._pinned_bits.pop(key)


@hookimpl
def register_eviction_policies(register):
    register("clock", ClockPolicy, description="CLOCK / second chance, a cheap LRU approximation")
