"""The disk tier's byte bound holds at all times, whatever the store holds or pins in it.

The last tier holds parents that cached children need, so leaves go first;
those holds give way to ``max_bytes`` (leaves first), pinned prefixes never
do, and a write that would need a pinned entry's room is dropped and counted.
Bytes are measured on the filesystem (the block files in the directory) and
from the tier's own accounting after every request.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_helpers import build_checkpoint, make_engine
from tests.store_helpers import (
    PROMPT_BLOCKS,
    Requests,
    StoreTier,
    block_file_bytes,
    build_tier,
    disk_entry_bytes,
    prompt,
)
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BOUND = 200_000
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def legacy_keys(l3: Path) -> dict[str, object]:
    """L2 and a persistent L3 through the original ``[kv_cache]`` keys (``max_disk_bytes``)."""
    return {
        "kv_cache__l2_capacity": 400,
        "kv_cache__max_memory_bytes": 64 * 1024 * 1024,
        "kv_cache__disk_path": str(l3),
        "kv_cache__persistence": True,
        "kv_cache__max_disk_bytes": BOUND,
    }


def tier_keys(l3: Path) -> dict[str, object]:
    """The same tiers as ``[[kv_cache.tiers]]`` entries (the disk tier's ``max_bytes``)."""
    l2 = {"name": "l2", "plugin": "memory", "capacity": 400, "max_bytes": 64 * 1024 * 1024}
    disk = {"name": "l3", "plugin": "disk", "path": str(l3), "max_bytes": BOUND, "persistent": True}
    return {"kv_cache__tiers": [l2, disk | {"write_through": True}]}


def distinct_prompt(n: int) -> str:
    return f"Request {n} about its own topic, {n * 7919} and {n * 104729}: " + "tell me more, and more again. " * 2


@pytest.mark.parametrize("disk_keys", [legacy_keys, tier_keys], ids=["max_disk_bytes", "tiers-max_bytes"])
def test_the_disk_tier_never_holds_more_than_its_bound_while_running(tmp_path, disk_keys):
    path = build_checkpoint(tmp_path, "m", "llama")
    l3 = tmp_path / "l3"
    settings = {"kv_cache__block_size": 4, "kv_cache__l1_capacity": 64, "kv_cache__eviction_policy": "lru"}
    engine = make_engine(path, **settings, **disk_keys(l3))
    try:
        for n in range(40):
            engine.generate([distinct_prompt(n)], GREEDY)
            engine.flush_cache()
            on_disk = block_file_bytes(l3)
            tier = engine.stats().cache.tiers["l3"]
            assert on_disk <= BOUND and tier.bytes <= BOUND, f"after request {n}: {on_disk} bytes on disk"
            assert tier.bytes == on_disk
        stats = engine.stats().cache
        assert stats.write_through * (tier.bytes / tier.entries) > 3 * BOUND  # the writes went well past the bound
        assert stats.tiers["l3"].evictions > 0
        engine.check_integrity()

        engine.clear_cache("l1")
        engine.clear_cache("l2")
        [again] = engine.generate([distinct_prompt(39)], GREEDY)  # the newest prompt is still on disk
        assert again.cached_tokens > 0 and engine.stats().cache.promotions["l3"] > 0
    finally:
        engine.close()


def test_pinned_blocks_stay_and_writes_that_would_need_their_room_are_dropped(tmp_path):
    entry = disk_entry_bytes()
    bound = int((PROMPT_BLOCKS + 1.5) * entry)  # the pinned prompt and one block more
    disk = build_tier("disk", path=str(tmp_path / "l3"), max_bytes=bound)
    requests = Requests(2 * PROMPT_BLOCKS + 1, [StoreTier("l3", disk, write_through=True)])
    store = requests.store
    try:
        requests.run(prompt(0))
        keyed = requests.hashes(prompt(0))
        store.pin(keyed)
        for n in range(1, 10):
            seq, _ = requests.start(prompt(n))  # running: its blocks are parents of cached children
            store.flush()
            assert block_file_bytes(tmp_path / "l3") <= bound and disk.bytes_used <= bound, f"prompt {n}"
            requests.finish(seq)
            assert all(requests.tiers_holding(key)[-1] == "l3" for key in keyed)
        tier = store.snapshot().tiers["l3"]
        assert tier.dropped_writes > 0 and tier.entries <= PROMPT_BLOCKS + 1
        assert block_file_bytes(tmp_path / "l3") == disk.bytes_used

        store.unpin(keyed)  # without the pins, the bound makes room for new prompts again
        dropped = tier.dropped_writes
        requests.run(prompt(20))
        tier = store.snapshot().tiers["l3"]
        assert tier.dropped_writes == dropped and tier.evictions > 0
        assert block_file_bytes(tmp_path / "l3") <= bound
    finally:
        requests.close()


def test_a_block_file_is_written_in_one_call_and_holds_exactly_the_stored_bytes(tmp_path, monkeypatch):
    """Bytes full of newlines (diskcache's own store would write them line by line, ~one write per 256
    bytes of a KV block): one chunk reaches the file, whose bytes are the value's, read back unchanged."""
    from tierserve.plugins.tiers.disk_directory import BytesOnlyDisk, open_directory

    chunks: list[int] = []
    write = BytesOnlyDisk._write

    def counting(self, full_path, iterator, mode, encoding=None):
        parts = list(iterator)
        chunks.append(len(parts))
        return write(self, full_path, parts, mode, encoding)

    monkeypatch.setattr(BytesOnlyDisk, "_write", counting)
    cache = open_directory(tmp_path / "l3", "l3")
    value = (b"kv\n" * 70_000) + bytes(range(256)) * 40
    cache.set("ab" * 32, value, tag="cd" * 32, retry=True)
    assert chunks == [1]
    [file] = list((tmp_path / "l3").rglob("*.val"))
    assert file.read_bytes() == value
    assert cache.get("ab" * 32) == value
    cache.close()
