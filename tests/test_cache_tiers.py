"""The built-in cache tiers, obtained through the plugin registry: L2 memory and L3 disk.

Disk faults are real where the test can make them real (bytes flipped,
files truncated or deleted on disk) and simulated where root cannot be
stopped (a full disk: diskcache's ``set`` raises ``ENOSPC``).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import diskcache
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.cache.codec import KVCodec
from tierserve.cache.tier import CacheEntry, CacheTier
from tierserve.core.tier_settings import TierSettings
from tierserve.core.plugins import load_plugins

pytestmark = pytest.mark.unit

FINGERPRINT = "tiny:float32:bs16"
_MANAGER = load_plugins(allowlist=[])
LRU = _MANAGER.registry("eviction_policies").get("lru").factory
TIERS = _MANAGER.registry("cache_tiers")

FLOATS = 64  # per entry: 256 bytes of float32
ENTRY_BYTES = FLOATS * 4


def entry(i: int, parent: int | None = None, created: float | None = None, floats: int = FLOATS) -> CacheEntry:
    kv = torch.randn(floats, generator=torch.Generator().manual_seed(i))
    return CacheEntry(
        key=key(i),
        parent=None if parent is None else key(parent),
        token_ids=(i, i + 1),
        kv=kv,
        created=time.time() if created is None else created,
    )


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def make_tier(plugin: str, ttl_seconds: float | None = None, fingerprint: str = FINGERPRINT, **options) -> CacheTier:
    """A tier built the way the engine builds one: ``factory(TierSettings, policy_factory, fingerprint)``."""
    component = TIERS.get(plugin)
    defaults = {"capacity": 100, "max_bytes": 0} if plugin == "memory" else {}
    tier = TierSettings(
        name="t", plugin=plugin, eviction_policy="lru", ttl_seconds=ttl_seconds,
        options=component.settings(**(defaults | options)),
    )  # fmt: skip
    return component.factory(tier, LRU, fingerprint)


def keys_of(evicted: list[CacheEntry]) -> list[bytes]:
    return [e.key for e in evicted]


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------


def test_both_tiers_are_registered_as_builtin_plugins(tmp_path):
    assert {"memory", "disk"} <= set(TIERS.names())
    memory = make_tier("memory")
    disk = make_tier("disk", path=str(tmp_path / "l3"))
    try:
        assert (memory.name, disk.name) == ("memory", "disk")
    finally:
        disk.close()


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread niceness is a Linux feature")
def test_disk_writer_thread_runs_at_the_configured_niceness(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    disk = make_tier("disk", path=str(tmp_path / "l3"), writer_nice=7)
    try:
        disk.put(entry(1))
        disk.flush()  # the writer has started and done its work
        assert os.getpriority(os.PRIO_PROCESS, disk._writer.native_id) == min(base + 7, 19)
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the step loop's threads keep theirs
        assert disk.get(key(1)) is not None
    finally:
        disk.close()


# ---------------------------------------------------------------------------
# memory (L2)
# ---------------------------------------------------------------------------


def test_memory_bound_by_entries_evicts_least_recently_used_and_returns_it():
    tier = make_tier("memory", capacity=3)
    for i in range(3):
        assert tier.put(entry(i)) == []
    assert tier.get(key(0)) is not None  # 1 is now the least recently used
    evicted = tier.put(entry(3))
    assert keys_of(evicted) == [key(1)]
    assert torch.equal(evicted[0].kv, entry(1).kv)
    assert sorted(tier.keys()) == [key(0), key(2), key(3)]
    assert len(tier) == 3 and tier.stats.evictions == 1
    tier.check_integrity()


def test_memory_bound_by_bytes():
    tier = make_tier("memory", capacity=100, max_bytes=3 * ENTRY_BYTES)
    for i in range(3):
        tier.put(entry(i))
    big = entry(10, floats=2 * FLOATS)
    assert keys_of(tier.put(big)) == [key(0), key(1)]
    assert tier.bytes_used == 3 * ENTRY_BYTES
    assert tier.stats.stored_bytes == tier.stats.raw_bytes == 3 * ENTRY_BYTES
    tier.check_integrity()


def test_memory_entry_bigger_than_the_tier_is_handed_back_unstored():
    tier = make_tier("memory", max_bytes=ENTRY_BYTES)
    tier.put(entry(0))
    huge = entry(1, floats=FLOATS + 1)
    assert tier.put(huge) == [huge]
    assert list(tier.keys()) == [key(0)]
    tier.check_integrity()


def test_memory_with_zero_capacity_stores_nothing():
    tier = make_tier("memory", capacity=0)
    e = entry(0)
    assert tier.put(e) == [e]
    assert len(tier) == 0 and tier.get(key(0)) is None


def test_memory_replacing_a_key_keeps_one_entry():
    tier = make_tier("memory", max_bytes=10 * ENTRY_BYTES)
    tier.put(entry(0))
    tier.put(entry(0, floats=2 * FLOATS))
    assert len(tier) == 1 and tier.bytes_used == 2 * ENTRY_BYTES
    tier.check_integrity()


def test_memory_pinned_entries_are_never_evicted():
    tier = make_tier("memory", capacity=2)
    tier.put(entry(0))
    tier.put(entry(1))
    tier.pin(key(0))
    assert keys_of(tier.put(entry(2))) == [key(1)]
    assert keys_of(tier.put(entry(3))) == [key(2)]
    tier.pin(key(3))
    newcomer = entry(4)
    assert tier.put(newcomer) == [newcomer]  # nothing evictable: the new entry goes down a tier
    assert sorted(tier.keys()) == [key(0), key(3)]
    tier.unpin(key(0))
    assert keys_of(tier.put(entry(5))) == [key(0)]
    tier.pin(key(99))  # not stored: ignored
    tier.check_integrity()


def test_memory_ttl_expires_old_entries_on_lookup():
    tier = make_tier("memory", ttl_seconds=60)
    tier.put(entry(0, created=time.time() - 61))
    tier.put(entry(1, created=time.time() - 61))
    tier.put(entry(2))
    assert tier.get(key(0)) is None
    assert not tier.contains(key(1))
    assert tier.get(key(2)) is not None
    assert tier.stats.expirations == 2
    assert (tier.stats.hits, tier.stats.misses) == (1, 1)
    assert list(tier.keys()) == [key(2)]
    tier.check_integrity()


@pytest.mark.parametrize("name", ["memory", "disk"])
def test_fields_of_a_returned_entry_belong_to_the_caller(name, tmp_path):
    # the tiered store reuses ``created`` of what it fetched; the tier's own record must not change
    tier = make_tier(name, ttl_seconds=60, **({"path": str(tmp_path / "l3")} if name == "disk" else {}))
    try:
        writer = BlockedWriter(tier) if name == "disk" else None
        tier.put(entry(0))
        tier.get(key(0)).created = -2.0  # on disk: served from the write queue, before it is written
        if writer:
            writer.release()
        tier.flush()
        got = tier.get(key(0))
        assert got is not None and got.created > 0
    finally:
        tier.close()


def test_memory_ttl_zero_never_expires():
    tier = make_tier("memory", ttl_seconds=0)
    tier.put(entry(0, created=0.0))
    assert tier.get(key(0)) is not None


def test_memory_stats_remove_clear_and_parents():
    tier = make_tier("memory")
    tier.put(entry(0))
    tier.put(entry(1, parent=0))
    assert tier.parent_of(key(1)) == key(0) and tier.parent_of(key(0)) is None
    assert tier.get(key(1)) is not None and tier.get(key(7)) is None
    stats = tier.stats
    assert (stats.hits, stats.misses, stats.puts) == (1, 1, 2)
    assert stats.hit_rate == 0.5 and stats.get_seconds > 0 and stats.put_seconds > 0
    tier.remove(key(0))
    tier.remove(key(0))  # absent: no error
    assert tier.bytes_used == ENTRY_BYTES
    assert tier.clear() == 1
    assert len(tier) == 0 and tier.bytes_used == 0 and stats.stored_bytes == 0
    tier.check_integrity()


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "get", "pin", "unpin", "remove"]), st.integers(0, 9), st.integers(1, 3)),
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(OPS)
def test_memory_bounds_and_bookkeeping_hold_under_any_operations(ops):
    tier = make_tier("memory", capacity=4, max_bytes=6 * ENTRY_BYTES)
    for op, i, size in ops:
        if op == "put":
            e = entry(i, floats=size * FLOATS)
            evicted = tier.put(e)
            assert tier.contains(key(i)) != (e in evicted)
        elif op == "get":
            tier.get(key(i))
        else:
            getattr(tier, op)(key(i))
        tier.check_integrity()
        assert len(tier) <= 4
        assert tier.bytes_used <= 6 * ENTRY_BYTES or all(tier.policy.is_pinned(k) for k in tier.keys())


# ---------------------------------------------------------------------------
# disk (L3)
# ---------------------------------------------------------------------------


@pytest.fixture
def disk(tmp_path):
    """``disk(**settings)`` opens a DiskTier on ``tmp_path/l3``; all are closed at the end."""
    opened: list[CacheTier] = []

    def open_tier(**overrides) -> CacheTier:
        tier = make_tier("disk", path=str(tmp_path / "l3"), **overrides)
        opened.append(tier)
        return tier

    yield open_tier
    for tier in opened:
        tier.close()


def value_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.val"))


def value_file(directory: Path, k: bytes) -> Path:
    with diskcache.Cache(str(directory)) as cache:
        handle = cache.get(k.hex(), read=True)
        handle.close()
        return Path(handle.name)


def encoded_size(e: CacheEntry) -> int:
    return len(KVCodec(FINGERPRINT).encode(e))


def test_disk_round_trip_writes_one_file_per_entry(disk, tmp_path):
    tier = disk()
    originals = [entry(0), entry(1, parent=0)]
    for e in originals:
        assert tier.put(e) == []
    tier.flush()
    assert len(value_files(tmp_path / "l3")) == 2
    for e in originals:
        got = tier.get(e.key)
        assert torch.equal(got.kv, e.kv)
        assert (got.parent, got.token_ids, got.created) == (e.parent, e.token_ids, e.created)
    assert tier.parent_of(key(1)) == key(0)
    assert tier.stats.hits == 2 and tier.get(key(5)) is None and tier.stats.misses == 1
    assert tier.bytes_used == sum(map(encoded_size, originals)) == tier.stats.stored_bytes
    assert tier.stats.raw_bytes == 2 * ENTRY_BYTES
    tier.check_integrity()


def test_disk_compresses(disk):
    tier = disk()
    tier.put(CacheEntry(key=key(0), parent=None, token_ids=(1,), kv=torch.zeros(4096)))
    tier.flush()
    assert tier.stats.compression_ratio > 20


def test_disk_restart_rebuilds_the_index_with_parents(disk):
    tier = disk(persistent=True)
    for i in range(4):
        tier.put(entry(i, parent=i - 1 if i else None))
    tier.close()

    again = disk(persistent=True)
    assert sorted(again.keys()) == [key(i) for i in range(4)]
    assert [again.parent_of(key(i)) for i in range(4)] == [None, key(0), key(1), key(2)]
    assert again.bytes_used == sum(encoded_size(entry(i, parent=i - 1 if i else None)) for i in range(4))
    got = again.get(key(3))
    assert torch.equal(got.kv, entry(3).kv) and got.parent == key(2)
    assert again.stats.raw_bytes > 0
    again.check_integrity()


def test_disk_restart_without_persistence_starts_empty(disk, tmp_path):
    tier = disk(persistent=True)
    tier.put(entry(0))
    tier.close()
    again = disk(persistent=False)
    assert len(again) == 0 and again.get(key(0)) is None
    assert value_files(tmp_path / "l3") == []


def test_disk_restart_uses_the_public_api_when_sql_is_unavailable(disk, monkeypatch):
    tier = disk(persistent=True)
    tier.put(entry(0))
    tier.put(entry(1, parent=0))
    tier.close()

    def no_sql(cache):
        raise RuntimeError("schema changed")

    from tierserve.plugins.tiers import disk_directory

    monkeypatch.setattr(disk_directory, "_rows_from_sql", no_sql)
    again = disk(persistent=True)
    assert sorted(again.keys()) == [key(0), key(1)] and again.parent_of(key(1)) == key(0)
    assert torch.equal(again.get(key(1)).kv, entry(1).kv)
    again.check_integrity()


def test_disk_byte_bound_evicts_least_recently_used(disk, tmp_path):
    size = encoded_size(entry(0))
    tier = disk(max_bytes=int(2.5 * size))
    for i in range(2):
        tier.put(entry(i))
        tier.flush()
    assert tier.get(key(0)) is not None  # 1 is now the least recently used
    tier.put(entry(2))
    tier.flush()
    assert sorted(tier.keys()) == [key(0), key(2)]
    assert tier.stats.evictions == 1 and tier.bytes_used <= 2.5 * size
    assert len(value_files(tmp_path / "l3")) == 2
    tier.check_integrity()


def test_disk_restart_with_a_smaller_bound_evicts_down_to_it(disk, tmp_path):
    size = encoded_size(entry(0))
    tier = disk(persistent=True)
    for i in range(4):
        tier.put(entry(i))
        tier.flush()
    tier.close()
    again = disk(persistent=True, max_bytes=2 * size)
    assert len(again) == 2 and again.bytes_used <= 2 * size and again.stats.evictions == 2
    assert len(value_files(tmp_path / "l3")) == 2
    assert sorted(again.keys()) == [key(2), key(3)]  # the oldest went first


def test_disk_pinned_entries_survive_the_bound(disk):
    size = encoded_size(entry(0))
    tier = disk(max_bytes=2 * size)
    tier.put(entry(0))
    tier.flush()
    tier.pin(key(0))
    for i in range(1, 4):
        tier.put(entry(i))
        tier.flush()
    assert key(0) in set(tier.keys()) and len(tier) == 2
    tier.check_integrity()


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def _corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def _corrupt_delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("damage", [_corrupt_flip, _corrupt_truncate, _corrupt_delete])
def test_disk_damaged_value_is_a_miss_and_is_deleted(disk, tmp_path, damage):
    tier = disk()
    tier.put(entry(0))
    tier.put(entry(1))
    tier.flush()
    damage(value_file(tmp_path / "l3", key(0)))
    assert tier.get(key(0)) is None
    assert tier.stats.corrupt == 1 and tier.stats.misses == 1
    assert not tier.contains(key(0)) and sorted(tier.keys()) == [key(1)]
    assert len(value_files(tmp_path / "l3")) == 1
    assert tier.bytes_used == encoded_size(entry(1))
    assert torch.equal(tier.get(key(1)).kv, entry(1).kv)
    tier.check_integrity()
    tier.put(entry(0))  # the key can be written again
    tier.flush()
    assert torch.equal(tier.get(key(0)).kv, entry(0).kv)


def test_disk_entry_of_another_model_is_a_miss_and_is_deleted(disk, tmp_path):
    tier = disk(persistent=True)
    tier.put(entry(0))
    tier.close()
    other = make_tier("disk", path=str(tmp_path / "l3"), persistent=True, fingerprint="another-model")
    try:
        assert other.contains(key(0))  # the index does not read values
        assert other.get(key(0)) is None
        assert other.stats.corrupt == 1 and len(other) == 0
        assert value_files(tmp_path / "l3") == []
    finally:
        other.close()


def test_disk_value_not_written_by_the_tier_is_never_unpickled(disk, tmp_path):
    tier = disk(persistent=True)
    tier.close()
    with diskcache.Cache(str(tmp_path / "l3")) as other_writer:
        other_writer.set(key(5).hex(), {"not": "bytes"})  # stored as a pickle
    again = disk(persistent=True)
    assert again.contains(key(5))
    assert again.get(key(5)) is None and again.stats.corrupt == 1 and len(again) == 0


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_disk_write_failure_is_counted_not_raised(disk, monkeypatch, code):
    tier = disk()

    def failing_set(self, *args, **kwargs):
        raise OSError(code, "simulated")

    monkeypatch.setattr(diskcache.Cache, "set", failing_set)
    assert tier.put(entry(0)) == []
    tier.flush()
    assert tier.stats.write_errors == 1
    assert not tier.contains(key(0)) and tier.get(key(0)) is None and len(tier) == 0
    monkeypatch.undo()
    tier.put(entry(0))
    tier.flush()
    assert tier.get(key(0)) is not None


class BlockedWriter:
    """Holds the disk tier's writer inside ``encode`` until ``release``."""

    def __init__(self, tier: CacheTier) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        encode = tier.codec.encode

        def blocked_encode(e: CacheEntry) -> bytes:
            self.entered.set()
            assert self.gate.wait(10)
            return encode(e)

        tier.codec.encode = blocked_encode

    def release(self) -> None:
        self.gate.set()


