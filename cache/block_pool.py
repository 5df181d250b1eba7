"""L1: the pool of fixed-size KV blocks and the per-sequence block tables built on it.

A block holds the K/V of ``block_size`` consecutive tokens of one sequence in
every layer of the arena. Blocks are reference-counted so several sequences
can share one (forked prompts, beams, cached prefixes). A block whose count
drops to zero is free: if it is registered under a prefix hash it stays
"cached-free" (its content is still valid and can be revived by a prefix hit)
until the eviction policy picks it for reuse; otherwise it goes straight back
to the plain free list. A cached block may also be pinned (a named prefix
keeps it): with ref 0 it is then neither free nor evictable.

    total = free (no content) + cached_free (hash kept, ref 0) + pinned_idle (hash kept, ref 0, pinned)
            + in_use (ref > 0)

The eviction policy orders cached content, keyed by block hash, not by slot:
a block is tracked from registration until its hash leaves the pool, pinned
in the policy while in use or pinned here, and every prefix hit is a
``touch`` (and one more in the block's access count). So frequency counts and
ARC's ghost lists describe content coming back, not a slot being reused.
"""

from __future__ import annotations

import time

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from tierserve.cache.eviction import EvictionPolicy


MAX_CHILDREN_SCANNED = 32  # candidates ``longest_child`` compares, at most


class OutOfBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for."""


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block is registered in the prefix cache
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    follows: bytes | None = None  # the hash it is listed after in ``BlockPool.children`` (parent, or a root)
    accesses: int = 0  # prefix hits on the registered content; carried down a tier when the block is evicted
    created: float = 0.0  # time.time() when its content was first computed (a promoted block keeps its entry's)
    cached_at: float = 0.0  # time.time() when it was registered here (computed, or promoted from a tier)


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
        self.policy = policy  # every registered hash; pinned while its block is in use or pinned here
        self.cached: dict[bytes, int] = {}  # block hash -> block id (in use or cached-free)
        self.evictions = 0
        # write-back of the blocks one allocation evicted, all at once, before their data is overwritten (copies
        # of the blocks as they were: id, hash, parent, tokens, accesses)
        self.on_evict: Callable[[list[Block]], None] | None = None
        self.pinned: set[bytes] = set()  # hashes kept cached even with no sequence holding them
        # (parent hash or root, first token) -> registered blocks that follow it and begin with that token
        self.children: dict[tuple[bytes, int], set[int]] = {}
        # a stack: the block freed last is taken first, so the arena's pages already written are reused before
        # untouched ones are faulted in (resident memory grows with use, and a step does not pay the faults)
        self._free: deque[int] = deque(reversed(range(num_blocks)))
        self._num_cached_free = 0  # ref 0, registered, not pinned

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (plain free + cached-free; pinned blocks are not free)."""
        return len(self._free) + self._num_cached_free

    @property
    def num_pinned_idle_blocks(self) -> int:
        """Blocks kept only by a pin (no sequence holds them): neither free nor in use."""
        blocks, cached = self.blocks, self.cached
        return sum(1 for key in self.pinned if blocks[cached[key]].ref_count == 0)

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
        allocated, evicted = [], []
        for _ in range(count):
            if self._free:
                block = self.blocks[self._free.pop()]
            else:
                victim = self.policy.evict()  # a cached-free block exists, so one is unpinned
                block = self.blocks[self.cached[victim]]
                if self.on_evict is not None:
                    evicted.append(replace(block))  # what it held, for the write-back below
                self._forget(block)
                self._num_cached_free -= 1
                self.evictions += 1
            block.ref_count = 1
            allocated.append(block.block_id)
        if evicted:  # one write-back for all: the data stays until the caller writes the blocks
            self.on_evict(evicted)
        return allocated

    def share(self, block_id: int, *, hit: bool = True) -> None:
        """Add a reference to a block in use, or revive a cached (free or pinned) one.

        Sharing a registered block is a use of its content (a prefix hit):
        the policy is told, its access count grows, and a revived block is
        pinned in the policy while in use. ``hit=False`` holds the block
        without counting a use (the store holding blocks while it warms).
        """
        block = self.blocks[block_id]
        if block.block_hash is None:
            if block.ref_count == 0:
                raise ValueError(f"block {block_id} is free and holds no cached content")
        else:
            if hit:
                self.policy.touch(block.block_hash)
                block.accesses += 1
            if block.ref_count == 0 and block.block_hash not in self.pinned:
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
                elif block.block_hash not in self.pinned:
                    self.policy.unpin(block.block_hash)
                    self._num_cached_free += 1

    def register(
        self,
        block_id: int,
        block_hash: bytes,
        parent: bytes | None,
        token_ids: tuple[int, ...],
        root: bytes | None = None,
        created: float | None = None,
    ) -> bool:
        """Publish an in-use, fully computed block under its hash; False if that hash is already cached
        or the block already carries one. It is listed among ``parent``'s children (``longest_child``), a
        first block (no parent) among ``root``'s where one is given. ``created``: when its content was
        computed (a block promoted from a tier keeps its entry's time); None: now."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is free; only a block in use can be registered")
        if block_hash in self.cached or block.block_hash is not None:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, token_ids
        block.cached_at = time.time()
        block.created = block.cached_at if created is None else created
        self.cached[block_hash] = block_id
        block.follows = parent if parent is not None else root
        if block.follows is not None and token_ids:
            self.children.setdefault((block.follows, token_ids[0]), set()).add(block_id)
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
        """Withdraw a hash from the prefix cache (its pin too); a block no sequence holds
        becomes plain free, a block in use keeps its data until freed."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return False
        block = self.blocks[block_id]
        self.policy.remove(block_hash)
        if block.ref_count == 0:
            if block_hash not in self.pinned:
                self._num_cached_free -= 1
            self._free.append(block_id)
        self.pinned.discard(block_hash)
        self._forget(block)
        return True

    def pin(self, block_hash: bytes) -> None:
        """Keep a cached block from reuse until ``unpin``, even when no sequence holds it.

        A pinned block with no references is neither free (``num_free_blocks``
        leaves it out) nor evictable. Pins do not nest (the tiered store counts
        them); a hash not cached is ignored; ``uncache`` drops the pin.
        """
        block_id = self.cached.get(block_hash)
        if block_id is None or block_hash in self.pinned:
            return
        self.pinned.add(block_hash)
        if self.blocks[block_id].ref_count == 0:
            self.policy.pin(block_hash)
            self._num_cached_free -= 1

    def unpin(self, block_hash: bytes) -> None:
        """Let a pinned block be reused again once no sequence holds it; a hash not pinned is ignored."""
        if block_hash not in self.pinned:
            return
        self.pinned.discard(block_hash)
        if self.blocks[self.cached[block_hash]].ref_count == 0:
            self.policy.unpin(block_hash)
            self._num_cached_free += 1

    def longest_child(self, parent: bytes, token_ids: tuple[int, ...]) -> tuple[int, int] | None:
        """The registered block listed after ``parent`` (a block's hash, or a root for first blocks) whose
        tokens begin with the longest run of ``token_ids``: ``(block id, tokens in common)``, or None where
        no child shares even the first token."""
        best = None
        if not token_ids:
            return None
        for scanned, block_id in enumerate(self.children.get((parent, token_ids[0]), ())):
            if scanned == MAX_CHILDREN_SCANNED:  # a prompt's lookup stays bounded however many turns branch here
                break
            held = self.blocks[block_id].token_ids
            common = 0
            for mine, theirs in zip(token_ids, held):
                if mine != theirs:
                    break
                common += 1
            if common and (best is None or common > best[1]):
                best = (block_id, common)
        return best

    def _forget(self, block: Block) -> None:
        """Drop the block's registration (the caller settles the policy and the pin)."""
        if block.follows is not None and block.token_ids:
            key = (block.follows, block.token_ids[0])
            siblings = self.children[key]
            siblings.discard(block.block_id)
            if not siblings:
                del self.children[key]
        del self.cached[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = block.follows = None
        block.accesses = 0

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached-free + pinned-idle + in-use == total, every
        count is sane, only cached blocks are pinned, and the policy tracks exactly the
        registered hashes, pinned exactly while in use or pinned here."""
        free = set(self._free)
        in_use = {b.block_id for b in self.blocks if b.ref_count > 0}
        idle = {b.block_id for b in self.blocks if b.ref_count == 0 and b.block_hash is not None}
        pinned_idle = {block_id for block_id in idle if self.blocks[block_id].block_hash in self.pinned}
        cached = idle - pinned_idle
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not (free & idle) and not (free & in_use), "a block is in two states"
        assert len(free) + len(cached) + len(pinned_idle) + len(in_use) == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + pinned {len(pinned_idle)} + in use {len(in_use)} "
            f"!= total {self.num_blocks}"
        )
        assert self._num_cached_free == len(cached), f"cached-free count {self._num_cached_free}, found {len(cached)}"
        assert self.num_free_blocks == len(free) + len(cached), "num_free_blocks counts a block it cannot give"
        assert self.pinned <= self.cached.keys(), "a pinned hash is not cached"
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cached map points at block {block_id} wrongly"
        registered = sum(1 for b in self.blocks if b.block_hash is not None)
        assert registered == len(self.cached), "a block carries a hash the cached map does not know"
        listed = {(key, block_id) for key, children in self.children.items() for block_id in children}
        follows = {
            ((b.follows, b.token_ids[0]), b.block_id)
            for b in self.blocks
            if b.block_hash is not None and b.follows is not None and b.token_ids
        }
        assert listed == follows and all(self.children.values()), "the children lists differ from the blocks'"
        assert set(self.policy) == set(self.cached), "policy keys differ from the registered hashes"
        held = {key for key in self.policy if self.policy.is_pinned(key)}
        in_use_hashes = {key for key, block_id in self.cached.items() if self.blocks[block_id].ref_count > 0}
        assert held == in_use_hashes | self.pinned, "policy pins differ from the blocks in use or pinned"
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            assert block.accesses >= 0, f"block {block.block_id} has {block.accesses} accesses"
            if block.block_hash is None:
                assert block.accesses == 0, f"block {block.block_id} counts accesses of no content"
            if block.block_id in free:
                assert block.block_hash is None, f"free block {block.block_id} still has a hash"
