"""Access counts per block in each tier, kept by a persistent disk tier across restarts, and what they rank.

A hit (a tier's ``get`` that returns an entry, an L1 prefix hit) counts one
use where it was served; a demoted block carries its uses to the tier that
takes it. The store ranks prefixes by these counts and warms the best ones
into the faster tiers.
"""

from __future__ import annotations

import diskcache
import pytest
import torch
from structlog.testing import capture_logs

from tests.store_helpers import BLOCK, PROMPT_BLOCKS, Requests, StoreTier, build_tier, kv_for, prompt
from tests.waiting import wait_until
from tierserve.cache.tier import CacheEntry
from tierserve.plugins.tiers import disk_counts

pytestmark = pytest.mark.unit


def entry(i: int, accesses: int = 0) -> CacheEntry:
    tokens = prompt(i)[:BLOCK]
    return CacheEntry(i.to_bytes(16, "big"), None, tuple(tokens), kv_for(tokens), accesses=accesses)


# ---------------------------------------------------------------------------
# in each tier
# ---------------------------------------------------------------------------


def test_memory_tier_counts_hits_carries_them_out_with_evicted_entries_and_forgets_removed_ones():
    tier = build_tier("memory", capacity=2, max_bytes=0)
    tier.put(entry(0, accesses=5))  # five uses counted above it
    tier.put(entry(1))
    for _ in range(3):
        assert tier.get(entry(0).key).accesses == 0  # what get returns carries no count
    tier.get(entry(1).key)
    assert (tier.access_count(entry(0).key), tier.access_count(entry(1).key)) == (8, 1)
    tier.add_accesses(entry(1).key, 2)
    tier.add_accesses(entry(9).key, 2)  # not stored: ignored
    [evicted] = tier.put(entry(2))  # entry 0 is the least recently used
    assert evicted.key == entry(0).key and evicted.accesses == 8
    tier.remove(entry(1).key)
    tier.put(entry(1))
    assert tier.access_count(entry(1).key) == 0
    tier.check_integrity()


@pytest.mark.parametrize("persistent", [True, False])
def test_disk_tier_counts_survive_a_restart_only_when_persistent(tmp_path, persistent):
    tier = build_tier("disk", path=str(tmp_path / "l3"), persistent=persistent)
    tier.put(entry(0, accesses=2))
    assert tier.get(entry(0).key) is not None  # served from the write queue or the file: a use either way
    tier.put(entry(1))
    tier.flush()
    for _ in range(3):
        tier.get(entry(1).key)
    assert (tier.access_count(entry(0).key), tier.access_count(entry(1).key)) == (3, 3)
    tier.close()

    again = build_tier("disk", path=str(tmp_path / "l3"), persistent=persistent)
    try:
        expected = (3, 3) if persistent else (0, 0)
        assert (again.access_count(entry(0).key), again.access_count(entry(1).key)) == expected
        if persistent:
            assert sorted(again.keys()) == [entry(0).key, entry(1).key]  # the counts record is no entry
            assert again.stats.corrupt == 0
        again.check_integrity()
    finally:
        again.close()


def damage_record(path):
    with diskcache.Cache(str(path)) as cache:
        data = bytearray(cache.get(disk_counts.ACCESS_COUNTS_KEY))
        data[len(data) // 2] ^= 0xFF
        cache.set(disk_counts.ACCESS_COUNTS_KEY, bytes(data))


def delete_record(path):
    with diskcache.Cache(str(path)) as cache:
        assert cache.delete(disk_counts.ACCESS_COUNTS_KEY)


@pytest.mark.parametrize(
    "damage, event",
    [(damage_record, "kv_disk_access_counts_damaged"), (delete_record, "kv_disk_access_counts_missing")],
)
def test_a_damaged_or_missing_counts_record_reads_as_zeros_and_is_logged(tmp_path, damage, event):
    tier = build_tier("disk", path=str(tmp_path / "l3"), persistent=True)
    tier.put(entry(0))
    tier.flush()
    tier.get(entry(0).key)
    tier.close()
    damage(tmp_path / "l3")
    with capture_logs() as logs:
        again = build_tier("disk", path=str(tmp_path / "l3"), persistent=True)
    try:
        assert event in [line["event"] for line in logs]
        assert again.access_count(entry(0).key) == 0
        assert torch.equal(again.get(entry(0).key).kv, entry(0).kv)  # the entries themselves are intact
        assert again.access_count(entry(0).key) == 1
    finally:
        again.close()


def test_disk_tier_saves_counts_in_the_background_every_so_many_updates(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_counts, "SAVE_EVERY", 3)
    tier = build_tier("disk", path=str(tmp_path / "l3"), persistent=True)
    try:
        tier.put(entry(0))
        tier.flush()
        for _ in range(3):
            tier.get(entry(0).key)

        def saved() -> dict[bytes, int]:  # no flush, no close: the writer thread saved it
            with diskcache.Cache(str(tmp_path / "l3")) as cache:
                data = cache.get(disk_counts.ACCESS_COUNTS_KEY)
            return disk_counts.decode_counts(data) if data else {}

        assert wait_until(saved, what="the counts on disk") == {entry(0).key: 3}
    finally:
        tier.close()


def test_a_removed_disk_entry_takes_its_count_with_it(tmp_path):
    tier = build_tier("disk", path=str(tmp_path / "l3"), persistent=True)
    try:
        tier.put(entry(0))
        tier.flush()
        tier.get(entry(0).key)
        tier.remove(entry(0).key)
        tier.put(entry(0))
        tier.flush()
        assert tier.access_count(entry(0).key) == 0
    finally:
        tier.close()


# ---------------------------------------------------------------------------
# through the store: counts follow blocks down
# ---------------------------------------------------------------------------


def test_uses_in_l1_follow_a_block_down_to_the_tiers_below(tmp_path):
    tiers = [
        StoreTier("l2", build_tier("memory", capacity=PROMPT_BLOCKS, max_bytes=0)),
        StoreTier("l3", build_tier("disk", path=str(tmp_path / "l3"))),
    ]
    requests = Requests(PROMPT_BLOCKS + 1, tiers)
    store = requests.store
    try:
        hot = requests.hashes(prompt(0))
        for _ in range(4):  # one miss, three hits in l1
            requests.run(prompt(0))
        requests.run(prompt(1))  # prompt 0 to l2, with its three uses each
        assert [store.tiers[0].tier.access_count(key) for key in hot] == [3] * PROMPT_BLOCKS
        requests.run(prompt(2))  # prompt 0 on to l3
        store.flush()
        assert [store.tiers[1].tier.access_count(key) for key in hot] == [3] * PROMPT_BLOCKS
        assert requests.run(prompt(0))[0].hits["l3"] == PROMPT_BLOCKS  # one more use, counted in l3
        assert [store.tiers[1].tier.access_count(key) for key in hot] == [4] * PROMPT_BLOCKS
    finally:
        requests.close()