def test_disk_full_write_queue_drops_without_blocking(disk):
    tier = disk(write_queue=2)
    writer = BlockedWriter(tier)
    tier.put(entry(0))
    assert writer.entered.wait(5)  # the writer holds entry 0; the queue is empty
    tier.put(entry(1))
    tier.put(entry(2))
    start = time.perf_counter()
    assert tier.put(entry(3)) == []
    assert time.perf_counter() - start < 1
    assert tier.stats.dropped_writes == 1
    # queued and in-flight entries are visible before they are written
    assert all(tier.contains(key(i)) for i in range(3)) and not tier.contains(key(3))
    assert torch.equal(tier.get(key(2)).kv, entry(2).kv)
    writer.release()
    tier.flush(timeout=10)
    assert sorted(tier.keys()) == [key(0), key(1), key(2)] and tier.bytes_used > 0
    tier.check_integrity()


def test_disk_remove_and_clear_of_queued_entries_win_over_the_writer(disk, tmp_path):
    tier = disk()
    writer = BlockedWriter(tier)
    tier.put(entry(0))
    assert writer.entered.wait(5)
    tier.put(entry(1))
    tier.remove(key(0))  # while it is being written
    tier.remove(key(1))  # while it is queued
    writer.release()
    tier.flush(timeout=10)
    assert len(tier) == 0 and value_files(tmp_path / "l3") == []
    tier.put(entry(2))
    tier.flush()
    assert tier.clear() == 1 and value_files(tmp_path / "l3") == [] and tier.bytes_used == 0
    tier.check_integrity()


