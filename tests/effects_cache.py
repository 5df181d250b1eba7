"""Probes of ``[kv_cache]``: the L1 pool, prefix caching, warming, and the tiers below L1, whether
``[[kv_cache.tiers]]`` entries describe them or the ``[kv_cache]`` shorthands do.

Tier keys are probed on the tier their settings build (the tier plugin's own
object, built as the engine builds it), with blocks put and read directly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.effects_lab import FINGERPRINT, Lab, entry, greedy, new_threads, run, run_keyed
from tests.waiting import wait_until
from tierserve.cache.codec import KVCodec
from tierserve.cache.tier import CacheTier
from tierserve.core.errors import ConfigError, RequestError

LONG = "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read books."
ENTRY_BYTES = entry(0).nbytes
LEGACY_DISK = {  # a disk tier's own keys -> the [kv_cache] shorthands that set them on the disk tier
    "max_bytes": "kv_cache.max_disk_bytes",
    "persistent": "kv_cache.persistence",
}


def memory(**own) -> dict:
    return {"kv_cache.tiers": [{"name": "l2", "plugin": "memory", **own}]}


def disk(path: Path, legacy: bool = False, **own) -> dict:
    """Settings of one disk tier: a ``[[kv_cache.tiers]]`` entry, or the shorthands (``l3``, below L2)."""
    if legacy:
        return {"kv_cache.disk_path": str(path), **{LEGACY_DISK[key]: value for key, value in own.items()}}
    return {"kv_cache.tiers": [{"name": "l3", "plugin": "disk", "path": str(path), **own}]}


def stored_size(level: int = 3) -> int:
    return len(KVCodec(FINGERPRINT, level).encode(entry(0)))


def put_all(tier: CacheTier, count: int) -> None:
    for index in range(count):
        tier.put(entry(index))
        tier.flush()


def keeps_the_reused_entry(tier: CacheTier) -> bool:
    """Room for two: put a, read a, put b, put c. lru evicts a (read earliest); the default, adaptive, keeps it."""
    put_all(tier, 1)
    assert tier.get(entry(0).key) is not None
    tier.put(entry(1))
    tier.flush()
    tier.put(entry(2))
    tier.flush()
    return tier.contains(entry(0).key)


def files_in(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


# ---- [kv_cache]: L1, prefix caching, warming ------------------------------------------------------


def kv_cache_block_size(lab: Lab) -> None:
    prompt_tokens = len(lab.shared.encode_prompt(LONG))
    for block_size in (4, 16):  # whole blocks only: a prompt's cached part is a multiple of the block size
        with lab.engine({"kv_cache.block_size": block_size, "kv_cache.reuse_partial_blocks": False}) as engine:
            assert engine.info.block_size == block_size
            run(engine, LONG)
            assert run(engine, LONG).cached_tokens == (prompt_tokens - 1) // block_size * block_size


def kv_cache_dtype(lab: Lab) -> None:
    prompt_tokens = len(lab.shared.encode_prompt(LONG))
    with lab.engine({"kv_cache.dtype": "bfloat16"}) as engine:
        assert (engine.info.dtype, engine.info.kv_dtype) == ("float32", "bfloat16")
        assert engine.info.kv_block_bytes * 2 == lab.shared.info.kv_block_bytes
        assert engine.info.fingerprint != lab.shared.info.fingerprint
        first = run(engine, LONG, greedy(8))
        again = run(engine, LONG, greedy(8))
        assert again.cached_tokens == (prompt_tokens - 1) // 16 * 16 and again.token_ids == first.token_ids


def kv_cache_l1_capacity(lab: Lab) -> None:
    with lab.engine({"kv_cache.l1_capacity": 32}) as engine:
        assert engine.info.kv_blocks == 32 and engine.stats().kv_blocks_total == 32


def kv_cache_l1_max_bytes(lab: Lab) -> None:
    with lab.engine({"kv_cache.l1_max_bytes": 10 * lab.shared.info.kv_block_bytes}) as engine:
        assert engine.info.kv_blocks == 10


def kv_cache_l1_memory_fraction(lab: Lab) -> None:
    from tierserve.engine.memory_budget import host_available_bytes

    available = host_available_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo: the pool is never sized down here")
    block = lab.shared.info.kv_block_bytes
    wanted = 2 * available // block  # twice the free memory: only the fraction of it is taken
    with lab.engine({"kv_cache.l1_capacity": wanted, "kv_cache.l1_memory_fraction": 0.0005}) as engine:
        assert engine.info.kv_blocks <= 0.0006 * available / block


def reused_prefix_survives(lab: Lab, policy: str) -> int:
    """Four L1 blocks, no tier below: one prompt used three times, then three others; tokens it finds cached."""
    values = {"kv_cache.eviction_policy": policy, "kv_cache.block_size": 4, "kv_cache.l1_capacity": 4,
              "kv_cache.l2_capacity": 0}  # fmt: skip
    with lab.engine(values) as engine:
        for _ in range(3):
            run(engine, "alpha beta gamma delta", greedy(1))
        for prompt in ("one two three four", "five six seven eight", "nine ten eleven twelve"):
            run(engine, prompt, greedy(1))
        return run(engine, "alpha beta gamma delta", greedy(1)).cached_tokens


def kv_cache_eviction_policy(lab: Lab) -> None:
    assert reused_prefix_survives(lab, "lru") == 0  # least recently used: it goes
    assert reused_prefix_survives(lab, "lfu") > 0  # most frequently used: it stays
    with lab.tier({"kv_cache.eviction_policy": "lru", "kv_cache.l2_capacity": 2}) as tier:
        assert not keeps_the_reused_entry(tier)  # and the tiers below take it unless they set their own


def kv_cache_ttl_seconds(lab: Lab) -> None:
    with lab.tier({"kv_cache.ttl_seconds": 0.05}) as tier:  # the legacy L2 inherits it
        put_all(tier, 1)
        wait_until(lambda: tier.get(entry(0).key) is None, what="the entry to expire")
        assert tier.stats.expirations == 1


def kv_cache_tiers(lab: Lab) -> None:
    assert lab.shared.info.tier_names == ("l1", "l2")
    with lab.engine({"kv_cache.tiers": []}) as engine:
        assert engine.info.tier_names == ("l1",)


def kv_cache_enable_prefix_caching(lab: Lab) -> None:
    with lab.engine({"kv_cache.enable_prefix_caching": False}) as engine:
        assert engine.info.tier_names == ()
        run(engine, LONG)
        assert run(engine, LONG).cached_tokens == 0


def kv_cache_reuse_partial_blocks(lab: Lab) -> None:
    # the same prompt again: with the setting its tail is copied from the block the first run completed
    ids = [5 + i % 100 for i in range(16 + 9)]
    params = greedy(12)
    for reuse, cached in ((True, 24), (False, 16)):
        with lab.engine({"kv_cache.reuse_partial_blocks": reuse}) as engine:
            [first] = engine.generate([ids], params)
            [again] = engine.generate([ids], params)
            assert again.cached_tokens == cached and again.token_ids == first.token_ids


def kv_cache_warm_prompts(lab: Lab) -> None:
    with lab.engine({"kv_cache.warm_prompts": [LONG]}) as engine:
        assert run(engine, LONG).cached_tokens > 0  # its first request


def kv_cache_warm_prompts_file(lab: Lab) -> None:
    path = lab.tmp / "warm.txt"
    path.write_text(LONG + "\n")
    with lab.engine({"kv_cache.warm_prompts_file": str(path)}) as engine:
        assert run(engine, LONG).cached_tokens > 0


def kv_cache_warm_frequent_blocks(lab: Lab) -> None:
    with lab.engine({"kv_cache.warm_frequent_blocks": 1, "kv_cache.block_size": 4}) as engine:
        run(engine, LONG)
        run(engine, LONG)  # used twice: its blocks have access counts
        assert engine.offload_cache() > 1  # now only in L2
        assert engine.warm_frequent().blocks["l1"] == 1  # the setting's bound
        assert engine.warm_frequent(100).blocks["l1"] > 1  # the rest was left below


def kv_cache_warm_write_timeout_seconds(lab: Lab) -> None:
    tier = {"name": "l3", "plugin": "disk", "path": str(lab.tmp), "write_through": True}
    values = {"kv_cache.block_size": 4, "kv_cache.tiers": [tier | {"write_queue": 1, "compression_level": 22}]}
    with lab.engine(values | {"kv_cache.warm_write_timeout_seconds": 1e-6}) as engine:
        assert engine.warm([LONG]).writes["l3"]["dropped"] > 0  # no time to wait: blocks faster than the writer
    with lab.engine(values) as engine:  # 60 s: each write waits for room
        writes = engine.warm([LONG]).writes["l3"]
        assert writes == {"written": engine.stats().cache.write_through, "dropped": 0, "pending": 0}


def names(engine) -> list[str]:
    return [entry.name for entry in engine.list_cache_keys()]


def kv_cache_cache_keys_max(lab: Lab) -> None:
    with lab.engine({"kv_cache.cache_keys_max": 1}) as engine:
        run_keyed(engine, LONG, "first")
        run_keyed(engine, LONG + " Again.", "second")
        assert names(engine) == ["second"]  # the oldest went


def kv_cache_cache_key_ttl_seconds(lab: Lab) -> None:
    with lab.engine({"kv_cache.cache_key_ttl_seconds": 0.2}) as engine:
        run_keyed(engine, LONG, "brief")
        assert names(engine) == ["brief"]
        wait_until(lambda: names(engine) == [], what="the cache key to expire")


def kv_cache_cache_keys_max_pinned_bytes(lab: Lab) -> None:
    block = lab.shared.info.kv_block_bytes
    with lab.engine({"kv_cache.cache_keys_max_pinned_bytes": block}) as engine:
        with pytest.raises(RequestError, match="cache_keys_max_pinned_bytes") as refused:
            run_keyed(engine, LONG * 3, "long")  # several blocks
        assert refused.value.param == "cache_key" and names(engine) == []
        run_keyed(engine, LONG[:60], "short")  # one block
        assert names(engine) == ["short"]


# ---- [kv_cache] shorthands of the memory tier, and refused flat keys -----------------------------


def kv_cache_l2_capacity(lab: Lab) -> None:
    with lab.tier({"kv_cache.l2_capacity": 2}) as tier:
        put_all(tier, 4)
        assert len(tier) == 2 and tier.stats.evictions == 2
    with lab.engine({"kv_cache.l2_capacity": 0}) as engine:
        assert engine.info.tier_names == ("l1",)  # 0 switches L2 off


def kv_cache_max_memory_bytes(lab: Lab) -> None:
    with lab.tier({"kv_cache.max_memory_bytes": 2 * ENTRY_BYTES}) as tier:
        put_all(tier, 4)
        assert len(tier) == 2 and tier.bytes_used == 2 * ENTRY_BYTES


def refused(key: str, tier: str, entry_key: str, value: object):
    """A flat key that picked one tier's plugin, policy or tuning: refused, with the entry to write
    (the entry key's own probe, ``kv_cache.tiers[...]``, shows its effect)."""

    def probe(lab: Lab) -> None:
        with pytest.raises(ConfigError) as refusal:
            lab.settings({"kv_cache.disk_path": str(lab.tmp), f"kv_cache.{key}": value})
        message = str(refusal.value)
        assert f"kv_cache.{key} = {value!r} (from command line) is no longer a [kv_cache] key" in message
        assert f"{entry_key} is a key of the {tier} tier's [[kv_cache.tiers]] entry" in message
        assert f'    name = "{tier}"' in message and f"    {entry_key} = {json.dumps(value)}" in message

    return probe


def kv_cache_disk_path(lab: Lab) -> None:
    assert lab.shared.info.tier_names == ("l1", "l2")
    with lab.engine({"kv_cache.disk_path": str(lab.tmp / "l3")}) as engine:
        assert engine.info.tier_names == ("l1", "l2", "l3")
        assert engine.stats().cache.tiers["l3"].medium == "disk"
    disk_tier_path(lab, legacy=True)


# ---- a disk tier's keys, as [[kv_cache.tiers]] keys or [kv_cache] shorthands ---------------------


def disk_tier_path(lab: Lab, legacy: bool = False) -> None:
    with lab.tier(disk(lab.tmp / "blocks", legacy)) as tier:
        put_all(tier, 2)
        assert len(files_in(lab.tmp / "blocks")) >= 2


def disk_tier_max_bytes(lab: Lab, legacy: bool = False) -> None:
    bound = 2 * stored_size() + stored_size() // 2
    with lab.tier(disk(lab.tmp, legacy, max_bytes=bound)) as tier:
        put_all(tier, 4)
        assert len(tier) == 2 and tier.bytes_used <= bound and tier.stats.evictions == 2


def disk_tier_persistent(lab: Lab, legacy: bool = False) -> None:
    for persistent in (True, False):
        with lab.tier(disk(lab.tmp / str(persistent), legacy, persistent=persistent)) as tier:
            put_all(tier, 1)
        with lab.tier(disk(lab.tmp / str(persistent), legacy, persistent=persistent)) as tier:  # a restart
            assert tier.contains(entry(0).key) is persistent


def disk_tier_compression_level(lab: Lab) -> None:
    with lab.tier(disk(lab.tmp / "19", compression_level=19)) as tier:
        put_all(tier, 1)
        assert tier.bytes_used == stored_size(19) < stored_size(3)


def disk_tier_write_queue(lab: Lab) -> None:
    with lab.tier(disk(lab.tmp, write_queue=1, compression_level=22)) as tier:
        for index in range(20):  # faster than the writer compresses
            tier.put(entry(index))
        assert tier.stats.dropped_writes > 0


def disk_tier_writer_nice(lab: Lab) -> None:
    if not hasattr(os, "getpriority"):
        pytest.skip("thread priorities are a Linux feature")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = {t.ident for t in new_threads(set(), "tierserve-l3-writer")}
    with lab.tier(disk(lab.tmp, writer_nice=15)) as tier:
        [writer] = new_threads(before, "tierserve-l3-writer")
        put_all(tier, 1)  # the writer has lowered its priority by the time it wrote
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == min(19, base + 15)


def disk_tier_eviction_policy(lab: Lab) -> None:
    bound = 2 * stored_size() + stored_size() // 2
    with lab.tier(disk(lab.tmp / "adaptive", max_bytes=bound)) as tier:
        assert keeps_the_reused_entry(tier)
    with lab.tier(disk(lab.tmp / "lru", max_bytes=bound, eviction_policy="lru")) as tier:
        assert not keeps_the_reused_entry(tier)


def legacy(probe):
    return lambda lab: probe(lab, legacy=True)


# ---- the keys of every [[kv_cache.tiers]] entry, and the memory tier's own ------------------------


def tiers_name(lab: Lab) -> None:
    with lab.engine({"kv_cache.tiers": [{"name": "warm", "plugin": "memory"}]}) as engine:
        assert engine.info.tier_names == ("l1", "warm")
        run(engine, LONG)
        assert engine.offload_cache() > 0 and engine.stats().cache.tiers["warm"].entries > 0


def tiers_plugin(lab: Lab) -> None:
    values = {"kv_cache.tiers": [{"name": "l2", "plugin": "disk", "path": str(lab.tmp)}]}
    with lab.engine(values) as engine:
        assert engine.stats().cache.tiers["l2"].medium == "disk"
        run(engine, LONG)
        engine.offload_cache()
        engine.flush_cache()
        assert files_in(lab.tmp)


def tiers_eviction_policy(lab: Lab) -> None:
    with lab.tier(memory(capacity=2)) as tier:
        assert keeps_the_reused_entry(tier)
    with lab.tier(memory(capacity=2, eviction_policy="lru")) as tier:
        assert not keeps_the_reused_entry(tier)


def tiers_ttl_seconds(lab: Lab) -> None:
    with lab.tier(memory(ttl_seconds=0.05)) as tier:
        put_all(tier, 1)
        wait_until(lambda: tier.get(entry(0).key) is None, what="the entry to expire")
        assert tier.stats.expirations == 1


def tiers_write_through(lab: Lab) -> None:
    for write_through in (False, True):
        tier = {"name": "l2", "plugin": "disk", "path": str(lab.tmp / str(write_through)), "write_through": write_through}
        with lab.engine({"kv_cache.tiers": [tier]}) as engine:
            run(engine, LONG)
            engine.flush_cache()
            stats = engine.stats().cache
            assert (stats.write_through > 0) is write_through
            assert (stats.tiers["l2"].entries > 0) is write_through  # computed blocks went down without an eviction


def memory_capacity(lab: Lab) -> None:
    with lab.tier(memory(capacity=2)) as tier:
        put_all(tier, 4)
        assert len(tier) == 2 and tier.stats.evictions == 2


def memory_max_bytes(lab: Lab) -> None:
    with lab.tier(memory(max_bytes=2 * ENTRY_BYTES)) as tier:
        put_all(tier, 4)
        assert len(tier) == 2 and tier.bytes_used == 2 * ENTRY_BYTES


PROBES = {
    "kv_cache.block_size": kv_cache_block_size,
    "kv_cache.dtype": kv_cache_dtype,
    "kv_cache.l1_capacity": kv_cache_l1_capacity,
    "kv_cache.l1_max_bytes": kv_cache_l1_max_bytes,
    "kv_cache.l1_memory_fraction": kv_cache_l1_memory_fraction,
    "kv_cache.eviction_policy": kv_cache_eviction_policy,
    "kv_cache.ttl_seconds": kv_cache_ttl_seconds,
    "kv_cache.tiers": kv_cache_tiers,
    "kv_cache.enable_prefix_caching": kv_cache_enable_prefix_caching,
    "kv_cache.reuse_partial_blocks": kv_cache_reuse_partial_blocks,
    "kv_cache.warm_prompts": kv_cache_warm_prompts,
    "kv_cache.warm_prompts_file": kv_cache_warm_prompts_file,
    "kv_cache.warm_frequent_blocks": kv_cache_warm_frequent_blocks,
    "kv_cache.warm_write_timeout_seconds": kv_cache_warm_write_timeout_seconds,
    "kv_cache.cache_keys_max": kv_cache_cache_keys_max,
    "kv_cache.cache_key_ttl_seconds": kv_cache_cache_key_ttl_seconds,
    "kv_cache.cache_keys_max_pinned_bytes": kv_cache_cache_keys_max_pinned_bytes,
    "kv_cache.l2_capacity": kv_cache_l2_capacity,
    "kv_cache.max_memory_bytes": kv_cache_max_memory_bytes,
    "kv_cache.l2_tier": refused("l2_tier", "l2", "plugin", "disk"),
    "kv_cache.l3_tier": refused("l3_tier", "l3", "plugin", "memory"),
    "kv_cache.l2_eviction_policy": refused("l2_eviction_policy", "l2", "eviction_policy", "lru"),
    "kv_cache.l3_eviction_policy": refused("l3_eviction_policy", "l3", "eviction_policy", "lru"),
    "kv_cache.disk_path": kv_cache_disk_path,
    "kv_cache.max_disk_bytes": legacy(disk_tier_max_bytes),
    "kv_cache.persistence": legacy(disk_tier_persistent),
    "kv_cache.compression_level": refused("compression_level", "l3", "compression_level", 19),
    "kv_cache.l3_write_queue": refused("l3_write_queue", "l3", "write_queue", 1),
    "kv_cache.l3_writer_nice": refused("l3_writer_nice", "l3", "writer_nice", 15),
    "kv_cache.tiers[].name": tiers_name,
    "kv_cache.tiers[].plugin": tiers_plugin,
    "kv_cache.tiers[].eviction_policy": tiers_eviction_policy,
    "kv_cache.tiers[].ttl_seconds": tiers_ttl_seconds,
    "kv_cache.tiers[].write_through": tiers_write_through,
    "kv_cache.tiers[memory].capacity": memory_capacity,
    "kv_cache.tiers[memory].max_bytes": memory_max_bytes,
    "kv_cache.tiers[disk].path": disk_tier_path,
    "kv_cache.tiers[disk].max_bytes": disk_tier_max_bytes,
    "kv_cache.tiers[disk].persistent": disk_tier_persistent,
    "kv_cache.tiers[disk].compression_level": disk_tier_compression_level,
    "kv_cache.tiers[disk].write_queue": disk_tier_write_queue,
    "kv_cache.tiers[disk].writer_nice": disk_tier_writer_nice,
}
