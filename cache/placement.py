"""Where each cached block is (the hash index over L1 and the tiers below) and the pins that follow from it.

Every change of where a block is goes through here, so the pins stay in step:

    add(key, parent, position)   the tier at ``position`` holds the block now
        └► its parent's first cached child: the parent is held in the last tier (leaves first)
        └► the block is pinned there if it is pinned (``PinLedger``)
    discard(key, position)       the tier dropped it
        └► no tier holds it and it was its parent's last cached child: that hold is released

Position 0 is L1 (the block pool), position ``i`` the ``i``-th tier below.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierserve.cache.block_pool import BlockPool
from tierserve.cache.hash_index import BlockHashIndex
from tierserve.cache.kv_events import KVEventLog
from tierserve.cache.pins import PinLedger, State
from tierserve.cache.tier import CacheTier

L1 = 0


class Placement:
    """The store's hash index and pin ledger, kept in step with the pool and the tiers.

    Args:
        pool: L1.
        tiers: the tiers below L1, in order (position ``i`` is ``tiers[i - 1]``).
        names: every position's name, ``"l1"`` first (for messages).

    Attributes:
        index: which positions hold each block (bit ``1 << position``).
        pins: the counted pins; ``pins.pin``/``pins.unpin`` pin a block in every tier.
        last: the last tier's position, where eviction means loss; ``None`` without lower tiers.
    """

    def __init__(self, pool: BlockPool, tiers: Sequence[CacheTier], names: Sequence[str]) -> None:
        self.pool = pool
        self.tiers = list(tiers)
        self.names = list(names)
        self.index = BlockHashIndex()
        self.last = len(self.tiers) or None
        self.pins = PinLedger(self.index, self._set_pinned, self.last)
        self.events: KVEventLog | None = None  # told of every block arriving at or leaving a position

    def holds(self, key: bytes, position: int) -> bool:
        return bool(self.index.tiers_of(key) & (1 << position))

    def add(self, key: bytes, parent: bytes | None, position: int) -> None:
        """Record that the tier at ``position`` holds ``key`` now, and pin it there if it must be."""
        had_children = parent is not None and self.index.num_children(parent) > 0
        if self.events is not None and not self.holds(key, position):
            self.events.record(True, position, key)
        self.index.add(key, parent, 1 << position)
        if self.last is not None and parent is not None and not had_children and self.index.num_children(parent):
            self.pins.pin_in_last(parent)  # a cached child needs it: not a victim any more
        self.pins.arrived(key, position)

    def discard(self, key: bytes, position: int) -> None:
        """Record that the tier at ``position`` no longer holds ``key``."""
        parent = self.index.parent_of(key)
        if self.events is not None and self.holds(key, position):
            self.events.record(False, position, key)
        gone = self.index.discard(key, 1 << position)
        if gone and self.last is not None and parent is not None and not self.index.num_children(parent):
            self.pins.unpin_in_last(parent)

    def sync_removed(self) -> None:
        """Follow what tiers dropped by themselves (disk evictions and failed writes happen on their threads)."""
        for position, tier in enumerate(self.tiers, 1):
            for key in tier.drain_removed():
                if not tier.contains(key):
                    self.discard(key, position)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the index is sound, agrees with L1 and every tier, L1's
        pins are exactly the counted ones, and every parent with a cached child is held in the last tier.
        (Call it on a quiet store: queued tier writes settled.)"""
        self.sync_removed()
        self.index.check_integrity()
        pool = self.pool
        assert set(self.index.keys_held_by(1 << L1)) == set(pool.cached), "hash index and block pool disagree about l1"
        pinned = {key for key in pool.cached if self.pins.pinned_at(key, L1)}
        assert pinned == pool.pinned, "pins in l1 differ from the counted pins"
        for position, tier in enumerate(self.tiers, 1):
            indexed = set(self.index.keys_held_by(1 << position))
            assert indexed == set(tier.keys()), f"hash index and tier {self.names[position]} disagree"
        if self.last is not None:
            parents = {node.parent for node in self.index.nodes.values() if node.parent is not None}
            assert self.pins.holds_in_last() == dict.fromkeys(parents, 1), "leaves-first pins differ from the index"

    def _set_pinned(self, position: int, key: bytes, state: State) -> None:
        target = self.pool if position == L1 else self.tiers[position - 1]
        if state == "pin":
            target.pin(key)
        elif state == "hold":  # only ever the last tier (position >= 1)
            target.hold(key)
        else:
            target.unpin(key)