def test_disk_ttl_expires_and_deletes(disk, tmp_path):
    tier = disk(ttl_seconds=60)
    tier.put(entry(0, created=time.time() - 61))
    tier.put(entry(1))
    tier.flush()
    assert tier.get(key(0)) is None and tier.stats.expirations == 1
    assert tier.get(key(1)) is not None
    assert len(value_files(tmp_path / "l3")) == 1
    tier.check_integrity()


def test_disk_put_after_close_is_dropped(disk):
    tier = disk()
    tier.close()
    assert tier.put(entry(0)) == [] and tier.stats.dropped_writes == 1


def test_disk_without_a_path_says_what_to_set():
    tier = TierSettings.model_validate({"name": "l3", "plugin": "disk", "eviction_policy": "lru", "ttl_seconds": None})
    with pytest.raises(Exception, match=r"kv_cache.tiers\[l3\].path .*Field required"):
        TIERS.get("disk").factory(tier, LRU, FINGERPRINT)


def test_disk_concurrent_use_keeps_the_books(disk):
    size = encoded_size(entry(0))
    tier = disk(max_bytes=5 * size, write_queue=8)
    errors: list[BaseException] = []
    stop = time.perf_counter() + 0.7

    def worker(offset: int) -> None:
        try:
            i = offset
            while time.perf_counter() < stop:
                tier.put(entry(i % 12))
                got = tier.get(key((i * 7) % 12))
                assert got is None or torch.equal(got.kv, entry((i * 7) % 12).kv)
                if i % 5 == 0:
                    tier.remove(key((i * 3) % 12))
                i += 1
        except BaseException as exc:  # noqa: BLE001  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tier.flush(timeout=10)
    assert errors == []
    assert tier.stats.corrupt == 0 and tier.stats.write_errors == 0
    assert tier.bytes_used <= 5 * size
    tier.check_integrity()
