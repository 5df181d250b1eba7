"""Counted pins per block hash, applied to every tier of the store that holds the block.

Two kinds of hold keep a block from eviction, and both are counted here so
neither can undo the other:

    pin(key)            every tier, L1 included: a named prefix keeps the block (nests)
    pin_in_last(key)    the last tier only: a cached child needs it there (leaves first)

A tier is told the block's state there, one of three: ``"pin"`` (never
evict), ``"hold"`` (the last tier only: a cached child needs it, so it goes
after the leaves, and only when the tier's bound leaves no other choice) or
``"release"``. It is told only when that state may have changed (tier pins do
not nest), and a tier that receives a held or pinned block later (demotion,
promotion, write-through) is told on arrival.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from tierserve.cache.hash_index import BlockHashIndex

State = Literal["pin", "hold", "release"]
# position → set the block's state there: position 0 is L1 (the pool), i the i-th tier below
Apply = Callable[[int, bytes, State], None]


class PinLedger:
    """How many holds each block has, and where they apply.

    Args:
        index: the store's hash index (which positions hold a block now).
        apply: ``apply(position, key, pinned)`` sets the block's state in that tier.
        last: the position of the last tier (where leaves-first pins apply); ``None`` without lower tiers.
    """

    def __init__(self, index: BlockHashIndex, apply: Apply, last: int | None) -> None:
        self.index = index
        self.apply = apply
        self.last = last
        self._every: dict[bytes, int] = {}  # key -> holds that apply in every tier
        self._in_last: dict[bytes, int] = {}  # key -> holds that apply in the last tier only

    def count(self, key: bytes) -> int:
        """Holds on ``key`` that apply in every tier (0: none)."""
        return self._every.get(key, 0)

    def pinned_at(self, key: bytes, position: int) -> bool:
        """Whether ``key`` must be kept (pinned or held) in the tier at ``position``."""
        return self.state_at(key, position) != "release"

    def state_at(self, key: bytes, position: int) -> State:
        """What the tier at ``position`` must do with ``key``: a pin wins over a hold."""
        if key in self._every:
            return "pin"
        if position == self.last and key in self._in_last:
            return "hold"
        return "release"

    def pin(self, key: bytes) -> None:
        """One more hold on ``key`` in every tier."""
        held = key in self._every
        self._every[key] = self._every.get(key, 0) + 1
        if not held:
            self._set_where_held(key)

    def unpin(self, key: bytes) -> None:
        """Release one hold of ``pin``; ``ValueError`` if ``key`` has none."""
        count = self._every.get(key, 0)
        if not count:
            raise ValueError(f"block {key.hex()} is not pinned: unpinned more times than pinned")
        if count > 1:
            self._every[key] = count - 1
            return
        del self._every[key]
        self._set_where_held(key)

    def unpin_all(self, keys: Sequence[bytes]) -> None:
        """``unpin`` each key (repeats release more); ``ValueError`` and no change if one has too few holds."""
        wanted: dict[bytes, int] = {}
        for key in keys:
            wanted[key] = wanted.get(key, 0) + 1
            if wanted[key] > self.count(key):
                raise ValueError(f"block {key.hex()} is unpinned more times than it is pinned")
        for key in keys:
            self.unpin(key)

    def pin_in_last(self, key: bytes) -> None:
        """One more hold on ``key`` in the last tier only."""
        count = self._in_last.get(key, 0)
        self._in_last[key] = count + 1
        if not count and key not in self._every:
            self._set(self.last, key)

    def unpin_in_last(self, key: bytes) -> None:
        """Release one hold of ``pin_in_last``; ``ValueError`` if ``key`` has none."""
        count = self._in_last.get(key, 0)
        if not count:
            raise ValueError(f"block {key.hex()} has no hold in the last tier")
        if count > 1:
            self._in_last[key] = count - 1
            return
        del self._in_last[key]
        if key not in self._every:
            self._set(self.last, key)

    def arrived(self, key: bytes, position: int) -> None:
        """The tier at ``position`` now holds ``key``: pin or hold it there if either applies."""
        state = self.state_at(key, position)
        if state != "release":
            self.apply(position, key, state)

    def pinned_keys(self) -> set[bytes]:
        """Every key held in every tier (for integrity checks)."""
        return set(self._every)

    def holds_in_last(self) -> dict[bytes, int]:
        """The last-tier holds per key (for integrity checks)."""
        return dict(self._in_last)

    def _set_where_held(self, key: bytes) -> None:
        held = self.index.tiers_of(key)
        position = 0
        while held >> position:
            if held & (1 << position):
                self.apply(position, key, self.state_at(key, position))
            position += 1

    def _set(self, position: int | None, key: bytes) -> None:
        if position is not None and self.index.tiers_of(key) & (1 << position):
            self.apply(position, key, self.state_at(key, position))
