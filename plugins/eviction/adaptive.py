"""Adaptive: ARC (Adaptive Replacement Cache, Megiddo & Modha 2003), size-aware.

Resident entries live in T1 (seen once recently) or T2 (seen at least twice).
Evicted keys are remembered, without data, in ghost lists B1 and B2. The
target size ``p`` of T1 adapts online: a miss on a key found in B1 means
recency was evicted too early, so ``p`` grows; a miss found in B2 means
frequency was, so ``p`` shrinks. Eviction takes T1's oldest entry while T1
is over its target, else T2's oldest. This makes ARC scan-resistant (a scan
only churns T1) and able to follow a shifting hot set (unlike plain LFU).

Sizes generalise the paper's unit-size rules: list lengths become summed
sizes, and the step by which ``p`` moves is scaled by the size of the key
that hit in the ghost list. Ghost entries count at least 1 unit so the ghost
lists stay bounded by ``2 * capacity`` entries whatever the sizes.
"""

from __future__ import annotations

from collections import OrderedDict

from tierserve.cache.eviction import EvictionPolicy, Key
from tierserve.core.hookspecs import hookimpl


class AdaptivePolicy(EvictionPolicy):
    """ARC: balances recency (T1) against frequency (T2), learning the split."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[Key, None] = OrderedDict()  # unpinned, oldest first
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._in_t2: dict[Key, bool] = {}  # every resident key -> lives in T2
        self._t1_size = 0
        self._t2_size = 0
        self._b1: OrderedDict[Key, int] = OrderedDict()  # ghost key -> ghost size
        self._b2: OrderedDict[Key, int] = OrderedDict()
        self._b1_size = 0
        self._b2_size = 0
        self.target_t1_size = 0.0

    def on_resize(self, key: Key, old_size: int, new_size: int) -> None:
        if self._in_t2[key]:
            self._t2_size += new_size - old_size
        else:
            self._t1_size += new_size - old_size

    def on_insert(self, key: Key, size: int) -> None:
        if key in self._b1:
            ratio = max(1.0, self._b2_size / self._b1_size)
            self.target_t1_size = min(float(self.capacity), self.target_t1_size + ratio * max(size, 1))
            self._b1_size -= self._b1.pop(key)
            self._add_resident(key, size, t2=True)
        elif key in self._b2:
            ratio = max(1.0, self._b1_size / self._b2_size)
            self.target_t1_size = max(0.0, self.target_t1_size - ratio * max(size, 1))
            self._b2_size -= self._b2.pop(key)
            self._add_resident(key, size, t2=True)
        else:
            self._add_resident(key, size, t2=False)
        self._trim_ghosts()

    def on_touch(self, key: Key, pinned: bool) -> None:
        if self._in_t2[key]:
            if not pinned:
                self._t2.move_to_end(key)
            return
        size = self._sizes[key]
        self._t1_size -= size
        self._t2_size += size
        self._in_t2[key] = True
        if not pinned:
            del self._t1[key]
            self._t2[key] = None

    def on_remove(self, key: Key, pinned: bool) -> None:
        in_t2 = self._in_t2.pop(key)
        size = self._sizes[key]
        if in_t2:
            self._t2_size -= size
            if not pinned:
                del self._t2[key]
        else:
            self._t1_size -= size
            if not pinned:
                del self._t1[key]

    def choose_victim(self) -> Key:
        if self._t1 and (self._t1_size > self.target_t1_size or not self._t2):
            key, _ = self._t1.popitem(last=False)
            size = self._sizes[key]
            self._t1_size -= size
            self._b1[key] = max(size, 1)
            self._b1_size += max(size, 1)
        else:
            key, _ = self._t2.popitem(last=False)
            size = self._sizes[key]
            self._t2_size -= size
            self._b2[key] = max(size, 1)
            self._b2_size += max(size, 1)
        del self._in_t2[key]
        self._trim_ghosts()
        return key

    def on_pin(self, key: Key) -> None:
        (self._t2 if self._in_t2[key] else self._t1).pop(key)

    def on_unpin(self, key: Key) -> None:
        (self._t2 if self._in_t2[key] else self._t1)[key] = None

    def _add_resident(self, key: Key, size: int, *, t2: bool) -> None:
        self._in_t2[key] = t2
        if t2:
            self._t2[key] = None
            self._t2_size += size
        else:
            self._t1[key] = None
            self._t1_size += size

    def _trim_ghosts(self) -> None:
        capacity = self.capacity
        while self._b1 and self._t1_size + self._b1_size > capacity:
            self._b1_size -= self._b1.popitem(last=False)[1]
        while self._b2 and self._t1_size + self._t2_size + self._b1_size + self._b2_size > 2 * capacity:
            self._b2_size -= self._b2.popitem(last=False)[1]
        while self._b1 and self._b1_size + self._b2_size > 2 * capacity:
            self._b1_size -= self._b1.popitem(last=False)[1]


@hookimpl
def register_eviction_policies(register):
    register(
        "adaptive",
        AdaptivePolicy,
        description="ARC: adapts the recency/frequency split online from ghost hits",
    )
