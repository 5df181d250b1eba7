"""Tests of the SQLite cache tier: tierserve's conformance rules, then a served engine using it."""

import re
import sqlite3

import pytest
import torch

import sqlite_tier
from sqlite_tier import SqliteTier, SqliteTierSettings
from tierserve.plugin_api import CacheEntry, TierSettings
from tierserve.testing import check_cache_tier, eviction_policy, http_client, plugin_manager

# a plugin loaded as a module is named by its module in plugin_figures and /metrics
PLUGIN = "sqlite_tier"


@pytest.mark.parametrize("persistent", [False, True])
def test_keeps_the_cache_tier_rules(tmp_path, persistent):
    # One path for every tier the rules build: the fingerprint rule then really shares one file.
    rules = check_cache_tier(
        SqliteTier, {"path": str(tmp_path / "kv.db"), "max_entries": 16, "persistent": persistent}
    )
    assert not [r for r in rules if "skipped" in r], rules


def test_settings_are_validated():
    with pytest.raises(ValueError):
        SqliteTierSettings(path="x.db", max_entries=0)
    with pytest.raises(ValueError):
        SqliteTierSettings(path="x.db", colour="blue")


def test_a_persistent_tier_survives_a_restart_and_keeps_other_models_apart(tmp_path):
    def build(fingerprint, persistent=True):
        tier = TierSettings(
            name="db", plugin="sqlite", eviction_policy="lru", ttl_seconds=None,
            options=SqliteTierSettings(path=str(tmp_path / "kv.db"), max_entries=8, persistent=persistent),
        )
        return SqliteTier(tier, eviction_policy("lru"), fingerprint)

    kv = torch.arange(2 * 2 * 4 * 1 * 8, dtype=torch.float32).reshape(2, 2, 4, 1, 8)
    a = build("model-a")
    a.put(CacheEntry(key=b"k" * 16, parent=None, token_ids=(1, 2, 3, 4), kv=kv, accesses=3))
    a.close()
    b = build("model-b")
    assert b.get(b"k" * 16) is None and len(b) == 0
    b.put(CacheEntry(key=b"k" * 16, parent=None, token_ids=(9, 9, 9, 9), kv=kv * 0))
    b.close()
    a = build("model-a")
    entry = a.get(b"k" * 16)
    assert entry is not None and entry.token_ids == (1, 2, 3, 4) and torch.equal(entry.kv, kv)
    assert a.access_count(b"k" * 16) == 4  # 3 credited + this hit
    a.close()
    a = build("model-a", persistent=False)  # not persistent: starts empty
    assert len(a) == 0
    a.close()


def _serve(client, prompts, rounds):
    usages = []
    for _ in range(rounds):
        for prompt in prompts:
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
            usages.append(response.json()["usage"])
    return usages


def test_blocks_evicted_from_l1_are_served_from_sqlite(tmp_path):
    plugins = plugin_manager(sqlite_tier)
    tiers = [{"name": "db", "plugin": "sqlite", "path": str(tmp_path / "kv.db"), "max_entries": 64}]
    # L1 of 16 blocks of 16 tokens; each prompt is ~237 tokens (15 blocks): every new prompt evicts the last.
    settings = {"kv_cache.tiers": tiers, "kv_cache.l1_capacity": 16, "kv_cache.block_size": 16}
    prompts = [f"Prompt number {i}: " + " ".join(f"word{i}x{j}" for j in range(40)) for i in range(4)]
    with http_client(settings, plugins) as client:
        usages = _serve(client, prompts, rounds=2)
        # The second round finds each prompt's blocks in SQLite (L1 only holds the last prompt's).
        assert all(u["prompt_tokens_details"]["cached_tokens"] >= 16 * 10 for u in usages[len(prompts):]), usages

        stats = client.get("/v1/cache/stats").json()
        figures = stats["plugin_figures"][PLUGIN]["db"]
        assert figures["rows_written"] > 0
        assert figures["rows_read"] > 0
        assert figures["file_bytes"] > 0
        assert figures["rows"] > 0
        tier_stats = stats["cache_manager"]["kv_cache"]["tiers"]["db"]
        assert tier_stats["hits"] == figures["rows_read"]
        assert tier_stats["medium"] == "disk" and tier_stats["capacity_entries"] == 64

        metrics = client.get("/metrics").text
        for name, kind in [("rows_written", "counter"), ("rows_read", "counter"), ("file_bytes", "gauge")]:
            metric = f"tierserve_plugin_cache_tier_sqlite_{name}" + ("_total" if kind == "counter" else "")
            assert f"# TYPE {metric} {kind}" in metrics
            match = re.search(
                rf'^{metric}\{{instance="db",plugin="{PLUGIN}"\}} (\S+)$', metrics, re.MULTILINE
            )
            assert match, f"{metric} missing from /metrics"
            assert float(match.group(1)) > 0

        client.engine.check_integrity()

    # The rows are really in the file, under a fingerprint.
    with sqlite3.connect(tmp_path / "kv.db") as db:
        assert db.execute("SELECT count(*) FROM blocks").fetchone()[0] == figures["rows"]


def test_a_small_bound_evicts_and_the_engine_stays_consistent(tmp_path):
    plugins = plugin_manager(sqlite_tier)
    tiers = [{"name": "db", "plugin": "sqlite", "path": str(tmp_path / "kv.db"), "max_entries": 20}]
    settings = {"kv_cache.tiers": tiers, "kv_cache.l1_capacity": 16}
    prompts = [f"Another prompt {i}: " + " ".join(f"tok{i}y{j}" for j in range(40)) for i in range(4)]
    with http_client(settings, plugins) as client:
        _serve(client, prompts, rounds=2)
        stats = client.get("/v1/cache/stats").json()
        figures = stats["plugin_figures"][PLUGIN]["db"]
        tier_stats = stats["cache_manager"]["kv_cache"]["tiers"]["db"]
        assert figures["rows"] <= 20 and tier_stats["entries"] <= 20
        assert figures["rows_deleted"] > 0 and tier_stats["evictions"] > 0
        client.engine.check_integrity()
