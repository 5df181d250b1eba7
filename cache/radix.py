"""Radix index over block hashes: which tiers hold each cached block, and the shape of the prefix tree.

Because block hashes are chained, a prefix is a path of hashes from a root;
``match`` walks a request's hashes and stops at the first block no tier holds,
returning where each matched block lives in one pass. Each node remembers its
parent, and the index counts children per key, so the tiered store can keep
internal nodes (blocks a cached descendant still needs) from being evicted
where eviction means loss: leaves go first.

    root ── h0 ── h1 ── h2        (prompt A)
                   └─── h2'       (prompt B shares A's first two blocks)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

L1, L2, L3 = 1, 2, 4
TIER_NAMES = {L1: "l1", L2: "l2", L3: "l3"}


@dataclass(slots=True)
class RadixNode:
    key: bytes
    parent: bytes | None
    tiers: int = 0  # bitmask of L1/L2/L3


class RadixIndex:
    """Cached blocks across tiers, keyed by hash."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, RadixNode] = {}
        self._children: dict[bytes, int] = {}

    def add(self, key: bytes, parent: bytes | None, tier: int) -> bool:
        """Record that ``tier`` holds ``key``; True if the block was not cached anywhere before."""
        node = self.nodes.get(key)
        if node is None:
            self.nodes[key] = RadixNode(key, parent, tier)
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
            return True
        node.tiers |= tier
        if node.parent is None and parent is not None:
            node.parent = parent
            self._children[parent] = self._children.get(parent, 0) + 1
        return False

    def discard(self, key: bytes, tier: int) -> bool:
        """Record that ``tier`` no longer holds ``key``; True if no tier holds it any more."""
        node = self.nodes.get(key)
        if node is None:
            return False
        node.tiers &= ~tier
        if node.tiers:
            return False
        del self.nodes[key]
        if node.parent is not None:
            remaining = self._children[node.parent] - 1
            if remaining:
                self._children[node.parent] = remaining
            else:
                del self._children[node.parent]
        return True

    def tiers_of(self, key: bytes) -> int:
        node = self.nodes.get(key)
        return node.tiers if node else 0

    def parent_of(self, key: bytes) -> bytes | None:
        node = self.nodes.get(key)
        return node.parent if node else None

    def num_children(self, key: bytes) -> int:
        return self._children.get(key, 0)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Tier bitmasks of the longest prefix of ``hashes`` that some tier holds."""
        found = []
        for key in hashes:
            node = self.nodes.get(key)
            if node is None:
                break
            found.append(node.tiers)
        return found

    def clear_tier(self, tier: int) -> list[bytes]:
        """Drop ``tier`` from every node; returns the keys no tier holds any more."""
        gone = [key for key, node in self.nodes.items() if node.tiers & tier]
        return [key for key in gone if self.discard(key, tier)]

    def leaves(self) -> Iterable[bytes]:
        return (key for key in self.nodes if key not in self._children)

    def stats(self, block_size: int) -> dict[str, float]:
        """Active prefixes (leaves) and their average length in tokens (walking to the root)."""
        lengths = []
        for leaf in self.leaves():
            depth, key = 0, leaf
            while key is not None and key in self.nodes:
                depth += 1
                key = self.nodes[key].parent
            lengths.append(depth * block_size)
        return {
            "cached_blocks": len(self.nodes),
            "active_prefixes": len(lengths),
            "avg_prefix_tokens": sum(lengths) / len(lengths) if lengths else 0.0,
        }

    def check_integrity(self) -> None:
        """Raise AssertionError unless child counts match the parent links and no node is empty."""
        counts: dict[bytes, int] = {}
        for node in self.nodes.values():
            assert node.tiers, f"node {node.key.hex()} is held by no tier"
            if node.parent is not None:
                counts[node.parent] = counts.get(node.parent, 0) + 1
        assert counts == self._children, "child counts disagree with parent links"
