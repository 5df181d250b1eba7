"""Disk faults under a running engine: requests still answer correctly, faults are counted, nothing crashes.

Tests run as root, where chmod cannot make a directory read-only, so a full or
read-only disk is produced by making diskcache's own write and read calls fail
the way the OS does (ENOSPC, EROFS, EACCES).
"""

from __future__ import annotations

import errno

import diskcache
import pytest

from tests.engine_helpers import build_checkpoint, hf_greedy, make_engine
from tierserve.core.sampling_params import SamplingParams

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
