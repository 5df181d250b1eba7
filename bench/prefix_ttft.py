"""Time to first token with a long shared prefix: cold, then served from L1, L2, L3 and Redis (after a restart).

    python -m bench.prefix_ttft [--model builtin:bench] [--prefix-len 2048] [--suffix-len 32] [--redis-url URL]

One prefix of ``prefix-len`` random token ids, each request adds a fresh
``suffix-len`` suffix and asks for one token (so the time is prefill + one
sample, i.e. TTFT). In one run, on one engine:

- cold: nothing cached;
- L1: the prefix blocks are still in the live pool;
- L2: a second long prompt has pushed the prefix out of L1 into host memory;
- L3: the engine is closed and a new one is built on the same L3 directory
  (its index rebuilt from disk), so the prefix comes from disk;
- Redis: an engine with L1 and a write-through ``redis`` tier computes the
  prefix; a new, empty engine (a replica restarted, or another one) on the
  same server is timed. ``--redis-url`` names the server; without it a
  ``redis-server`` is started on a free loopback port (``--no-redis`` skips
  the row).

Prints TTFT per tier (median of ``--repeats`` where the state allows) and the
ratio to cold, plus L3 bytes per cached token and the compression ratio.
Queued L3 writes are flushed before each timed request, so the time is the
request's own (on 2 cores a concurrent zstd writer would otherwise take one).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from tests.redis_server import RedisServer  # the tests' own helper; bench runs from a checkout
from tierserve.settings.config import load_settings
from tierserve.engine import EngineClient
from tierserve.core.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def build_engine(model: str, disk: str, prefix_len: int, suffix_len: int) -> EngineClient:
    blocks_per_prompt = -(-(prefix_len + suffix_len + 1) // 16)
    overrides = {
        ("model", "path"): model,
        ("kv_cache", "block_size"): 16,
        # room for one long prompt and a bit: a second one evicts the first to L2
        ("kv_cache", "l1_capacity"): blocks_per_prompt + blocks_per_prompt // 2,
        ("kv_cache", "l2_capacity"): 4 * blocks_per_prompt,
        ("kv_cache", "max_memory_bytes"): 4 * 1024**3,
        ("kv_cache", "disk_path"): disk,
        ("kv_cache", "persistence"): True,
        ("kv_cache", "max_disk_bytes"): 8 * 1024**3,
        ("kv_cache", "eviction_policy"): "lru",
        ("scheduler", "max_num_batched_tokens"): 4096,
        ("logging", "level"): "warning",
    }
    loaded = load_settings("development", environ={}, overrides=overrides)
    return EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)


def build_redis_engine(model: str, url: str, prefix_len: int, suffix_len: int) -> EngineClient:
    """L1 (room for two long prompts) above a write-through redis tier: nothing local survives a restart."""
    blocks_per_prompt = -(-(prefix_len + suffix_len + 1) // 16)
    tier = {"name": "redis", "plugin": "redis", "url": url, "write_through": True, "key_prefix": "bench-prefix-ttft"}
    overrides = {
        ("model", "path"): model,
        ("kv_cache", "block_size"): 16,
        ("kv_cache", "l1_capacity"): 2 * blocks_per_prompt,
        ("kv_cache", "tiers"): [tier],
        ("scheduler", "max_num_batched_tokens"): 4096,
        ("logging", "level"): "warning",
    }
    loaded = load_settings("development", environ={}, overrides=overrides)
    return EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)


def redis_rows(args: argparse.Namespace, prefix: list[int], fresh_suffix) -> list[tuple[float, int]]:
    """TTFT of the prefix on a fresh engine that finds it only in Redis, ``repeats`` times."""
    server = RedisServer(Path(tempfile.mkdtemp(prefix="tierserve-redis-"))).start() if args.redis_url is None else None
    url = server.url if server is not None else args.redis_url
    try:
        writer = build_redis_engine(args.model, url, args.prefix_len, args.suffix_len)
        writer.generate([prefix + fresh_suffix()], ONE_TOKEN)
        writer.close()  # flushes the queued writes to the server
        rows = []
        for _ in range(args.repeats):
            engine = build_redis_engine(args.model, url, args.prefix_len, args.suffix_len)
            engine.generate([[5, 6, 7, 8]], ONE_TOKEN)
            rows.append(ttft(engine, prefix + fresh_suffix()))
            engine.close()
        return rows
    finally:
        if server is not None:
            server.stop()


def ttft(engine: EngineClient, prompt: list[int]) -> tuple[float, int]:
    # Background L3 writes of earlier requests would otherwise share the CPU with this one.
    engine.flush_cache()
    start = time.perf_counter()
    [result] = engine.generate([prompt], ONE_TOKEN)
    return time.perf_counter() - start, result.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:bench")
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis-url", default=None, help="a redis server for the Redis row (default: start one)")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis row")
    args = parser.parse_args()

    rng = random.Random(0)
    disk = tempfile.mkdtemp(prefix="tierserve-l3-")
    engine = build_engine(args.model, disk, args.prefix_len, args.suffix_len)
    vocab = engine.info.vocab_size
    prefix = [rng.randrange(16, vocab) for _ in range(args.prefix_len)]
    other = [rng.randrange(16, vocab) for _ in range(args.prefix_len)]

    def fresh_suffix() -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(args.suffix_len)]

    engine.generate([[5, 6, 7, 8]], ONE_TOKEN)  # warm-up: first-call overheads out of the way
    rows: dict[str, tuple[float, int]] = {}
    rows["cold"] = ttft(engine, prefix + fresh_suffix())
    l1 = [ttft(engine, prefix + fresh_suffix()) for _ in range(args.repeats)]
    rows["L1 hit"] = (statistics.median(t for t, _ in l1), l1[0][1])
    l2 = []
    for _ in range(args.repeats):
        ttft(engine, other + fresh_suffix())  # evicts the prefix from L1 into L2
        l2.append(ttft(engine, prefix + fresh_suffix()))
    rows["L2 hit"] = (statistics.median(t for t, _ in l2), l2[0][1])
    promotions = engine.stats().cache.promotions
    engine.close()

    l3 = []
    for _ in range(args.repeats):
        engine = build_engine(args.model, disk, args.prefix_len, args.suffix_len)
        engine.generate([[5, 6, 7, 8]], ONE_TOKEN)
        l3.append(ttft(engine, prefix + fresh_suffix()))
        stats = engine.stats().cache
        engine.close()
    rows["L3 hit after restart"] = (statistics.median(t for t, _ in l3), l3[0][1])
    l3_tier = stats.tiers["l3"]
    if not args.no_redis:
        remote = redis_rows(args, prefix, fresh_suffix)
        rows["Redis hit on a new engine"] = (statistics.median(t for t, _ in remote), remote[0][1])

    cold = rows["cold"][0]
    print(f"model {args.model}, prefix {args.prefix_len} + suffix {args.suffix_len} tokens, 1 output token")
    print(f"promotions in the first engine: {promotions}; L3 promotions after restart: {stats.promotions['l3']}\n")
    print("| prefix served from | TTFT (ms) | cached tokens | TTFT / cold |")
    print("|---|---:|---:|---:|")
    for name, (seconds, cached) in rows.items():
        print(f"| {name} | {seconds * 1000:.1f} | {cached} | {seconds / cold:.3f} |")
    tokens_on_disk = l3_tier.entries * 16
    print(
        f"\nL3: {l3_tier.entries} blocks, {l3_tier.bytes / max(tokens_on_disk, 1):.0f} bytes per token on disk, "
        f"compression ratio {l3_tier.compression_ratio:.2f} (raw / stored)"
    )


if __name__ == "__main__":
    main()
