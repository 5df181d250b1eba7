"""A tiered store over real KV tensors, driven as the engine drives it, with requests that can stay running.

Built on the arena and the "model" of ``test_tiered_store`` (KV is a fixed
function of the tokens so far, so a block served from any tier must equal
what a cold run computed, byte for byte).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.test_tiered_store import BLOCK, FINGERPRINT, LRU, PROMPT_BLOCKS, Arena, build_tier, kv_for, prompt
from tierserve.cache.block_pool import BlockPool
from tierserve.cache.codec import MAGIC, KVCodec
from tierserve.cache.hashing import extend_hashes
from tierserve.cache.kv_manager import KVCacheManager
from tierserve.cache.stats import PrefixMatch
from tierserve.cache.store import StoreTier, TieredStore
from tierserve.cache.tier import CacheEntry
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.sequence import Sequence

__all__ = [
    "BLOCK",
    "PROMPT_BLOCKS",
    "Requests",
    "StoreTier",
    "block_file_bytes",
    "build_tier",
    "disk_entry_bytes",
    "kv_for",
    "prompt",
]


class Requests:
    """Requests through a ``TieredStore``: lookup, allocate, compute what missed, publish; free when finished."""

    def __init__(self, num_blocks: int, tiers: list[StoreTier]) -> None:
        self.arena = Arena(num_blocks)
        self.pool = BlockPool(num_blocks, BLOCK, LRU(num_blocks))
        self.store = TieredStore(self.pool, self.arena, FINGERPRINT, tiers)
        self.kv = KVCacheManager(self.pool, self.store)
        self.count = 0

    def start(self, tokens: list[int]) -> tuple[Sequence, PrefixMatch]:
        """A request that keeps running (its blocks stay in use) until ``finish``."""
        self.count += 1
        seq = Sequence(self.count, f"r{self.count}", list(tokens), len(tokens), SamplingParams())
        match = self.kv.match_prefix(seq)
        assert self.kv.allocate_slots(seq, seq.num_tokens), "the pool is too small for this request"
        for index in range(seq.num_computed_tokens // BLOCK, len(seq.block_table)):
            self.arena.write_blocks([seq.block_table[index]], kv_for(tokens[: (index + 1) * BLOCK]).unsqueeze(0))
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_computed(seq)
        return seq, match

    def finish(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.store.check_integrity()

    def run(self, tokens: list[int]) -> tuple[PrefixMatch, torch.Tensor]:
        """One whole request; what its lookup found and the KV of its full prompt blocks."""
        seq, match = self.start(tokens)
        full = self.arena.read_blocks(seq.block_table[: len(tokens) // BLOCK])
        self.finish(seq)
        return match, full

    def hashes(self, tokens: list[int]) -> list[bytes]:
        """The store's hashes of the full blocks a request for ``tokens`` can reuse (not the last token)."""
        hashes: list[bytes] = []
        usable = (len(tokens) - 1) // BLOCK * BLOCK
        extend_hashes(hashes, self.store.root_for(None), tokens, BLOCK, usable)
        return hashes

    def tiers_holding(self, key: bytes) -> list[str]:
        held = self.store.index.tiers_of(key)
        return [name for position, name in enumerate(self.store.tier_names) if held & (1 << position)]

    def close(self) -> None:
        self.store.close()


def disk_entry_bytes() -> int:
    """Bytes one block of this test's KV takes on disk."""
    tokens = prompt(0)[:BLOCK]
    return len(KVCodec(FINGERPRINT).encode(CacheEntry(b"k" * 16, None, tuple(tokens), kv_for(tokens))))


def block_file_bytes(directory: Path) -> int:
    """Bytes of the KV block files under a disk tier's directory, measured on the filesystem (each
    starts with the codec's magic; the SQLite index and the access-counts record are not blocks)."""
    total = 0
    for path in Path(directory).rglob("*.val"):
        try:
            with path.open("rb") as handle:
                if handle.read(len(MAGIC)) == MAGIC:
                    total += path.stat().st_size
        except FileNotFoundError:
            continue  # deleted while the directory was walked
    return total
