"""The async load generator: streaming ``/v1/completions`` requests from N concurrent clients.

Per request it records time to first token (first chunk carrying text), the
arrival time of every text chunk, and the server's own token counts from the
final usage chunk. A run's throughput is output tokens over the wall time
from the first request sent to the last response finished.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from bench.servers import Server
from bench.stats import percentile


@dataclass
class RequestResult:
    ttft: float | None = None  # seconds from send to the first text chunk
    latency: float = 0.0  # seconds from send to the end of the stream
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    turn: int = 0  # position of the request in its client's session

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (the inter-token latency averaged over the request)."""
        if self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class RunResult:
    """One run: every request of the workload against one system."""

    wall_seconds: float
    requests: list[RequestResult]

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.requests) - len(self.ok)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens or 0 for r in self.ok)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def summary(self) -> dict:
        ttfts = [r.ttft for r in self.ok if r.ttft is not None]
        tpots = [r.tpot for r in self.ok if r.tpot is not None]
        return {
            "requests": len(self.requests),
            "errors": self.errors,
            "first_error": next((r.error for r in self.requests if r.error), None),
            "output_tokens": self.output_tokens,
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in self.ok),
            "cached_tokens": sum(r.cached_tokens or 0 for r in self.ok),
            "wall_s": self.wall_seconds,
            "output_tok_s": self.tokens_per_second,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "tpot_p50_s": percentile(tpots, 50),
            "tpot_p99_s": percentile(tpots, 99),
        }


async def stream_completion(client: httpx.AsyncClient, server: Server, body: dict) -> RequestResult:
    """Send one streaming completion and time it; a failure is recorded, never raised."""
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - start
                if result.ttft is not None and '"usage":{' not in data and '"usage": {' not in data:
                    # after the first token only the usage chunk needs parsing: the load
                    # generator shares the CPU with the server it measures, so it stays cheap
                    result.chunk_times.append(now)
                    continue
                chunk = json.loads(data)
                if any(choice.get("text") for choice in chunk.get("choices") or []):
                    result.chunk_times.append(now)
                    if result.ttft is None:
                        result.ttft = now
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    if result.error is None and result.output_tokens is None:
        result.output_tokens = len(result.chunk_times)  # no usage chunk: one token per chunk
    return result


async def run_clients(
    server: Server,
    sessions: Sequence[Sequence[dict]],
    on_done: Callable[[], None] | None = None,
    timeout: float = 3600.0,
    starts: Sequence[float] | None = None,
) -> RunResult:
    """Each session is one client sending its request bodies in order; all sessions run concurrently, each from
    its ``starts`` offset in seconds (default: all at once)."""
    limits = httpx.Limits(max_connections=len(sessions) + 4, max_keepalive_connections=len(sessions) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        results: list[RequestResult] = []

        async def session(bodies: Sequence[dict], start: float) -> None:
            if start > 0:
                await asyncio.sleep(start)
            for turn, body in enumerate(bodies):
                result = await stream_completion(client, server, body)
                result.turn = turn
                results.append(result)
                if on_done is not None:
                    on_done()

        start = time.perf_counter()
        await asyncio.gather(*(session(bodies, start) for bodies, start in zip(sessions, starts or [0.0] * len(sessions))))
        wall = time.perf_counter() - start
    return RunResult(wall, results)


def drive(server: Server, sessions: Sequence[Sequence[dict]], on_done: Callable[[], None] | None = None) -> RunResult:
    """Blocking wrapper around :func:`run_clients`."""
    return asyncio.run(run_clients(server, sessions, on_done))
