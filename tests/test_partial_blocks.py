"""Partial-block reuse: a prompt whose cached whole blocks end inside a block L1 holds copies that block's start.

A conversation's next turn repeats the last prompt, then sends back a reply
that is not the one the model generated: the block the last prompt ended in
holds the prompt's last tokens and then generated ones, so it never matches
whole. Its start is reused by copying it into a block of the new sequence's.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import build_checkpoint, make_engine
from tests.test_tiered_store import BLOCK, FINGERPRINT, LRU, Arena, kv_for
from tierserve.cache.block_pool import BlockPool
from tierserve.cache.kv_manager import KVCacheManager
from tierserve.cache.store import TieredStore
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.sequence import Sequence

pytestmark = pytest.mark.unit

FIRST = list(range(100, 112))  # three whole blocks of BLOCK = 4


class Store:
    """The store over an arena, sequences computed as the engine does (whole blocks of KV a function of the tokens)."""

    def __init__(self, num_blocks: int = 16, reuse: bool = True) -> None:
        self.arena = Arena(num_blocks)
        self.pool = BlockPool(num_blocks, BLOCK, LRU(num_blocks))
        self.store = TieredStore(self.pool, self.arena, FINGERPRINT, reuse_partial_blocks=reuse)
        self.kv = KVCacheManager(self.pool, self.store)
        self.count = 0

    def admit(self, tokens: list[int], salt: str | None = None) -> Sequence:
        self.count += 1
        seq = Sequence(self.count, f"r{self.count}", list(tokens), len(tokens), SamplingParams(), cache_salt=salt)
        self.kv.match_prefix(seq)
        return seq

    def compute(self, seq: Sequence) -> None:
        """Write the KV of every block from the first uncached one, publish the full ones, free the sequence."""
        assert self.kv.allocate_slots(seq, seq.num_tokens)
        for index in range(seq.num_computed_tokens // BLOCK, len(seq.block_table)):
            self.arena.write_blocks([seq.block_table[index]], kv_for(seq.token_ids[: (index + 1) * BLOCK]).unsqueeze(0))
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_computed(seq)
        self.kv.free(seq)
        self.store.check_integrity()


def block_holding(pool: BlockPool, tokens: list[int]) -> int:
    return next(block.block_id for block in pool.blocks if block.token_ids == tuple(tokens))


def test_a_prompt_ending_inside_a_cached_block_copies_its_start():
    s = Store()
    s.compute(s.admit(FIRST))
    source = block_holding(s.pool, FIRST[8:12])
    seq = s.admit(FIRST[:10] + [7, 8, 9])  # blocks 0-1 whole, then two of block 2's tokens
    assert seq.num_computed_tokens == seq.num_cached_tokens == 10
    assert seq.cache_info.cached_tokens == 10
    copy = seq.block_table[2]
    assert copy != source and s.pool.blocks[copy].block_hash is None  # the sequence's own, unregistered
    assert torch.equal(s.arena.read_blocks([copy]), s.arena.read_blocks([source]))
    assert s.store.snapshot().partial_block_tokens == 2
    s.compute(seq)  # its block 2 completes with its own tokens and is published under their hash
    assert s.admit(FIRST[:10] + [7, 8, 9, 1]).num_cached_tokens == 12


def test_the_longest_shared_start_wins_and_the_last_prompt_token_is_computed():
    s = Store()
    s.compute(s.admit(FIRST))
    s.compute(s.admit(FIRST[:9] + [50, 51, 52]))  # a second block 2 sharing one token
    assert s.admit(FIRST[:11] + [60]).num_cached_tokens == 11
    assert s.admit(FIRST[:9] + [50, 51, 99]).num_cached_tokens == 11
    assert s.admit(FIRST[:11]).num_cached_tokens == 10  # all but the last token, whose logits are needed
    assert s.admit(FIRST[:3] + [1, 2]).num_cached_tokens == 3  # a first block, found after the root


def test_no_reuse_across_salts_when_turned_off_or_once_the_block_is_gone():
    s = Store()
    s.compute(s.admit(FIRST))
    assert s.admit(FIRST[:10] + [7], salt="tenant").num_cached_tokens == 0
    assert Store(reuse=False).admit(FIRST[:10] + [7]).num_cached_tokens == 0
    off = Store(reuse=False)
    off.compute(off.admit(FIRST))
    assert off.admit(FIRST[:10] + [7]).num_cached_tokens == 8
    assert s.store.evict_keys([s.pool.blocks[block_holding(s.pool, FIRST[8:12])].block_hash]) == 1
    assert s.admit(FIRST[:10] + [7]).num_cached_tokens == 8
    s.store.check_integrity()


def test_whole_blocks_only_when_the_pool_cannot_hold_the_copy_and_the_rest():
    s = Store(num_blocks=5)
    s.compute(s.admit(FIRST))
    held = s.admit(FIRST[:8] + [1])  # shares blocks 0-1, then takes an empty block
    assert held.num_cached_tokens == 8 and s.kv.allocate_slots(held, held.num_tokens)
    # free: one empty block and FIRST's block 2 (cached, the copy's source): the copy fits, not a block after it
    assert s.pool.num_free_blocks == 2
    assert s.admit(FIRST[:10] + [7, 8, 9]).num_cached_tokens == 8  # 14 tokens: the copy and one more block
    assert s.pool.blocks[block_holding(s.pool, FIRST[8:12])].block_hash is not None  # the source stays cached
    fits = s.admit(FIRST[:10] + [7])  # 11 tokens: the copy alone
    assert fits.num_cached_tokens == 10 and s.pool.num_free_blocks == 1  # the source, still cached
    s.store.check_integrity()
    s.kv.free(fits)
    s.kv.free(held)
    held = s.admit(FIRST[:8] + [1])
    assert s.kv.allocate_slots(held, held.num_tokens + 2 * BLOCK)  # the empty blocks, then FIRST's block 2 evicted
    assert s.admit(FIRST[:10] + [7]).num_cached_tokens == 8  # the block is gone
    s.store.check_integrity()


def test_a_copy_worth_fewer_tokens_than_the_minimum_is_not_made():
    s = Store()
    s.store.partial_min_tokens = 3
    s.compute(s.admit(FIRST))
    assert s.admit(FIRST[:10] + [7]).num_cached_tokens == 8  # two tokens in common: recomputed
    assert s.admit(FIRST[:11] + [7]).num_cached_tokens == 11


def test_a_failed_copy_reuses_whole_blocks_and_frees_what_it_took():
    s = Store()
    s.compute(s.admit(FIRST))
    free = s.pool.num_free_blocks

    def broken(block_ids, data):
        raise RuntimeError("device lost")

    s.arena.write_blocks = broken
    seq = s.admit(FIRST[:10] + [7])
    assert seq.num_cached_tokens == 8 and len(seq.block_table) == 2
    assert s.pool.num_free_blocks == free - 2  # the two shared blocks are held now; the copy went back
    s.store.check_integrity()


def test_a_chats_next_turn_reuses_the_last_turns_tail_and_generates_what_a_cold_engine_does(tmp_path):
    """Turn two repeats turn one's prompt, then a reply other than the generated one: every prompt token
    of turn one is reused (the block it ended in was completed by generated tokens), and the greedy
    output equals an engine's that caches nothing."""
    path = build_checkpoint(tmp_path, "llama", "llama")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = [5 + (i * 7) % 150 for i in range(16 * 3 + 9)]
    engine = make_engine(path)
    cold = make_engine(path, kv_cache__enable_prefix_caching=False)
    try:
        [turn_one] = engine.generate([first], params)
        reply = [t + 1 if t < 150 else t - 1 for t in turn_one.token_ids[:6]]  # not what the model said
        second = first + reply + [11, 12, 13]
        [turn_two] = engine.generate([second], params)
        [reference] = cold.generate([second], params)
        assert turn_two.cached_tokens == len(first)  # 48 from whole blocks, 9 copied from the fourth
        assert turn_two.token_ids == reference.token_ids
        assert engine.stats().cache.partial_block_tokens == 9
        engine.check_integrity()
    finally:
        engine.close()
        cold.close()
