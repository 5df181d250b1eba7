"""``[kv_cache] ttl_seconds`` holds for every tier, L1 included: a block computed longer ago is served by none
of them, whether a sequence's lookup meets it in L1, in the memory tier (where parents of cached blocks are
held), or on disk; a block a running sequence uses, or a named prefix pins, stays."""

from __future__ import annotations

import time

import pytest

from tests.effects_lab import run_keyed
from tests.engine_helpers import build_checkpoint, make_engine
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

TTL = 1.0
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
PROMPT = "Tram timetables for the harbour line, the airport shuttle and the night buses of the old town. " * 2
OTHER = "A completely different context about gardens, tomatoes and a lemon tree on a sunny balcony. " * 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


def tier(engine, name):
    return engine.stats().cache.tiers[name]


@pytest.mark.parametrize("lower", ["memory", "disk"])
def test_no_tier_serves_a_block_past_the_ttl(checkpoint, tmp_path, lower):
    settings = {"kv_cache__block_size": 4, "kv_cache__ttl_seconds": TTL, "kv_cache__eviction_policy": "lru",
                "kv_cache__reuse_partial_blocks": False}  # whole blocks only: the counts below are exact
    if lower == "memory":
        settings.update(kv_cache__l1_capacity=48, kv_cache__l2_capacity=400, kv_cache__max_memory_bytes=2**26)
    else:
        settings.update(kv_cache__l1_capacity=48, kv_cache__max_memory_bytes=0, kv_cache__disk_path=str(tmp_path / "l3"))
    name = "l2" if lower == "memory" else "l3"
    engine = make_engine(checkpoint, **settings)
    try:
        [first] = engine.generate([PROMPT], GREEDY)
        usable = (len(first.prompt_token_ids) - 1) // 4
        [again] = engine.generate([PROMPT], GREEDY)
        assert again.cached_tokens == 4 * usable  # within the TTL: L1 serves every full block
        time.sleep(TTL + 0.3)
        [late] = engine.generate([PROMPT], GREEDY)
        assert late.cached_tokens == 0 and late.token_ids == first.token_ids
        assert tier(engine, "l1").expirations >= 1

        # the prompt's blocks pushed down to the tier below, then left past the TTL there
        engine.generate([PROMPT + " Which stop?"], GREEDY)
        engine.offload_cache()
        engine.flush_cache()
        held = tier(engine, name).entries
        assert held >= usable
        [below] = engine.generate([PROMPT], GREEDY)
        assert below.cached_tokens == 4 * usable  # within the TTL: found below L1
        engine.offload_cache()
        engine.flush_cache()
        time.sleep(TTL + 0.3)
        [expired] = engine.generate([PROMPT], GREEDY)
        assert expired.cached_tokens == 0  # the first block is past the TTL: nothing after it is served either
        stats = tier(engine, name)
        assert stats.expirations >= 1
        if lower == "memory":  # the lookup that met the expired parent looked over the rest: none is left behind
            assert stats.entries <= held - usable
    finally:
        engine.close()


def test_a_block_in_use_or_named_outlives_the_ttl_in_l1(checkpoint):
    engine = make_engine(checkpoint, kv_cache__block_size=4, kv_cache__ttl_seconds=TTL, kv_cache__tiers=[],
                         kv_cache__reuse_partial_blocks=False)
    try:
        run_keyed(engine, OTHER, "garden")
        time.sleep(TTL + 0.3)
        [again] = engine.generate([OTHER], GREEDY)
        assert again.cached_tokens == 4 * ((len(again.prompt_token_ids) - 1) // 4)  # pinned by its key
        assert tier(engine, "l1").expirations == 0
    finally:
        engine.close()


def test_a_block_promoted_from_a_longer_lived_tier_is_served_from_l1_again(checkpoint, tmp_path):
    # L1's TTL counts from when a block entered L1: one promoted from a tier that keeps it longer is not read
    # from that tier again on every hit
    disk = {"name": "l3", "plugin": "disk", "path": str(tmp_path / "l3"), "persistent": False, "write_through": True,
            "ttl_seconds": 0}  # fmt: skip
    engine = make_engine(checkpoint, kv_cache__block_size=4, kv_cache__ttl_seconds=TTL, kv_cache__tiers=[disk],
                         kv_cache__reuse_partial_blocks=False)  # fmt: skip
    try:
        [first] = engine.generate([PROMPT], GREEDY)
        usable = (len(first.prompt_token_ids) - 1) // 4
        engine.flush_cache()
        time.sleep(TTL + 0.3)
        [late] = engine.generate([PROMPT], GREEDY)
        assert late.cached_tokens == 4 * usable  # past L1's TTL, not past the disk tier's (none)
        disk_hits = tier(engine, "l3").hits
        assert disk_hits == usable and tier(engine, "l1").expirations >= 1
        [again] = engine.generate([PROMPT], GREEDY)
        assert again.cached_tokens == 4 * usable and tier(engine, "l3").hits == disk_hits  # from L1 this time
    finally:
        engine.close()
