"""Scenario ``cache-store``: the L2 (memory) and L3 (disk) tiers on their own, with real KV blocks.

The entries are KV blocks the tierserve engine computed for a real prompt on
the checkpoint (one entry = one block of ``block_size`` tokens, as the store
keeps them), for each block size asked for. Per tier and block size:

- put: the demotion path, the block copied off the live pool (``read_blocks``)
  and stored; for disk, the puts of all entries plus ``flush`` (encode,
  compress, write) over the count, i.e. the time until an entry is on disk;
- get: the promotion path, a hit fetched (disk: read, checksum, decompress,
  decode, with the file in the OS page cache as a recently written one would
  be) and copied back into the pool (``write_blocks``);
- throughput in MB/s of raw KV for both.

Per zstd level: compression ratio, stored bytes per token, and encode and
decode speed of the codec alone.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from bench.harness import BenchContext
from bench.stats import percentile


@contextmanager
def live_blocks(ctx: BenchContext, block_size: int, tokens: int) -> Iterator[tuple]:
    """An engine holding the KV it computed for ``tokens`` prompt tokens: (engine, entries, block ids, bytes/token)."""
    from tierserve.cache.hashing import extend_hashes
    from tierserve.cache.tier import CacheEntry
    from tierserve.settings.config import load_settings
    from tierserve.engine import EngineClient
    from tierserve.core.sampling_params import SamplingParams

    loaded = load_settings(
        "development",
        environ={},
        overrides={
            ("model", "path"): str(ctx.checkpoint),
            ("kv_cache", "block_size"): block_size,
            ("kv_cache", "l1_capacity"): 2 * tokens // block_size + 8,
            ("kv_cache", "l2_capacity"): 0,
            ("scheduler", "max_num_batched_tokens"): 4096,
            ("logging", "level"): "warning",
        },
    )
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
    core = engine.driver.core  # the bench times the store's own paths on real arena blocks
    try:
        text = "the garden by the river in the morning " * (tokens // 4)
        ids = list(ctx.tokenizer(text)["input_ids"])[:tokens]
        engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        hashes: list[bytes] = []
        extend_hashes(hashes, core.store.root_for(None), ids, block_size, len(ids))
        hashes = [h for h in hashes if h in core.kv.pool.cached]
        block_ids = [core.kv.pool.cached[h] for h in hashes]
        entries = []
        parent = None
        for index, (key, data) in enumerate(zip(hashes, core.backend.read_blocks(block_ids))):
            chunk = tuple(ids[index * block_size : (index + 1) * block_size])
            entries.append(CacheEntry(key, parent, chunk, data.clone()))
            parent = key
        yield engine, entries, block_ids, entries[0].nbytes // block_size
    finally:
        engine.close()


def _tier(plugin: str, options):
    from tierserve.core.tier_settings import TierSettings

    return TierSettings(name=plugin, plugin=plugin, eviction_policy="lru", ttl_seconds=None, options=options)


def _policy(capacity):
    from tierserve.plugins.eviction.lru import LRUPolicy

    return LRUPolicy(capacity)


def _latencies(fn, items) -> list[float]:
    out = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - start)
    return out


def _row(tier: str, block_size: int, entries, put_s: list[float] | float, get_s: list[float]) -> dict:
    raw = sum(e.nbytes for e in entries)
    put_total = put_s if isinstance(put_s, float) else sum(put_s)
    put_each = [put_total / len(entries)] if isinstance(put_s, float) else put_s
    return {
        "tier": tier,
        "block_size": block_size,
        "entries": len(entries),
        "entry_bytes": entries[0].nbytes,
        "put_mb_s": raw / put_total / 1e6,
        "put_p50_ms": percentile(put_each, 50) * 1000,
        "put_p99_ms": percentile(put_each, 99) * 1000,
        "get_mb_s": raw / sum(get_s) / 1e6,
        "get_p50_ms": percentile(get_s, 50) * 1000,
        "get_p99_ms": percentile(get_s, 99) * 1000,
    }


def run(ctx: BenchContext, block_sizes: list[int], tokens: int, levels: list[int]) -> dict:
    from tierserve.cache.codec import KVCodec
    from tierserve.cache.tier import CacheEntry
    from tierserve.plugins.tiers.disk import DiskTier, DiskTierSettings
    from tierserve.plugins.tiers.memory import MemoryTier, MemoryTierSettings

    tiers: list[dict] = []
    codec_rows: list[dict] = []
    with ctx.progress(len(block_sizes) * (2 + len(levels)), "cache-store") as bar:
        for block_size in block_sizes:
            with live_blocks(ctx, block_size, tokens) as (engine, entries, block_ids, per_token):
                backend = engine.driver.core.backend
                raw = sum(e.nbytes for e in entries)
                fingerprint = "bench"
                pairs = list(zip(entries, block_ids))

                def demote(tier, pair) -> None:
                    entry, block_id = pair
                    kv = backend.read_blocks([block_id])[0]
                    tier.put(CacheEntry(entry.key, entry.parent, entry.token_ids, kv))

                def promote(tier, pair) -> None:
                    entry, block_id = pair
                    found = tier.get(entry.key)
                    assert found is not None, "the tier lost an entry"
                    backend.write_blocks([block_id], found.kv[None])

                options = MemoryTierSettings(capacity=len(entries) * 2, max_bytes=raw * 2)
                memory = MemoryTier(_tier("memory", options), _policy, fingerprint)
                put = _latencies(lambda pair: demote(memory, pair), pairs)
                get = _latencies(lambda pair: promote(memory, pair), pairs)
                tiers.append(_row("memory (L2)", block_size, entries, put, get))
                bar.update(1)

                with tempfile.TemporaryDirectory(prefix="tierserve-bench-l3-") as folder:
                    options = DiskTierSettings(
                        path=folder, persistent=True, max_bytes=0, compression_level=3, write_queue=len(entries) + 1
                    )
                    disk = DiskTier(_tier("disk", options), _policy, fingerprint)
                    start = time.perf_counter()
                    for pair in pairs:
                        demote(disk, pair)
                    disk.flush()
                    put_total = time.perf_counter() - start
                    get = _latencies(lambda pair: promote(disk, pair), pairs)
                    disk.close()
                tiers.append(_row("disk (L3, zstd 3)", block_size, entries, put_total, get))
                bar.update(1)

            for level in levels:
                codec = KVCodec(fingerprint, level)
                start = time.perf_counter()
                encoded = [codec.encode(e) for e in entries]
                encode_s = time.perf_counter() - start
                start = time.perf_counter()
                for data, entry in zip(encoded, entries):
                    decoded = codec.decode(data, entry.key)
                encode_check = torch.equal(decoded.kv, entries[-1].kv)
                decode_s = time.perf_counter() - start
                stored = sum(len(d) for d in encoded)
                codec_rows.append({
                    "level": level,
                    "block_size": block_size,
                    "ratio": raw / stored,
                    "stored_bytes_per_token": stored / (len(entries) * block_size),
                    "raw_bytes_per_token": per_token,
                    "encode_mb_s": raw / encode_s / 1e6,
                    "decode_mb_s": raw / decode_s / 1e6,
                    "round_trip_exact": encode_check,
                })  # fmt: skip
                bar.update(1)
    return {
        "config": {"model": ctx.model, "block_sizes": block_sizes, "tokens": tokens, "levels": levels},
        "tiers": tiers,
        "codec": codec_rows,
    }
