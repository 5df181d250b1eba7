"""Scenario ``fleet``: tierserve fleet on a local Ray cluster (``pip install 'tierserve[fleet]'``).

Two measurements, each as alternating repeats of the two configurations
(every run gets fresh prompts, so no run's cache serves another's):

- ``routing``: a workload where placement decides. R engine replicas (4), S
  tenants (32) each with its own system prompt of ``--prefix-len`` tokens
  (1,024), C conversations of T turns on them arriving as a Poisson process
  (``--arrival-rate`` per second), each turn sent when the previous one
  finished; each replica's L1 holds about ``--l1-prefixes`` (a quarter) of
  the system prompts, so a placement that ignores the cache misses most of
  the time. The event-driven router (``kv_events``: what the replicas'
  published block events say they hold), the guess-based one
  (``cache_aware``: what it sent where) and Ray Serve's default (power of two
  choices) alternate; with ``--tiers none,redis`` the same again over a
  write-through Redis tier every replica shares. Reported: the prompt-token
  hit rate (cached / prompt tokens) and TTFT p50/p99.
- ``disaggregation``: D streams decoding O tokens each while L long prompts
  (``--long-len`` tokens, one output token) arrive one after another; TPOT
  p50/p99 of the decoding streams, with 2 replicas that prefill and decode,
  against 1 prefill replica + 1 decode replica handing prompts over through
  a redis tier (a ``redis-server`` is started on a free loopback port).
- ``nodes``: two Ray nodes on this machine (``tests.ray_nodes``), an engine
  replica on each; clients send requests (not streamed) for
  ``--node-seconds`` and every process of the worker node is SIGKILLed at
  ``--kill-at``. Reported: requests failed (the target: none; those in
  flight on the lost node are sent again by the ingress), the replicas
  serving before and after, and how long after the loss requests were slow.

On one 2-core machine both replicas share the same two cores (Ray gives each
one CPU), so this shows what routing changes (hits, and the prefill work they
save), not what more machines add.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
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

ROUTINGS = ("kv_events", "cache_aware", "power_of_two")
SHARED_TIERS = ("none", "redis")
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


def deploy(
    ctx: BenchContext, port: int, fleet: dict[str, Any], tiers: list[dict] | None = None, kv: dict[str, Any] | None = None
) -> FleetServer:
    """(Re)deploy the fleet with these ``[fleet]`` keys (and ``[kv_cache]`` ones); returns once every replica is ready."""
    from ray import serve

    from tierserve.fleet.app import APP_NAME, build_fleet
    from tierserve.fleet.settings_sources import SettingsSources

    overrides: dict[tuple[str, str], Any] = {
        ("model", "path"): str(ctx.checkpoint),
        ("logging", "level"): "warning",
        # Ray gives this cluster 2 CPUs: every replica of the deployment must fit in them
        ("fleet", "num_cpus"): min(1.0, 2.0 / max(1, fleet.get("replicas", 1) + fleet.get("prefill_replicas", 0))),
        **{("fleet", key): value for key, value in fleet.items()},
    }
    if tiers is not None:
        overrides[("kv_cache", "tiers")] = tiers
    overrides.update({("kv_cache", key): value for key, value in (kv or {}).items()})
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


def routing_chats(ctx: BenchContext, args: Any, seed: int) -> list[Conversation]:
    """The conversations of one routing run, in the order they arrive (tenants interleaved)."""
    chats = conversations(ctx.tokenizer, args.systems_prompts, max(1, args.conversations // args.systems_prompts),
                          args.turns, args.prefix_len, args.turn_len, seed)  # fmt: skip
    random.Random(seed).shuffle(chats)
    return chats


def hit_rate_ceiling(tokenizer: Any, chats: list[Conversation], turns: int) -> float:
    """The prompt-token hit rate no placement can beat on these conversations: a prompt can reuse at most its
    longest common prefix with an earlier prompt (partial blocks included), never its last token. Earlier: the
    conversation's own turns before it, and every turn of the conversations that started before it (more than
    had arrived by then, which can only raise the bound). Generated tokens are not counted: the next turn's
    prompt carries the conversation's fixed reply instead."""
    trie: dict[int, dict] = {}
    cached = total = 0
    for chat in chats:
        for turn in range(turns):
            ids = tokenizer(chat.prompt(turn))["input_ids"]
            node, shared = trie, 0
            for token in ids:  # walk what earlier prompts hold, then add the rest of this one
                if token in node:
                    shared += 1
                node = node.setdefault(token, {})
            cached += min(shared, len(ids) - 1)
            total += len(ids)
    return cached / total if total else 0.0


