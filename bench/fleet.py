"""Scenario ``fleet``: tierserve fleet on a local Ray cluster (``pip install 'tierserve[fleet]'``).

Two measurements, each as alternating repeats of the two configurations
(every run gets fresh prompts, so no run's cache serves another's):

- ``routing``: 2 engine replicas, C conversations of T turns on S system
  prompts (C/S conversations per prompt), all conversations at once, each
  turn sent when the previous one finished. Cache-aware routing against
  Ray Serve's default router (power of two choices, which spreads requests
  without looking at their prompts). Reported: the prompt-token hit rate
  (cached / prompt tokens) and TTFT p50/p99.
- ``disaggregation``: D streams decoding O tokens each while L long prompts
  (``--long-len`` tokens, one output token) arrive one after another; TPOT
  p50/p99 of the decoding streams, with 2 replicas that prefill and decode,
  against 1 prefill replica + 1 decode replica handing prompts over through
  a redis tier (a ``redis-server`` is started on a free loopback port).

On one 2-core machine both replicas share the same two cores (Ray gives each
one CPU), so this shows what routing changes (hits, and the prefill work they
save), not what more machines add.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.client import RunResult, run_clients, stream_completion
from bench.harness import BenchContext
from bench.stats import median, percentile
from bench.workloads import Conversation, text_with_tokens
from tests.redis_server import RedisServer  # the tests' own helpers; bench runs from a checkout
from tests.server_helpers import free_port

ROUTINGS = ("cache_aware", "power_of_two")
SPLITS = ("together", "disaggregated")


@dataclass
class FleetServer:
    """What ``bench.client`` needs of a server: its URL, name and request bodies."""

    base_url: str
    model: str
    name: str = "tierserve-fleet"

    def completion_body(self, prompt: str, max_tokens: int, **extra: Any) -> dict:
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
        }  # fmt: skip
        return {**body, **extra}


def deploy(ctx: BenchContext, port: int, fleet: dict[str, Any], tiers: list[dict] | None = None) -> FleetServer:
    """(Re)deploy the fleet with these ``[fleet]`` keys; returns once every replica is ready."""
    from ray import serve

    from tierserve.fleet.app import APP_NAME, build_fleet
    from tierserve.fleet.settings_sources import SettingsSources

    overrides: dict[tuple[str, str], Any] = {
        ("model", "path"): str(ctx.checkpoint),
        ("logging", "level"): "warning",
        ("fleet", "num_cpus"): 1.0,
        **{("fleet", key): value for key, value in fleet.items()},
    }
    if tiers is not None:
        overrides[("kv_cache", "tiers")] = tiers
    serve.run(build_fleet(SettingsSources.of("development", None, overrides)), name=APP_NAME, route_prefix="/")
    return FleetServer(f"http://127.0.0.1:{port}", str(ctx.checkpoint))  # the name the replicas serve


def conversations(tokenizer, systems: int, per_system: int, turns: int, prefix_len: int, turn_len: int, seed: int):
    rng = random.Random(seed)
    chats = []
    for _ in range(systems):
        system = text_with_tokens(tokenizer, prefix_len, rng)
        for _ in range(per_system):
            users = tuple(text_with_tokens(tokenizer, turn_len, rng) for _ in range(turns))
            assistants = tuple(text_with_tokens(tokenizer, turn_len, rng) for _ in range(turns))
            chats.append(Conversation(system, users, assistants))
    return chats


def routing_run(ctx: BenchContext, server: FleetServer, args: Any, seed: int) -> dict:
    chats = conversations(ctx.tokenizer, args.systems_prompts, args.conversations // args.systems_prompts, args.turns,
                          args.prefix_len, args.turn_len, seed)  # fmt: skip
    sessions = [[server.completion_body(chat.prompt(t), args.output_len) for t in range(args.turns)] for chat in chats]
    result: RunResult = asyncio.run(run_clients(server, sessions))
    summary = result.summary()
    summary["hit_rate"] = summary["cached_tokens"] / summary["prompt_tokens"] if summary["prompt_tokens"] else 0.0
    return summary


async def mixed_load(server: FleetServer, ctx: BenchContext, args: Any, seed: int) -> dict:
    """D decoding streams; long prompts arrive one after another while they run."""
    rng = random.Random(seed)
    decodes = [server.completion_body(text_with_tokens(ctx.tokenizer, 32, rng), args.decode_len) for _ in range(args.decoders)]
    longs = [server.completion_body(text_with_tokens(ctx.tokenizer, args.long_len, rng), 1) for _ in range(args.long_prompts)]
    async with httpx.AsyncClient(timeout=3600) as client:
        decoding = [asyncio.create_task(stream_completion(client, server, body)) for body in decodes]
        await asyncio.sleep(1.0)  # the streams are decoding
        long_ttfts = []
        for body in longs:
            if all(task.done() for task in decoding):
                break
            done = await stream_completion(client, server, body)
            long_ttfts.append(done.ttft)
        finished = await asyncio.gather(*decoding)
    gaps = [later - earlier for r in finished for earlier, later in zip(r.chunk_times, r.chunk_times[1:])]
    return {
        "decode_streams": len(finished),
        "errors": sum(1 for r in finished if r.error),
        "long_prompts_sent": len(long_ttfts),
        "long_ttft_p50_s": median([t for t in long_ttfts if t is not None]),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "tpot_p50_s": percentile([r.tpot for r in finished if r.tpot], 50),
        "tpot_p99_s": percentile([r.tpot for r in finished if r.tpot], 99),
    }


def run(ctx: BenchContext, args: Any) -> dict:
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    runs: list[dict] = []
    redis_server = None
    try:
        if "routing" in args.parts:
            for repeat in range(args.repeats):
                for routing in ROUTINGS if repeat % 2 == 0 else ROUTINGS[::-1]:
                    server = deploy(ctx, port, {"replicas": 2, "routing": routing})
                    summary = routing_run(ctx, server, args, seed=1000 + len(runs))
                    runs.append({"part": "routing", "routing": routing, "repeat": repeat, **summary})
                    print(f"routing {routing}: hit rate {summary['hit_rate']:.3f}, TTFT p50 {summary['ttft_p50_s']}s, "
                          f"errors {summary['errors']} ({summary['first_error']})")
        if "disaggregation" in args.parts:
            redis_server = RedisServer(Path(tempfile.mkdtemp(prefix="tierserve-redis-"))).start()
            tier = {"name": "shared", "plugin": "redis", "url": redis_server.url, "write_through": True}
            for repeat in range(args.repeats):
                for split in SPLITS if repeat % 2 == 0 else SPLITS[::-1]:
                    fleet = {"replicas": 2} if split == "together" else {"replicas": 1, "prefill_replicas": 1}
                    server = deploy(ctx, port, fleet, [tier])
                    summary = asyncio.run(mixed_load(server, ctx, args, seed=2000 + len(runs)))
                    runs.append({"part": "disaggregation", "split": split, "repeat": repeat, **summary})
                    print(f"{split}: TPOT p99 {summary['tpot_p99_s']}s, ITL p99 {summary['itl_p99_s']}s, errors {summary['errors']}")
    finally:
        serve.shutdown()
        ray.shutdown()
        if redis_server is not None:
            redis_server.stop()
    config = {key: getattr(args, key) for key in (
        "parts", "conversations", "systems_prompts", "turns", "prefix_len", "turn_len", "output_len", "repeats",
        "decoders", "decode_len", "long_prompts", "long_len",
    )}  # fmt: skip
    return {"config": {"model": ctx.model, **config}, "runs": runs, "summary": summarise(runs)}


def summarise(runs: list[dict]) -> dict:
    """Medians over repeats per configuration, and the ratios the issue's targets name."""
    out: dict[str, Any] = {}
    for routing in ROUTINGS:
        mine = [r for r in runs if r.get("routing") == routing]
        if mine:
            out[routing] = {key: median([r[key] for r in mine]) for key in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "output_tok_s")}
    if all(routing in out for routing in ROUTINGS):
        aware, default = out["cache_aware"], out["power_of_two"]
        out["hit_rate_ratio"] = aware["hit_rate"] / default["hit_rate"] if default["hit_rate"] else None
        out["ttft_p50_ratio"] = default["ttft_p50_s"] / aware["ttft_p50_s"] if aware["ttft_p50_s"] else None
    for split in SPLITS:
        mine = [r for r in runs if r.get("split") == split]
        if mine:
            out[split] = {key: median([r[key] for r in mine]) for key in ("tpot_p50_s", "tpot_p99_s", "itl_p99_s", "long_ttft_p50_s")}
    return out
