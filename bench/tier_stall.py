"""Scenario ``tier-stall``: do reads from the slow tiers stall the streams that are decoding?

S streams decode (short prompts, long outputs, streaming). Once each has
produced a few tokens, A other requests arrive one every ``--arrival-interval``
seconds, each a ``--prefix-len``-token prefix of its own plus a short suffix,
asking for one token (so their latency is their TTFT). Where those prefixes
sit decides the case:

- ``none``: no arrivals (the streams alone, for ``--baseline-seconds``);
- ``recompute``: nothing holds the prefixes: they are computed;
- ``L1``: warmed and left in the live pool (what the arrivals' own new tokens cost the streams, with no tier
  read at all: the reference the tier cases are held to);
- ``L2``: warmed, then offloaded to host memory (``/v1/cache/offload``);
- ``L3``: warmed (written through to disk), then dropped from L1 and L2;
- ``redis``: warmed on a server whose only tier below L1 is a write-through
  ``redis`` tier, then dropped from L1; the server reaches Redis through a TCP
  proxy (``bench.delay_proxy``) that adds ``--redis-delay-ms`` to every round
  trip (the measured round trip is reported).

Every case runs under a cache salt of its own, alternating within a repeat.
Reported per case: the streams' inter-token gaps (p50/p99/max) while the
arrivals are in flight (from the first sent to the last answered; ``none``:
the baseline window), each against ``none``; the arrivals' TTFT (median, max)
and the prompt tokens they found cached, against ``recompute``.

Two servers run, both ``tierserve serve --preset production`` with an L3 folder
of the run's own: one with the preset's tiers (L2 memory, L3 disk), one with
the redis tier only.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.client import RequestResult, stream_completion
from bench.delay_proxy import DelayProxy
from bench.harness import BenchContext, warm_up
from bench.servers import Server, start_tierserve
from bench.stats import median, percentile, ratio
from bench.workloads import text_with_tokens
from tests.redis_server import RedisServer  # the tests' own helper; bench runs from a checkout

CASES = ("none", "recompute", "L1", "L2", "L3", "redis")
FIRST_TOKENS = 4  # tokens each stream produces before the arrivals start


@dataclass
class Stream:
    """One decoding stream: the arrival time of each of its text chunks (``time.perf_counter``)."""

    chunks: list[float] = field(default_factory=list)
    error: str | None = None


async def _decode(client: httpx.AsyncClient, server: Server, body: dict, stream: Stream) -> None:
    """Stream ``body``'s tokens into ``stream.chunks`` until the response ends or the task is cancelled."""
    try:
        async with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                stream.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                if any(choice.get("text") for choice in json.loads(line[5:]).get("choices") or []):
                    stream.chunks.append(time.perf_counter())
    except (httpx.HTTPError, ValueError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"


async def _run_case(
    server: Server, streams: list[dict], arrivals: list[dict], interval: float, baseline_seconds: float
) -> tuple[list[Stream], list[RequestResult], float, float]:
    """The streams, then the arrivals once every stream is decoding; returns the window the gaps are taken in."""
    limits = httpx.Limits(max_connections=len(streams) + len(arrivals) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        decoding = [Stream() for _ in streams]
        tasks = [asyncio.create_task(_decode(client, server, body, s)) for body, s in zip(streams, decoding)]
        deadline = time.monotonic() + 300
        while any(len(s.chunks) < FIRST_TOKENS and s.error is None for s in decoding):
            if time.monotonic() > deadline or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        if arrivals:

            async def later(body: dict, delay: float) -> RequestResult:
                await asyncio.sleep(delay)
                return await stream_completion(client, server, body)

            answered = await asyncio.gather(*(later(body, i * interval) for i, body in enumerate(arrivals)))
        else:
            await asyncio.sleep(baseline_seconds)
            answered = []
        end = time.perf_counter()
        for task in tasks:
            task.cancel()  # the client goes away: the server aborts the stream
        await asyncio.gather(*tasks, return_exceptions=True)
    return decoding, list(answered), start, end


def _gaps(streams: list[Stream], start: float, end: float) -> list[float]:
    """Every inter-token gap whose later token arrived inside the window."""
    gaps = []
    for stream in streams:
        for before, after in zip(stream.chunks, stream.chunks[1:]):
            if start < after <= end:
                gaps.append(after - before)
    return gaps


def _post(server: Server, path: str, body: dict | None = None) -> dict:
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=900)
    response.raise_for_status()
    return response.json()


def _place(server: Server, case: str, prefixes: list[str], salt: str) -> None:
    """Put the arrivals' prefixes where ``case`` wants them, and nowhere faster."""
    if case in ("none", "recompute"):
        return
    if case == "L2":  # an offload moves every idle L1 block: only these go down, into an L2 with room for them all
        _post(server, "/v1/cache/clear", {"tiers": ["l1", "l2"]})
    # L1 included: the warm's write-through copies are stored before the case starts
    _post(server, "/v1/cache/warm", {"prompts": prefixes, "cache_salt": salt})
    # the write-through copies are stored: no writer runs during the case (a warm waits for its own writes;
    # builds without this route, measured for comparison, have nothing else queued)
    flushed = httpx.post(f"{server.base_url}/v1/cache/flush", timeout=900)
    if flushed.status_code != 404:
        flushed.raise_for_status()
    if case == "L2":
        _post(server, "/v1/cache/offload")
    elif case == "L3":
        _post(server, "/v1/cache/clear", {"tiers": ["l1", "l2"]})
    elif case == "redis":
        _post(server, "/v1/cache/clear", {"tiers": ["l1"]})


def _load_counts(server: Server) -> dict[str, int]:
    """``loads``, ``load_timeouts`` and ``load_failures`` of the server's cache statistics."""
    response = httpx.get(f"{server.base_url}/v1/cache/stats", timeout=60)
    response.raise_for_status()
    pending = [response.json()]
    while pending:  # wherever the document keeps the store's counters
        item = pending.pop()
        if isinstance(item, dict):
            if "load_timeouts" in item:
                return {name: int(item.get(name, 0)) for name in ("loads", "load_timeouts", "load_failures")}
            pending.extend(item.values())
    return {"loads": 0, "load_timeouts": 0, "load_failures": 0}


def _round_trip_ms(port: int, tries: int = 50) -> float:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    client.ping()
    times = []
    for _ in range(tries):
        started = time.perf_counter()
        client.ping()
        times.append((time.perf_counter() - started) * 1000)
    client.close()
    return median(times)


def run(
    ctx: BenchContext,
    streams: int,
    stream_tokens: int,
    arrivals: int,
    prefix_len: int,
    suffix_len: int,
    interval: float,
    baseline_seconds: float,
    redis_delay_ms: float,
    repeats: int,
    cases: list[str],
) -> dict:
    rng = random.Random(11)
    prefixes = [text_with_tokens(ctx.tokenizer, prefix_len, rng) for _ in range(arrivals)]
    suffixes = [text_with_tokens(ctx.tokenizer, suffix_len, rng) for _ in range(arrivals)]
    stream_prompts = [text_with_tokens(ctx.tokenizer, 32, rng) for _ in range(streams)]
    logs = ctx.results_dir / "logs"
    runs: list[dict] = []
    redis_server = proxy = None
    servers: dict[str, Server] = {}
    round_trip = None
    try:
        local = [case for case in cases if case != "redis"]
        if local:
            servers["local"] = start_tierserve(ctx.checkpoint, logs, Path(tempfile.mkdtemp(prefix="tierserve-l3-")),
                                               name="tierserve")  # fmt: skip
        if "redis" in cases:
            redis_server = RedisServer(Path(tempfile.mkdtemp(prefix="tierserve-redis-"))).start()
            proxy = DelayProxy("127.0.0.1", redis_server.port, redis_delay_ms / 1000).start()
            round_trip = _round_trip_ms(proxy.port)
            tier = f'[{{name="redis", plugin="redis", url="redis://127.0.0.1:{proxy.port}/0", write_through=true}}]'
            servers["redis"] = start_tierserve(
                ctx.checkpoint, logs, Path(tempfile.mkdtemp(prefix="tierserve-l3-")), name="tierserve",
                settings=[f"kv_cache.tiers={tier}"],
            )  # fmt: skip
        for server in servers.values():
            warm_up(server, ctx.tokenizer)
        with ctx.progress(repeats * len(cases), "tier-stall") as bar:
            for repeat in range(repeats):
                for case in cases:
                    bar.set_postfix_str(f"{case} (repeat {repeat + 1}/{repeats})")
                    server = servers["redis" if case == "redis" else "local"]
                    salt = f"tier-stall-{case}-{repeat}-{rng.random()}"
                    _place(server, case, prefixes, salt)
                    stream_bodies = [
                        server.completion_body(prompt, stream_tokens, cache_salt=f"{salt}-streams") for prompt in stream_prompts
                    ]
                    arrival_bodies = [] if case == "none" else [
                        server.completion_body(prefix + " " + suffix, 1, cache_salt=salt)
                        for prefix, suffix in zip(prefixes, suffixes)
                    ]  # fmt: skip
                    before = _load_counts(server)
                    decoding, answered, start, end = asyncio.run(
                        _run_case(server, stream_bodies, arrival_bodies, interval, baseline_seconds)
                    )
                    after = _load_counts(server)
                    gaps = _gaps(decoding, start, end)
                    ttfts = [a.ttft for a in answered if a.ttft is not None]
                    runs.append({
                        "case": case,
                        "repeat": repeat,
                        "window_s": end - start,
                        "gaps": len(gaps),
                        "itl_p50_s": percentile(gaps, 50),
                        "itl_p99_s": percentile(gaps, 99),
                        "itl_max_s": max(gaps, default=None),
                        "arrival_ttft_p50_s": median(ttfts),
                        "arrival_ttft_max_s": max(ttfts, default=None),
                        "arrival_cached_tokens": [a.cached_tokens for a in answered],
                        # the server's own counts over the case: prefix reads on the loader thread, those given up
                        **{name: after[name] - before[name] for name in after},
                        "errors": [e for e in [*(s.error for s in decoding), *(a.error for a in answered)] if e],
                    })  # fmt: skip
                    bar.update(1)
    finally:
        for server in servers.values():
            server.stop()
        if proxy is not None:
            proxy.stop()
        if redis_server is not None:
            redis_server.stop()
    summary = _summary(runs, cases)
    config = {
        "model": ctx.model, "checkpoint": str(ctx.checkpoint), "streams": streams, "stream_tokens": stream_tokens,
        "arrivals": arrivals, "prefix_len": prefix_len, "suffix_len": suffix_len, "arrival_interval_s": interval,
        "baseline_seconds": baseline_seconds, "redis_delay_ms": redis_delay_ms,
        "redis_round_trip_ms": round_trip, "repeats": repeats, "cases": cases,
    }  # fmt: skip
    return {"config": config, "runs": runs, "summary": summary}


def _summary(runs: list[dict], cases: list[str]) -> list[dict]:
    """Medians over repeats per case, and the ratios the targets are stated in."""
    rows = []
    for case in cases:
        mine = [r for r in runs if r["case"] == case]
        rows.append({
            "case": case,
            "itl_p50_s": median([r["itl_p50_s"] for r in mine]),
            "itl_p99_s": median([r["itl_p99_s"] for r in mine]),
            "arrival_ttft_p50_s": median([r["arrival_ttft_p50_s"] for r in mine]),
            "arrival_cached_tokens": median([median(r["arrival_cached_tokens"]) for r in mine if r["arrival_cached_tokens"]]),
        })  # fmt: skip
    base = next((row for row in rows if row["case"] == "none"), None)
    recompute = next((row for row in rows if row["case"] == "recompute"), None)
    in_l1 = next((row for row in rows if row["case"] == "L1"), None)
    for row in rows:
        row["itl_p99_vs_none"] = ratio(row["itl_p99_s"], base["itl_p99_s"]) if base else None
        row["itl_p99_vs_l1"] = ratio(row["itl_p99_s"], in_l1["itl_p99_s"]) if in_l1 else None
        row["ttft_vs_recompute"] = ratio(row["arrival_ttft_p50_s"], recompute["arrival_ttft_p50_s"]) if recompute else None
    return rows