def routing_run(ctx: BenchContext, server: FleetServer, args: Any, seed: int) -> dict:
    chats = routing_chats(ctx, args, seed)
    sessions = [[server.completion_body(chat.prompt(t), args.output_len) for t in range(args.turns)] for chat in chats]
    rng, clock, starts = random.Random(seed + 1), 0.0, []
    for _ in sessions:  # Poisson arrivals: exponential gaps
        starts.append(clock)
        clock += rng.expovariate(args.arrival_rate) if args.arrival_rate > 0 else 0.0
    fleet_stats = lambda: httpx.get(f"{server.base_url}/v1/fleet/stats", timeout=30).json()  # noqa: E731
    before = fleet_stats()["routing_decisions"]
    result: RunResult = asyncio.run(run_clients(server, sessions, starts=starts))
    summary = result.summary()
    summary["hit_rate"] = summary["cached_tokens"] / summary["prompt_tokens"] if summary["prompt_tokens"] else 0.0
    summary["hit_rate_ceiling"] = hit_rate_ceiling(ctx.tokenizer, chats, args.turns)
    stats = fleet_stats()
    after = stats["routing_decisions"]  # the ingress counts since it started: this run's are the difference
    summary["routing_decisions"] = {reason: after[reason] - before.get(reason, 0) for reason in after if after[reason] != before.get(reason, 0)}
    summary["routing_seconds"] = stats.get("routing_seconds")  # the router's own time per decision (its latest)
    # the replicas' own TTFT p50 (their recent requests): what the client sees beyond it is the proxy, ingress and router
    summary["replica_ttft_p50_s"] = median([r["ttft_p50"] for r in stats["replicas"].values() if r.get("ttft_p50")] or [0.0])
    # how evenly the router spread the run (a redeploy starts new replicas: their counts are this run's)
    # decisions, not requests: Ray asks the router again when a chosen replica cannot take one
    counts = sorted(sum(r.get("routing_decisions", {}).values()) for r in stats["replicas"].values())
    summary["decisions_per_replica"] = counts if any(counts) else None  # Ray's own router counts nothing here
    return summary


def warm_up(ctx: BenchContext, server: FleetServer, args: Any) -> None:
    """A few unmeasured requests first: the proxy, the ingress and their handles start cold, and the first
    measured run would pay for that alone."""
    rng = random.Random(1)
    sessions = [[server.completion_body(text_with_tokens(ctx.tokenizer, args.prefix_len, rng), args.output_len)] for _ in range(8)]
    asyncio.run(run_clients(server, sessions))


