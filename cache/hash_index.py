"""Which tiers hold each cached block, by block hash, with parent links and live statistics.

Block hashes are chained, so a cached prefix is a path of hashes from a
root. Each node remembers its parent and the index counts children per key,
so the tiered store can keep blocks a cached descendant still needs from
being evicted where eviction means loss (leaves go first).

    root ── h0 ── h1 ── h2        (prompt A)
                   └─── h2'       (prompt B shares A's first two blocks)

The statistics (blocks, leaves, summed leaf depth) are kept as nodes come
and go, so reading them is O(1) whatever the size of the cache. A node's
depth is fixed when it is indexed: its parent's depth + 1 if the parent is
indexed then, else 1 (a block whose ancestors no tier holds starts a new
prefix). It is not revised when ancestors later leave or come back.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierserve.cache.stats import IndexStats


@dataclass(slots=True)
class IndexNode:
    key: bytes
    parent: bytes | None
    tiers: int = 0  # bit i set: the store's tier at position i holds the block (bit 0: L1)
    depth: int = 1


class BlockHashIndex:
    """Cached blocks across tiers, keyed by hash; a tier is one bit of a mask."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, IndexNode] = {}
        self._children: dict[bytes, int] = {}  # parent hash -> indexed children (the parent may not be indexed)
        self._leaves = 0
        self._leaf_depths = 0

    def add(self, key: bytes, parent: bytes | None, tier: int) -> bool:
        """Record that ``tier`` (a bit) holds ``key``; True if the block was not cached anywhere before."""
        node = self.nodes.get(key)
        if node is not None:
            node.tiers |= tier
            if node.parent is None and parent is not None:
                node.parent = parent
                self._link(parent)
            return False
        parent_node = self.nodes.get(parent) if parent is not None else None
        node = self.nodes[key] = IndexNode(key, parent, tier, parent_node.depth + 1 if parent_node else 1)
        if key not in self._children:
            self._count_leaf(node, 1)
        if parent is not None:
            self._link(parent)
        return True

    def discard(self, key: bytes, tier: int) -> bool:
        """Record that ``tier`` (a bit) no longer holds ``key``; True if no tier holds it any more."""
        node = self.nodes.get(key)
        if node is None:
            return False
        node.tiers &= ~tier
        if node.tiers:
            return False
        del self.nodes[key]
        if key not in self._children:
            self._count_leaf(node, -1)
        if node.parent is not None:
            self._unlink(node.parent)
        return True

    def tiers_of(self, key: bytes) -> int:
        node = self.nodes.get(key)
        return node.tiers if node else 0

    def parent_of(self, key: bytes) -> bytes | None:
        node = self.nodes.get(key)
        return node.parent if node else None

    def num_children(self, key: bytes) -> int:
        return self._children.get(key, 0)

    def keys_held_by(self, tier: int) -> list[bytes]:
        """Every key ``tier`` (a bit) holds; walks the whole index."""
        return [key for key, node in self.nodes.items() if node.tiers & tier]

    def stats(self, block_size: int) -> IndexStats:
        """Cached blocks, active prefixes (leaves) and their mean length in tokens; O(1)."""
        average = self._leaf_depths * block_size / self._leaves if self._leaves else 0.0
        return IndexStats(len(self.nodes), self._leaves, average)

    def check_integrity(self) -> None:
        """Raise AssertionError unless child counts match the parent links, no node is empty,
        and the live statistics equal a recount."""
        counts: dict[bytes, int] = {}
        for node in self.nodes.values():
            assert node.tiers, f"node {node.key.hex()} is held by no tier"
            assert node.depth >= 1, f"node {node.key.hex()} has depth {node.depth}"
            if node.parent is not None:
                counts[node.parent] = counts.get(node.parent, 0) + 1
        assert counts == self._children, "child counts disagree with parent links"
        leaves = [node for key, node in self.nodes.items() if key not in counts]
        assert self._leaves == len(leaves), f"leaf count {self._leaves}, recounted {len(leaves)}"
        depths = sum(node.depth for node in leaves)
        assert self._leaf_depths == depths, f"summed leaf depth {self._leaf_depths}, recounted {depths}"

    # ---- upkeep of the live statistics ------------------------------------------

    def _count_leaf(self, node: IndexNode, sign: int) -> None:
        self._leaves += sign
        self._leaf_depths += sign * node.depth

    def _link(self, parent: bytes) -> None:
        count = self._children.get(parent, 0)
        self._children[parent] = count + 1
        if count == 0 and parent in self.nodes:
            self._count_leaf(self.nodes[parent], -1)  # it has a child now: no longer a leaf

    def _unlink(self, parent: bytes) -> None:
        remaining = self._children[parent] - 1
        if remaining:
            self._children[parent] = remaining
            return
        del self._children[parent]
        if parent in self.nodes:
            self._count_leaf(self.nodes[parent], 1)  # its last child left: a leaf again
