"""Which cached prefixes were used most, from the access counts of the tiers below L1 (walked on an admin request).

A block's count is the sum of its access counts in the tiers below L1 that
hold it. Each use is counted once, where it was served, and travels down with
the block when it is demoted (and at ``close``), so the sum is every use the
cache has seen of the block, minus those still counted in L1.

A prefix is a chain of cached blocks from a prompt's first block (parent
``None``), as the index's parent links give it; a chain with a block no tier
holds cannot be served and is never listed.

    ranking: each block held below L1 with a count > 0 ends a candidate prefix;
             candidates go by that end block's count (most first), then longer first;
             a candidate inside a prefix already listed is not listed again.

So a shared system prompt used by every request comes first, on its own, and
a conversation that extends it comes later with its own, lower count.

``top_prefixes`` ranks the same way with L1 counted too (every use so far, for
the dashboard's "top prefixes"), while warming ranks only what sits below L1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierserve.cache.placement import L1

if TYPE_CHECKING:
    from tierserve.cache.store import TieredStore


def block_accesses(store: TieredStore, key: bytes) -> int:
    """The block's access count: the sum over the tiers below L1 that hold it."""
    held = store.index.tiers_of(key)
    return sum(t.tier.access_count(key) for position, t in enumerate(store.tiers, 1) if held & (1 << position))


def all_accesses(store: TieredStore, key: bytes) -> int:
    """The block's uses in every tier: its L1 count (when L1 holds it) plus ``block_accesses``."""
    block_id = store.pool.cached.get(key)
    in_l1 = store.pool.blocks[block_id].accesses if block_id is not None else 0
    return in_l1 + block_accesses(store, key)


@dataclass(frozen=True, slots=True)
class PrefixUse:
    """One cached prefix and how often it was used.

    Attributes:
        key: the hash of its last block (hex), as the index knows it.
        hits: uses of its last block so far, every tier counted.
        blocks: blocks from the prompt's first block to its last.
        tiers: the names of the tiers that hold its last block.
    """

    key: str
    hits: int
    blocks: int
    tiers: tuple[str, ...]


def ranked_prefixes(store: TieredStore, with_l1: bool = False) -> Iterator[list[bytes]]:
    """Every prefix worth warming, best first (see the module docstring); each is root first.
    ``with_l1``: blocks held only by L1 count too, with their L1 uses (``all_accesses``)."""
    store.placement.sync_removed()
    nodes = store.index.nodes
    lengths = _chain_lengths(store)
    held = ~0 if with_l1 else ~(1 << L1)
    accesses: Callable[[TieredStore, bytes], int] = all_accesses if with_l1 else block_accesses
    candidates = []
    for key, node in nodes.items():
        if node.tiers & held and lengths[key]:
            count = accesses(store, key)
            if count > 0:
                candidates.append((-count, -lengths[key], key))
    candidates.sort()
    listed: set[bytes] = set()
    for _, _, key in candidates:
        if key in listed:
            continue
        chain = [key]
        while chain[-1] in nodes and (parent := nodes[chain[-1]].parent) is not None:
            chain.append(parent)
        if chain[-1] not in nodes:  # a block left the cache while the caller warmed
            continue
        chain.reverse()
        listed.update(chain)
        yield chain


def frequent_prefixes(store: TieredStore, limit: int) -> list[list[bytes]]:
    """The first ``limit`` prefixes of ``ranked_prefixes``."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    prefixes = []
    for chain in ranked_prefixes(store):
        if len(prefixes) >= limit:
            break
        prefixes.append(chain)
    return prefixes


def top_prefixes(store: TieredStore, limit: int) -> list[PrefixUse]:
    """The ``limit`` prefixes used most, every tier counted (L1 included), best first."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    top = []
    for chain in ranked_prefixes(store, with_l1=True):
        if len(top) >= limit:
            break
        end = chain[-1]
        held = store.index.tiers_of(end)
        tiers = tuple(name for position, name in enumerate(store.tier_names) if held & (1 << position))
        top.append(PrefixUse(end.hex(), all_accesses(store, end), len(chain), tiers))
    return top


def settle_accesses(store: TieredStore) -> None:
    """Move every block's access counts down to the slowest tier that holds it (L1's too), so a
    tier that outlives the process keeps the uses its blocks had above it. For ``close``."""
    store.placement.sync_removed()
    pool, index = store.pool, store.index
    for key, block_id in pool.cached.items():
        block = pool.blocks[block_id]
        below = _next_holder(store, key, L1)
        if block.accesses and below is not None:
            store.tiers[below - 1].tier.add_accesses(key, block.accesses)
            block.accesses = 0
    for position, store_tier in enumerate(store.tiers[:-1], 1):
        for key in index.keys_held_by(1 << position):
            count = store_tier.tier.access_count(key)
            below = _next_holder(store, key, position)
            if count and below is not None:
                store.tiers[below - 1].tier.add_accesses(key, count)
                store_tier.tier.add_accesses(key, -count)


def _next_holder(store: TieredStore, key: bytes, position: int) -> int | None:
    held = store.index.tiers_of(key)
    for below in range(position + 1, len(store.tiers) + 1):
        if held & (1 << below):
            return below
    return None


def _chain_lengths(store: TieredStore) -> dict[bytes, int]:
    """Blocks from the root to each indexed block; 0 where an ancestor is not cached (not servable)."""
    nodes = store.index.nodes
    lengths: dict[bytes, int] = {}
    for start in nodes:
        path = []
        key: bytes | None = start
        while key is not None and key not in lengths and key in nodes:
            path.append(key)
            key = nodes[key].parent
        if key is None:
            base = 0  # reached a prompt's first block
        elif key in lengths:
            base = lengths[key] if lengths[key] else -1
        else:
            base = -1  # an ancestor no tier holds
        for offset, step in enumerate(reversed(path), 1):
            lengths[step] = 0 if base < 0 else base + offset
    return lengths