def l1_blocks(args: Any, block_size: int = 16) -> int:
    """An L1 holding ``--l1-prefixes`` of the system prompts, with their conversations' turns."""
    conversation = args.prefix_len + args.turns * (2 * args.turn_len + args.output_len)
    return max(64, int(args.l1_prefixes * args.systems_prompts * conversation / block_size))


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
    runs: list[dict] = []
    if set(args.parts) <= {"nodes"}:
        return finish(ctx, args, [node_loss(ctx, args)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    redis_server = None
    try:
        if "routing" in args.parts:
            kv = {"l1_capacity": l1_blocks(args), "block_size": 16}
            for shared in args.tiers:
                tiers: list[dict] = []  # no tier below L1: what a replica evicts is gone
                if shared == "redis":
                    redis_server = redis_server or RedisServer(Path(tempfile.mkdtemp(prefix="tierserve-redis-"))).start()
                    tiers = [{"name": "shared", "plugin": "redis", "url": redis_server.url, "write_through": True}]
                for repeat in range(args.repeats):
                    routings = [routing for routing in ROUTINGS if routing in args.routings]
                    order = routings if repeat % 2 == 0 else routings[::-1]
                    for routing in order:
                        server = deploy(ctx, port, {"replicas": args.replicas, "routing": routing}, tiers, kv)
                        if not runs:
                            warm_up(ctx, server, args)
                        # fresh prompts every run: a replica the redeploy kept holds nothing a later run asks for
                        summary = routing_run(ctx, server, args, seed=1000 + len(runs))
                        if redis_server is not None:
                            redis_server.client().flushall()
                        runs.append({"part": "routing", "routing": routing, "tier": shared, "repeat": repeat, **summary})
                        print(f"routing {routing} ({shared}): hit rate {summary['hit_rate']:.3f}, TTFT p50 "
                              f"{summary['ttft_p50_s']}s p99 {summary['ttft_p99_s']}s, errors {summary['errors']} "
                              f"({summary['first_error']}), decisions {summary['routing_decisions']}, routing {summary['routing_seconds']}, "
                              f"replicas' TTFT p50 {summary['replica_ttft_p50_s']}")
        if "disaggregation" in args.parts:
            redis_server = redis_server or RedisServer(Path(tempfile.mkdtemp(prefix="tierserve-redis-"))).start()
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
    if "nodes" in args.parts:
        runs.append(node_loss(ctx, args))
    return finish(ctx, args, runs)


def finish(ctx: BenchContext, args: Any, runs: list[dict]) -> dict:
    config = {key: getattr(args, key) for key in (
        "parts", "replicas", "conversations", "systems_prompts", "turns", "prefix_len", "turn_len", "output_len",
        "arrival_rate", "l1_prefixes", "routings", "tiers", "repeats", "decoders", "decode_len", "long_prompts", "long_len",
        "node_clients", "node_seconds", "kill_at",
    )}  # fmt: skip
    summary = summarise(runs)
    lost = [r for r in runs if r.get("part") == "nodes"]
    if lost:
        summary["nodes"] = lost[0]
    return {"config": {"model": ctx.model, **config}, "runs": runs, "summary": summary}


def node_loss(ctx: BenchContext, args: Any) -> dict:
    """Two Ray nodes on this machine (``tests.ray_nodes``), an engine replica on each; ``--node-clients`` clients
    send conversations (not streamed) for ``--node-seconds``; every process of the worker node is SIGKILLed at
    ``--kill-at`` seconds. Counts the requests that failed, and how long after the loss requests were slow."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tests.ray_nodes import TwoNodes, serving
    from tierserve.fleet.app import build_fleet
    from tierserve.fleet.settings_sources import SettingsSources

    nodes = TwoNodes(Path(tempfile.mkdtemp(prefix="tierserve-nodes-"))).start()
    overrides = {
        ("model", "path"): str(ctx.checkpoint), ("logging", "level"): "warning", ("fleet", "replicas"): 2,
        ("fleet", "num_cpus"): 0.5, ("fleet", "max_replicas_per_node"): 1, ("fleet", "routing"): "kv_events",
    }  # fmt: skip
    rng = random.Random(7)
    systems = [text_with_tokens(ctx.tokenizer, args.prefix_len // 4, rng) for _ in range(8)]
    results: list[tuple[float, float, int, str]] = []  # start, end (since the run began), status, replica
    failures: list[str] = []
    stop = threading.Event()
    try:
        with serving(nodes, build_fleet(SettingsSources.of("development", None, overrides))) as url:
            began = time.monotonic()

            def client(index: int) -> None:
                turn = 0
                with httpx.Client(timeout=120) as http:
                    while not stop.is_set():
                        prompt = systems[(index + turn) % len(systems)] + text_with_tokens(ctx.tokenizer, 16, rng)
                        body = {"model": str(ctx.checkpoint), "prompt": prompt, "max_tokens": args.output_len,
                                "temperature": 0, "ignore_eos": True}  # fmt: skip
                        started = time.monotonic() - began
                        try:
                            answer = http.post(f"{url}/v1/completions", json=body)
                            status, replica = answer.status_code, answer.headers.get("x-tierserve-replica", "")
                            if status != 200:
                                failures.append(f"HTTP {status}: {answer.text[:300]}")
                        except httpx.HTTPError as exc:
                            status, replica = 0, ""
                            failures.append(repr(exc))
                        results.append((started, time.monotonic() - began, status, replica))
                        turn += 1

            with ThreadPoolExecutor(args.node_clients) as pool:
                for index in range(args.node_clients):
                    pool.submit(client, index)
                time.sleep(args.kill_at)
                killed = time.monotonic() - began
                nodes.kill_worker()
                time.sleep(max(0.0, args.node_seconds - args.kill_at))
                stop.set()
    finally:
        nodes.stop()
    replicas_before = {r[3] for r in results if r[1] < killed and r[2] == 200}
    after = [r for r in results if r[0] > killed]
    slow_until = max((r[0] for r in after if r[1] - r[0] > 3 * median([b[1] - b[0] for b in results if b[1] < killed] or [1.0])),
                     default=killed)  # fmt: skip
    summary = {
        "requests": len(results),
        "failed": sum(1 for r in results if r[2] != 200),
        "failures": failures[:5],  # what the first failed requests were answered
        "in_flight_at_kill": sum(1 for r in results if r[0] < killed < r[1]),
        "replicas_before": len(replicas_before),
        "replicas_after": len({r[3] for r in after if r[2] == 200}),
        "latency_p50_before_s": median([r[1] - r[0] for r in results if r[1] < killed]),
        "latency_max_in_flight_s": max((r[1] - r[0] for r in results if r[0] < killed < r[1]), default=None),
        "slow_for_s": round(slow_until - killed, 3),  # the last request started after the loss that took 3x the usual
        "latency_p50_after_s": median([r[1] - r[0] for r in after if r[0] > killed + 10]),
    }
    print(f"node loss: {summary}")
    return {"part": "nodes", **summary}


def summarise(runs: list[dict]) -> dict:
    """Medians over repeats per configuration, and the ratios the issue's targets name."""
    out: dict[str, Any] = {}
    for shared in SHARED_TIERS:
        table: dict[str, Any] = {}
        for routing in ROUTINGS:
            mine = [r for r in runs if r.get("routing") == routing and r.get("tier") == shared]
            if mine:
                keys = ("hit_rate", "hit_rate_ceiling", "ttft_p50_s", "ttft_p99_s", "output_tok_s", "replica_ttft_p50_s")
                table[routing] = {key: median([r[key] for r in mine if r.get(key) is not None]) for key in keys}
        default = table.get("power_of_two")
        for routing in ("kv_events", "cache_aware"):
            if routing in table and default:
                mine = table[routing]
                mine["hit_rate_vs_power_of_two"] = mine["hit_rate"] / default["hit_rate"] if default["hit_rate"] else None
                mine["ttft_p50_lower_by"] = default["ttft_p50_s"] / mine["ttft_p50_s"] if mine["ttft_p50_s"] else None
                mine["ttft_p99_lower_by"] = default["ttft_p99_s"] / mine["ttft_p99_s"] if mine["ttft_p99_s"] else None
        if table:
            out[f"routing_{shared}"] = table
    for split in SPLITS:
        mine = [r for r in runs if r.get("split") == split]
        if mine:
            out[split] = {key: median([r[key] for r in mine]) for key in ("tpot_p50_s", "tpot_p99_s", "itl_p99_s", "long_ttft_p50_s")}
    return out
