"""Prefix reuse across L1, L2 and L3: identical output, isolation, faults, integrity."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT
from tests.engine_helpers import PROMPTS, build_checkpoint, hf_greedy, make_engine
from tierserve.cache.hashing import extend_hashes
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant. Answer briefly, cite what you use, and say so when you do not know. "
    "The user is working on a garden: tomatoes, basil and a lemon tree on a sunny balcony. "
)
QUESTIONS = [SYSTEM + q for q in ("How often should I water?", "Which pots?", "When to prune the lemon tree?")]
OTHER = "A completely different context about trains, stations, timetables and the night bus to the airport. " * 2


def cache_settings(tmp_path, **extra):
    settings = {
        "kv_cache__block_size": 4,
        "kv_cache__l1_capacity": 64,
        "kv_cache__l2_capacity": 400,
        "kv_cache__max_memory_bytes": 64 * 1024 * 1024,
        "kv_cache__disk_path": str(tmp_path / "l3"),
        "kv_cache__persistence": True,
        "kv_cache__eviction_policy": "lru",
    }
    settings.update(extra)
    return settings


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma2"])
def checkpoint(request, tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param, request.param)
    return path, hf_greedy(path, QUESTIONS + [OTHER], NEW_TOKENS)


def check_clean(engine):
    engine.check_integrity()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.requests_queued == 0


def test_l1_l2_and_l3_hits_give_the_cold_output(checkpoint, tmp_path):
    path, expected = checkpoint
    engine = make_engine(path, **cache_settings(tmp_path))
    try:
        [cold] = engine.generate([QUESTIONS[0]], GREEDY)
        assert cold.token_ids == expected[0] and cold.cached_tokens == 0

        [l1] = engine.generate([QUESTIONS[1]], GREEDY)  # shares the system prompt from L1
        assert l1.token_ids == expected[1] and l1.cached_tokens >= 4 * (len(SYSTEM) // 40)

        engine.generate([OTHER, OTHER + "x", OTHER + "yz"], GREEDY)  # pushes the system prompt out of L1
        stats = engine.stats().cache
        assert stats.demotions["l2"] > 0
        [l2] = engine.generate([QUESTIONS[2]], GREEDY)
        assert l2.token_ids == expected[2] and l2.cached_tokens > 0
        assert engine.stats().cache.promotions["l2"] > 0
        check_clean(engine)
    finally:
        engine.close()

    # a new process finds the prefix on disk (L3) and answers identically
    script = textwrap.dedent(
        f"""
        import json
        from tests.engine_helpers import make_engine
        from tierserve.core.sampling_params import SamplingParams
        engine = make_engine({str(path)!r}, **{cache_settings(tmp_path)!r})
        [result] = engine.generate([{QUESTIONS[1]!r}], SamplingParams(temperature=0, max_tokens={NEW_TOKENS}, ignore_eos=True))
        stats = engine.stats().cache
        engine.check_integrity()
        engine.close()
        print(json.dumps({{"tokens": result.token_ids, "cached": result.cached_tokens, "l3": stats.promotions["l3"]}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    restarted = json.loads(result.stdout.strip().splitlines()[-1])
    assert restarted["tokens"] == expected[1]
    assert restarted["cached"] > 0 and restarted["l3"] > 0


def test_no_hit_across_tenants_or_models(tmp_path):
    path = build_checkpoint(tmp_path, "a", "llama")
    other = build_checkpoint(tmp_path, "b", "llama", num_hidden_layers=3)
    settings = cache_settings(tmp_path)
    engine = make_engine(path, **settings)
    params = GREEDY
    [first] = engine.generate([QUESTIONS[0]], params)
    ids = engine.encode_prompt(QUESTIONS[0])
    _, stream = engine.submit(ids, params, cache_salt="tenant-b")
    outputs = []
    while True:
        out = engine.next_output(stream)
        outputs.append(out)
        if out.finished:
            break
    assert outputs[-1].cached_tokens == 0  # tenant B never sees tenant A's prefix
    _, stream = engine.submit(ids, params, cache_salt=None)
    while not (out := engine.next_output(stream)).finished:
        pass
    assert out.cached_tokens > 0  # the same tenant does
    engine.close()

    # another model over the same L3 directory: nothing matches
    engine = make_engine(other, **settings)
    [result] = engine.generate([QUESTIONS[0]], params)
    assert result.cached_tokens == 0
    assert engine.stats().cache.promotions["l3"] == 0
    engine.close()


def l3_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".val")]


def file_holding(root, key: bytes) -> str:
    """The L3 value file whose header carries ``key``."""
    for name in l3_files(root):
        with open(name, "rb") as handle:
            if key in handle.read(256):
                return name
    raise AssertionError(f"no L3 file holds {key.hex()}")


def test_corrupt_truncated_and_deleted_l3_entries_are_misses(tmp_path):
    path = build_checkpoint(tmp_path, "m", "llama")
    expected = hf_greedy(path, QUESTIONS, NEW_TOKENS)
    engine = make_engine(path, **cache_settings(tmp_path, kv_cache__l2_capacity=0))
    root = tmp_path / "l3"

    def flip(name):
        with open(name, "r+b") as handle:
            handle.seek(os.path.getsize(name) // 2)
            handle.write(b"\xff\x00\xff\x00")

    def truncate(name):
        with open(name, "r+b") as handle:
            handle.truncate(10)

    try:
        engine.generate([QUESTIONS[0]], GREEDY)
        hashes: list[bytes] = []
        extend_hashes(hashes, engine.driver.core.store.root_for(None), engine.encode_prompt(QUESTIONS[0]), 4, 12)
        for expected_corrupt, (damage, key) in enumerate(zip((flip, truncate, os.remove), hashes), start=1):
            engine.flush_cache()
            engine.clear_cache("l1")  # the lookups must read L3
            bad = file_holding(root, key)
            damage(bad)
            # the damaged block's prompt alone first, so its read is certain (in a batch, another prompt on the
            # same prefix may compute the block before the read reaches it: the prefix loads run beside the steps)
            [first] = engine.generate([QUESTIONS[0]], GREEDY)
            assert engine.stats().cache.tiers["l3"].corrupt == expected_corrupt
            results = engine.generate(QUESTIONS, GREEDY)  # the same, running engine
            assert [first.token_ids] + [r.token_ids for r in results[1:]] == expected
            assert results[0].token_ids == expected[0]
            engine.flush_cache()
            if os.path.exists(bad):  # rewritten from the recomputed block: whole again
                assert os.path.getsize(bad) > 10
            engine.check_integrity()
    finally:
        engine.close()


def test_random_workload_keeps_every_invariant(tmp_path):
    path = build_checkpoint(tmp_path, "r", "llama")
    engine = make_engine(
        path,
        **cache_settings(tmp_path, kv_cache__l1_capacity=40, kv_cache__l2_capacity=30, kv_cache__max_disk_bytes=200_000),
    )
    rng = random.Random(7)
    stems = [SYSTEM, OTHER, PROMPTS[4], PROMPTS[3]]
    for _ in range(6):
        batch = [rng.choice(stems)[: rng.randrange(20, 200)] + rng.choice(["", " ok", " why?"]) for _ in range(4)]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 6), ignore_eos=True)
        engine.generate(batch, params)
        check_clean(engine)
    stats = engine.stats().cache
    assert stats.tiers["l1"].evictions > 0 and stats.tiers["l2"].evictions > 0
    engine.flush_cache()
    engine.close()


