"""The presets carry the serving spec's cache sizes, each with its unit, and where a machine cannot hold a
size the engine takes less and logs why (``engine.memory_budget``)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from tests.engine_helpers import build_checkpoint, make_engine
from tierserve.engine.memory_budget import L1_SHARE, TIERS_SHARE, fit_l1_blocks, fit_memory_tiers, host_available_bytes
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.integration

GIB = 2**30


def test_the_presets_carry_the_specs_documented_values():
    prod = load_settings("production", environ={}).settings
    l2, l3 = prod.kv_cache.tiers
    assert (prod.kv_cache.l1_capacity, l2.options.capacity) == (10_000, 100_000)  # entries (KV blocks)
    assert (l2.options.max_bytes, l3.options.max_bytes) == (8 * 10**9, 10 * 10**9)  # 8 GB memory, 10 GB disk
    assert l3.options.persistent and l3.plugin == "disk"
    assert (prod.speculative.beam_width, prod.sliding_window.window_size) == (8, 1024)
    dev = load_settings("development", environ={}).settings
    [l2] = dev.kv_cache.tiers  # persistence disabled: no disk tier
    assert (dev.kv_cache.l1_capacity, l2.options.capacity, l2.options.max_bytes) == (1_000, 5_000, 500 * 10**6)
    assert (dev.speculative.beam_width, dev.sliding_window.window_size) == (2, 256)


def test_sizes_that_fit_are_kept_and_the_others_lowered_with_a_reason():
    assert fit_l1_blocks(10_000, 2**20, "cpu", 64 * GIB).reason is None
    fitted = fit_l1_blocks(10_000, 2**20, "cpu", 8 * GIB)
    assert fitted.value == int(8 * GIB * L1_SHARE) // 2**20 and "10000 blocks" in fitted.reason
    assert fit_l1_blocks(10_000, 2**20, "cpu", None).value == 10_000  # memory unknown: as configured
    assert fit_l1_blocks(10_000, 2**20, "cpu", 8 * GIB, share=0.25).value == 2 * GIB // 2**20
    kept = fit_memory_tiers([8 * 10**9], 64 * GIB)
    assert kept[0].value == 8 * 10**9 and kept[0].reason is None
    [lowered, unbounded] = fit_memory_tiers([8 * 10**9, 0], 4 * GIB)
    assert lowered.value == int(4 * GIB * TIERS_SHARE) and "host memory" in lowered.reason
    assert unbounded.value == 0 and unbounded.reason is None


def test_an_engine_configured_past_the_machine_starts_smaller_and_says_why(tmp_path):
    available = host_available_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo here: nothing is sized down")
    checkpoint = build_checkpoint(tmp_path, "llama", "llama")
    with capture_logs() as logs:
        engine = make_engine(checkpoint, kv_cache__l1_capacity=10**9, kv_cache__max_memory_bytes=10**16,
                             kv_cache__l1_memory_fraction=0.001)  # a thousandth of the free memory: a small pool
    try:
        stats = engine.stats()
        assert 0 < stats.kv_blocks_total < 10**9
        [l1] = [e for e in logs if e["event"] == "kv_l1_sized_down"]
        assert l1["configured_blocks"] == 10**9 and l1["blocks"] == stats.kv_blocks_total and "free on cpu" in l1["reason"]
        [l2] = [e for e in logs if e["event"] == "kv_memory_tier_sized_down"]
        assert l2["tier"] == "l2" and l2["max_bytes"] < 10**16 and stats.cache.tiers["l2"].capacity_bytes == l2["max_bytes"]
        [answer] = engine.generate(["Hello there"])
        assert answer.token_ids
    finally:
        engine.close()
