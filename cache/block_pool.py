"""L1: the pool of fixed-size KV blocks and the per-sequence block tables built on it.

A block holds the K/V of ``block_size`` consecutive tokens of one sequence in
every layer of the arena. Blocks are reference-counted so several sequences
can share one (forked prompts, beams, cached prefixes). A block whose count
drops to zero is free: if it is registered under a prefix hash it stays
"cached-free" (its content is still valid and can be revived by a prefix hit)
until the eviction policy picks it for reuse; otherwise it goes straight back
to the plain free list.

    total = free (no content) + cached_free (hash kept, ref 0) + in_use (ref > 0)

The eviction policy orders cached content, keyed by block hash, not by slot:
a block is tracked from registration until its hash leaves the pool, pinned
while in use, and every prefix hit is a ``touch``. So frequency counts and
ARC's ghost lists describe content coming back, not a slot being reused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tierserve.cache.eviction import EvictionPolicy


class OutOfBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for."""


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block is registered in the prefix cache
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Allocates, shares and frees blocks; the eviction policy picks which cached-free block to reuse.

    Args:
        num_blocks: blocks in the arena.
        block_size: tokens per block.
        policy: orders registered blocks by hash (unit size each); it must
            be empty, and only the pool may drive it.
    """

    def __init__(self, num_blocks: int, block_size: int, policy: EvictionPolicy) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.policy = policy  # every registered hash; pinned while its block is in use
        self.cached: dict[bytes, int] = {}  # block hash -> block id (in use or cached-free)
        self.evictions = 0
        self.on_evict: Callable[[Block], None] | None = None
        self._free: deque[int] = deque(range(num_blocks))
        self._num_cached_free = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (plain free + cached-free)."""
        return len(self._free) + self._num_cached_free

    @property
    def num_empty_blocks(self) -> int:
        """Blocks that hold no KV worth keeping (neither in use nor cached)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks (ref 1), plain free ones first, then evicting cached-free ones."""
        if count > self.num_free_blocks:
            raise OutOfBlocksError(f"asked for {count} blocks, {self.num_free_blocks} free")
        allocated = []
        for _ in range(count):
            if self._free:
                block = self.blocks[self._free.popleft()]
            else:
                victim = self.policy.evict()  # a cached-free block exists, so one is unpinned
                block = self.blocks[self.cached[victim]]
                if self.on_evict is not None:
                    self.on_evict(block)  # write-back to the tier below before the data is overwritten
                self._forget(block)
                self._num_cached_free -= 1
                self.evictions += 1
            block.ref_count = 1
            allocated.append(block.block_id)
        return allocated

    def share(self, block_id: int) -> None:
        """Add a reference to a block in use, or revive a cached-free one.

        Sharing a registered block is a use of its content (a prefix hit):
        the policy is told, and a revived block is pinned while in use.
        """
        block = self.blocks[block_id]
        if block.block_hash is None:
            if block.ref_count == 0:
                raise ValueError(f"block {block_id} is free and holds no cached content")
        else:
            self.policy.touch(block.block_hash)
            if block.ref_count == 0:
                self.policy.pin(block.block_hash)
                self._num_cached_free -= 1
        block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; pass them in eviction order
        (the ones to reuse first come first: a recency policy counts the
        release as the block's latest use)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed more times than it was allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.append(block_id)
                else:
                    self.policy.unpin(block.block_hash)
                    self._num_cached_free += 1

    def register(self, block_id: int, block_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> bool:
        """Publish an in-use, fully computed block under its hash; False if that hash is already cached
        or the block already carries one."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is free; only a block in use can be registered")
        if block_hash in self.cached or block.block_hash is not None:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, token_ids
        self.cached[block_hash] = block_id
        self.policy.insert(block_hash, 1)
        self.policy.pin(block_hash)
        return True

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The cached block with this hash and exactly these tokens (guards against collisions)."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def uncache(self, block_hash: bytes) -> bool:
        """Withdraw a hash from the prefix cache; a cached-free block becomes plain free,
        a block in use keeps its data until freed."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return False
        block = self.blocks[block_id]
        self.policy.remove(block_hash)
        if block.ref_count == 0:
            self._num_cached_free -= 1
            self._free.append(block_id)
        self._forget(block)
        return True

    def _forget(self, block: Block) -> None:
        """Drop the block's registration (the caller settles the policy)."""
        del self.cached[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached-free + in-use == total, every count is sane,
        and the policy tracks exactly the registered hashes, pinned exactly while in use."""
        free = set(self._free)
        in_use = {b.block_id for b in self.blocks if b.ref_count > 0}
        cached = {b.block_id for b in self.blocks if b.ref_count == 0 and b.block_hash is not None}
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not (free & cached) and not (free & in_use), "a block is in two states"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} != total {self.num_blocks}"
        )
        assert self._num_cached_free == len(cached), f"cached-free count {self._num_cached_free}, found {len(cached)}"
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cached map points at block {block_id} wrongly"
        registered = sum(1 for b in self.blocks if b.block_hash is not None)
        assert registered == len(self.cached), "a block carries a hash the cached map does not know"
        assert set(self.policy) == set(self.cached), "policy keys differ from the registered hashes"
        pinned = {key for key in self.policy if self.policy.is_pinned(key)}
        in_use_hashes = {key for key, block_id in self.cached.items() if self.blocks[block_id].ref_count > 0}
        assert pinned == in_use_hashes, "pinned hashes differ from the registered blocks in use"
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            if block.block_id in free:
                assert block.block_hash is None, f"free block {block.block_id} still has a hash"