def test_warm_then_clear_each_tier(tmp_path):
    path = build_checkpoint(tmp_path, "w", "llama")
    engine = make_engine(path, **cache_settings(tmp_path))
    cached = engine.warm([SYSTEM])
    assert cached.tokens >= len(engine.encode_prompt(SYSTEM)) - 4
    assert cached.writes == {"l3": {"written": cached.tokens // 4, "dropped": 0, "pending": 0}}
    [hit] = engine.generate([QUESTIONS[0]], GREEDY)
    assert hit.cached_tokens > 0
    removed = engine.clear_cache("l1")
    assert removed["l1"] > 0
    [from_disk] = engine.generate([QUESTIONS[0]], GREEDY)
    assert from_disk.cached_tokens > 0  # still on L3 (written through)
    engine.clear_cache("all")
    [cold] = engine.generate([QUESTIONS[0]], GREEDY)
    assert cold.cached_tokens == 0 and cold.token_ids == hit.token_ids
    with pytest.raises(ValueError, match="tier.*allowed"):
        engine.clear_cache("l4")
    check_clean(engine)
    engine.close()


def test_offload_moves_idle_l1_prefixes_to_l2_and_they_still_hit(tmp_path):
    path = build_checkpoint(tmp_path, "o", "llama")
    engine = make_engine(path, **cache_settings(tmp_path, kv_cache__persistence=False))
    try:
        [cold] = engine.generate([QUESTIONS[0]], GREEDY)
        cached_blocks = engine.stats().cache.tiers["l1"].entries
        assert cached_blocks > 0
        moved = engine.offload_cache()
        stats = engine.stats()
        assert moved == cached_blocks and stats.cache.tiers["l1"].entries == 0
        assert stats.kv_blocks_free == stats.kv_blocks_total
        assert stats.cache.tiers["l2"].entries == moved
        [again] = engine.generate([QUESTIONS[0]], GREEDY)
        assert again.token_ids == cold.token_ids and again.cached_tokens > 0
        assert engine.stats().cache.promotions["l2"] > 0
        check_clean(engine)
    finally:
        engine.close()


def test_prometheus_metrics_follow_the_store(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from tierserve.engine.metrics import EngineCollector

    path = build_checkpoint(tmp_path, "p", "llama")
    engine = make_engine(path, **cache_settings(tmp_path))
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine.stats))
    engine.generate([QUESTIONS[0], QUESTIONS[1]], GREEDY)
    engine.generate([QUESTIONS[0]], GREEDY)
    text = generate_latest(registry).decode()
    stats = engine.stats().cache
    assert f'tierserve_cache_hits_total{{tier="l1"}} {float(stats.tiers["l1"].hits)}' in text
    assert stats.tiers["l1"].hits > 0
    assert f"tierserve_cache_cached_tokens_total {float(stats.cached_tokens)}" in text
    for name in ("tierserve_cache_misses_total", "tierserve_cache_bytes", "tierserve_cache_promotions_total",
                 "tierserve_cache_dropped_writes_total", "tierserve_cache_active_prefixes", "tierserve_kv_usage"):
        assert name in text
    engine.close()
