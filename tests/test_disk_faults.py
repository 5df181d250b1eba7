"""Disk faults under a running engine: requests still answer correctly, faults are counted, nothing crashes.

A corrupt SQLite index is moved aside and rebuilt from the value files, so the
server still becomes ready.

Tests run as root, where chmod cannot make a directory read-only, so a full or
read-only disk is produced by making diskcache's own write and read calls fail
the way the OS does (ENOSPC, EROFS, EACCES).
"""

from __future__ import annotations

import errno
from pathlib import Path

import diskcache
import httpx
import pytest
import torch
from structlog.testing import capture_logs

from tests.engine_helpers import build_checkpoint, hf_greedy, make_engine
from tests.server_helpers import running_server
from tests.store_helpers import BLOCK, block_file_bytes, build_tier, kv_for, prompt
from tierserve.cache.tier import CacheEntry
from tierserve.settings.config import load_settings
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

PROMPT = "A shared context that spans several KV blocks of four tokens each, then a question. " * 2
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_writes_failing_leave_answers_correct(tmp_path, monkeypatch, code):
    path = build_checkpoint(tmp_path, "m", "llama")
    [expected] = hf_greedy(path, [PROMPT], 6)

    def failing_set(self, *args, **kwargs):
        raise OSError(code, "simulated: " + errno.errorcode[code])

    monkeypatch.setattr(diskcache.Cache, "set", failing_set)
    engine = make_engine(path, kv_cache__block_size=4, kv_cache__l2_capacity=0,
                         kv_cache__disk_path=str(tmp_path / "l3"), kv_cache__persistence=True)
    try:
        for _ in range(3):
            [result] = engine.generate([PROMPT], GREEDY)
            assert result.token_ids == expected
            engine.flush_cache()
            engine.clear_cache("l1")
        stats = engine.stats().cache.tiers["l3"]
        assert stats.write_errors > 0 and stats.entries == 0
        engine.check_integrity()
    finally:
        engine.close()


def test_reads_failing_are_misses(tmp_path, monkeypatch):
    path = build_checkpoint(tmp_path, "m", "llama")
    [expected] = hf_greedy(path, [PROMPT], 6)
    engine = make_engine(path, kv_cache__block_size=4, kv_cache__l2_capacity=0,
                         kv_cache__disk_path=str(tmp_path / "l3"), kv_cache__persistence=True)
    try:
        engine.generate([PROMPT], GREEDY)
        engine.flush_cache()
        engine.clear_cache("l1")

        def failing_get(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, "simulated: permission denied")

        monkeypatch.setattr(diskcache.Cache, "get", failing_get)
        [result] = engine.generate([PROMPT], GREEDY)
        assert result.token_ids == expected and result.cached_tokens == 0
        assert engine.stats().cache.tiers["l3"].corrupt >= 1  # counted, and the entry dropped
        engine.check_integrity()
    finally:
        monkeypatch.undo()
        engine.close()


# ---- a corrupt index -------------------------------------------------------------------------------


def garbage_index(directory: Path) -> bytes:
    """Overwrite the SQLite index with bytes that are no database; returns them."""
    garbage = b"not an index " * 500
    (directory / "cache.db").write_bytes(garbage)
    return garbage


def damaged_pages(directory: Path) -> bytes:
    """Keep the index's header but overwrite the pages after the first (SQLite: "malformed")."""
    index = directory / "cache.db"
    data = bytearray(index.read_bytes())
    data[4096:] = b"\xff" * (len(data) - 4096)
    index.write_bytes(bytes(data))
    return bytes(data)


def block(n: int) -> CacheEntry:
    tokens = prompt(n)[:BLOCK]
    return CacheEntry(bytes([n]) * 16, bytes([n - 1]) * 16 if n else None, tuple(tokens), kv_for(tokens))


@pytest.mark.parametrize("damage", [garbage_index, damaged_pages])
def test_a_corrupt_index_is_moved_aside_and_rebuilt_from_the_value_files(tmp_path, damage):
    directory = tmp_path / "l3"
    tier = build_tier("disk", path=str(directory), persistent=True)
    for n in range(6):
        tier.put(block(n))
    tier.get(block(2).key)  # an access count, saved with the entries
    tier.close()
    left = damage(directory)

    with capture_logs() as logs:
        again = build_tier("disk", path=str(directory), persistent=True)
    try:
        [warning] = [line for line in logs if line["event"] == "kv_disk_index_corrupt"]
        assert warning["log_level"] == "warning"
        [aside] = directory.glob("cache.db.corrupt-*")
        assert aside.read_bytes() == left and warning["moved_to"] == str(aside)  # kept for inspection
        assert again.stats.corrupt_indexes == 1 and again.stats.corrupt == 0
        assert len(again) == 6 and again.parent_of(block(3).key) == block(2).key
        for n in range(6):
            assert torch.equal(again.get(block(n).key).kv, block(n).kv)
        assert again.access_count(block(2).key) == 2  # the counts record was indexed again too
        again.check_integrity()
    finally:
        again.close()
    third = build_tier("disk", path=str(directory), persistent=True)  # the new index is whole
    try:
        assert len(third) == 6 and third.stats.corrupt_indexes == 0
    finally:
        third.close()


def test_a_spill_only_tier_with_a_corrupt_index_starts_empty(tmp_path):
    directory = tmp_path / "l3"
    tier = build_tier("disk", path=str(directory), persistent=False)
    tier.put(block(0))
    tier.close()
    garbage_index(directory)
    again = build_tier("disk", path=str(directory), persistent=False)
    try:
        assert len(again) == 0 and again.stats.corrupt_indexes == 1
        assert list(directory.glob("cache.db.corrupt-*")) and block_file_bytes(directory) == 0
    finally:
        again.close()


def test_a_server_on_a_corrupt_index_becomes_ready_and_serves_the_rebuilt_entries(tmp_path):
    path = build_checkpoint(tmp_path, "m", "llama")
    disk = {"block_size": 4, "l2_capacity": 0, "disk_path": str(tmp_path / "l3"), "persistence": True}
    engine = make_engine(path, **{f"kv_cache__{key}": value for key, value in disk.items()})
    try:
        [cold] = engine.generate([PROMPT], GREEDY)
        engine.flush_cache()
        stored = engine.stats().cache.tiers["l3"].entries
    finally:
        engine.close()
    left = garbage_index(tmp_path / "l3")

    overrides = {("kv_cache", key): value for key, value in disk.items()}
    overrides |= {("model", "path"): str(path), ("model", "device"): "cpu", ("server", "engine_process"): False}
    loaded = load_settings(None, environ={}, overrides=overrides)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:  # waits for /health/ready: 200
        l3 = httpx.get(f"{base}/v1/cache/stats", timeout=30).json()["cache_manager"]["kv_cache"]["tiers"]["l3"]
        assert l3["corrupt_indexes"] == 1 and l3["entries"] == stored > 0
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["text"] == cold.text
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # served from the rebuilt L3
    [aside] = (tmp_path / "l3").glob("cache.db.corrupt-*")
    assert aside.read_bytes() == left
