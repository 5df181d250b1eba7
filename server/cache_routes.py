"""Cache operations: ``GET /v1/cache/stats`` (with alerts and trends), ``POST /v1/cache/clear`` and ``/v1/cache/warm``.

A monitor thread samples the engine every ``monitoring.collection_interval_seconds``
into a rolling window of ``monitoring.trend_samples`` points; alerts are
evaluated live on each stats request (and logged by the monitor when they start).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Annotated, Any

import structlog
from litestar import Request, get, post
from litestar.params import JSONBody
from pydantic import BaseModel, ConfigDict, Field

from tierserve.server.errors import APIError
from tierserve.server.openai_routes import remember_prefix
from tierserve.server.state import ServerState, ready_engine, state_of

if TYPE_CHECKING:
    from tierserve.core.engine import Engine

log = structlog.get_logger(__name__)

TIERS = ("l1", "l2", "l3")


def kv_cache_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """Block-level totals over the tiers; each prompt block a lookup could use counts once.

    A block missed in L1 but found in L2 or L3 is a hit of that tier, so
    ``misses`` are L1 misses less the lower tiers' hits.
    """
    tiers = stats.get("tiers", {})
    hits = {name: tiers.get(name, {}).get("hits", 0) for name in TIERS}
    total_hits = sum(hits.values())
    misses = max(0, tiers.get("l1", {}).get("misses", 0) - hits["l2"] - hits["l3"])
    lookups = total_hits + misses
    return {
        "hits": total_hits,
        "misses": misses,
        "hit_rate": round(total_hits / lookups, 4) if lookups else 0.0,
        "memory_bytes": tiers.get("l2", {}).get("bytes", 0),
        "disk_bytes": tiers.get("l3", {}).get("bytes", 0),
        "evictions": sum(values.get("evictions", 0) for values in tiers.values()),
        "l1_hits": hits["l1"],
        "l2_hits": hits["l2"],
        "l3_hits": hits["l3"],
        "promotions": dict(stats.get("promotions", {})),
        "demotions": dict(stats.get("demotions", {})),
        "tiers": tiers,
    }


def dropped_writes(stats: dict[str, Any]) -> int:
    return sum(values.get("dropped_writes", 0) for values in stats.get("tiers", {}).values())


def current_alerts(state: ServerState, engine: Engine, stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Thresholds of ``[monitoring]`` that the engine is past right now."""
    monitoring = state.settings.monitoring
    kv = kv_cache_summary(stats)
    alerts: list[dict[str, Any]] = []

    def alert(name: str, message: str, value: float, threshold: float) -> None:
        alerts.append({"name": name, "message": message, "value": value, "threshold": threshold})

    threshold = monitoring.alert_hit_rate_below
    if threshold is not None and kv["hits"] + kv["misses"] and kv["hit_rate"] < threshold:
        alert("low_hit_rate", f"KV cache block hit rate {kv['hit_rate']:.2%} is below {threshold:.2%}", kv["hit_rate"], threshold)
    threshold = monitoring.alert_memory_bytes_above
    if threshold is not None and kv["memory_bytes"] > threshold:
        alert("high_memory", f"L2 holds {kv['memory_bytes']} bytes, above {threshold}", kv["memory_bytes"], threshold)
    threshold = monitoring.alert_dropped_writes_above
    dropped = dropped_writes(stats)
    if threshold is not None and dropped > threshold:
        alert(
            "dropped_writes",
            f"{dropped} cache writes were dropped (write queue full; raise kv_cache.l3_write_queue), above {threshold}",
            dropped,
            threshold,
        )
    fraction = monitoring.alert_queue_fraction_above
    if fraction is not None:
        limit = fraction * engine.settings.scheduler.max_waiting_requests
        waiting = engine.scheduler.num_waiting
        if waiting > limit:
            alert("queue_full", f"{waiting} requests are waiting, above {fraction:.0%} of max_waiting_requests", waiting, limit)
    return alerts


class CacheMonitor:
    """Samples cache statistics on a background thread into a rolling window."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        monitoring = state.settings.monitoring
        self.interval = monitoring.collection_interval_seconds
        self.samples: deque[dict[str, Any]] = deque(maxlen=monitoring.trend_samples)
        self._active_alerts: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierserve-cache-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=max(5.0, 2 * self.interval))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # a failed sample must not end monitoring
                log.exception("cache_monitor_sample_failed")

    def sample(self) -> None:
        state = self.state
        engine = state.engine
        if not state.ready or engine is None:
            return
        stats = engine.cache_stats()
        kv = kv_cache_summary(stats)
        self.samples.append(
            {
                "timestamp": round(time.time(), 3),
                "hit_rate": kv["hit_rate"],
                "memory_bytes": kv["memory_bytes"],
                "cached_tokens": stats.get("cached_tokens", 0),
                "requests_running": engine.scheduler.num_running,
                "requests_waiting": engine.scheduler.num_waiting,
                "dropped_writes": dropped_writes(stats),
            }
        )
        alerts = {a["name"]: a for a in current_alerts(state, engine, stats)}
        for name in alerts.keys() - self._active_alerts:
            log.warning("cache_alert", **alerts[name])
        self._active_alerts = set(alerts)


def build_stats(state: ServerState, engine: Engine) -> dict[str, Any]:
    """The ``/v1/cache/stats`` document (blocking: reads the engine between steps)."""
    stats = engine.cache_stats()
    index = stats.get("index") or {}
    counters = stats.get("engine", {})
    prompt_tokens = counters.get("prompt_tokens", 0)
    cached_tokens = stats.get("cached_tokens", 0)
    monitor: CacheMonitor | None = state.extras.get("cache_monitor")  # type: ignore[assignment]
    return {
        "cache_manager": {
            "kv_cache": kv_cache_summary(stats),
            "radix_tree": {
                "cached_blocks": index.get("cached_blocks", 0),
                "active_prefixes": index.get("active_prefixes", 0),
                "avg_prefix_tokens": round(index.get("avg_prefix_tokens", 0.0), 2),
                "prefix_matches": stats.get("prefix_matches", 0),
                "lookups": stats.get("lookups", 0),
            },
            "speculation": stats["speculation"],
            "sliding_window": stats["sliding_window"],
        },
        "overall": {
            "cached_tokens": cached_tokens,
            "computed_tokens": stats.get("computed_tokens", 0),
            "prompt_tokens": prompt_tokens,
            "generation_tokens": counters.get("generation_tokens", 0),
            "token_hit_rate": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
            "requests_running": engine.scheduler.num_running,
            "requests_waiting": engine.scheduler.num_waiting,
        },
        "alerts": current_alerts(state, engine, stats),
        "trends": list(monitor.samples) if monitor is not None else [],
    }


class ClearRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tiers: list[str] | str = "all"


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class WarmRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompts: list[str] | None = None
    messages: list[Annotated[list[Message], Field(min_length=1)]] | None = None  # an empty conversation has no prompt
    cache_salt: str | None = None
    cache_key: str | None = None  # name the (single) warmed prompt for /v1/cached/* requests


@get("/v1/cache/stats")
async def cache_stats(request: Request) -> dict[str, Any]:
    engine = ready_engine(request)
    return await asyncio.to_thread(build_stats, state_of(request), engine)


def _requested_tiers(tiers: list[str] | str) -> list[str]:
    if isinstance(tiers, str):
        tiers = [tiers]
    unknown = [tier for tier in tiers if tier not in (*TIERS, "all")]
    if unknown or not tiers:
        got = ", ".join(repr(t) for t in unknown) if unknown else "an empty list"
        message = f"tiers: got {got}; allowed: a list of {', '.join(TIERS)}, or \"all\""
        raise APIError(400, message, param="tiers", code="invalid_value")
    return ["all"] if "all" in tiers else list(dict.fromkeys(tiers))


@post("/v1/cache/clear", opt={"admin": True}, status_code=200)
async def cache_clear(request: Request, data: JSONBody[ClearRequest | None] = None) -> dict[str, Any]:
    engine = ready_engine(request)
    tiers = _requested_tiers((data or ClearRequest()).tiers)

    def clear() -> dict[str, int]:
        cleared: dict[str, int] = {}
        for tier in tiers:
            for name in TIERS if tier == "all" else (tier,):
                cleared.setdefault(name, 0)  # a tier that is not configured held nothing
            if tier == "all" or (engine.store is not None and tier in engine.store.tier_names):
                cleared.update(engine.clear_cache(tier))
        return cleared

    cleared = await asyncio.to_thread(clear)
    log.info("cache_cleared", tiers=tiers, cleared=cleared)
    return {"cleared": cleared}


@post("/v1/cache/offload", opt={"admin": True}, status_code=200)
async def cache_offload(request: Request) -> dict[str, Any]:
    """Free the live pool but keep its idle cached prefixes, moved to L2 (or L3)."""
    engine = ready_engine(request)
    moved = await asyncio.to_thread(engine.offload_cache)
    log.info("cache_offloaded", blocks=moved)
    return {"offloaded_blocks": moved}


@post("/v1/cache/warm", opt={"admin": True}, status_code=200)
async def cache_warm(request: Request, data: JSONBody[WarmRequest]) -> dict[str, Any]:
    engine = ready_engine(request)
    if not data.prompts and not data.messages:
        message = "prompts: give a non-empty list of prompts, or messages (a list of conversations)"
        raise APIError(400, message, param="prompts", code="invalid_value")
    conversations = [[m.model_dump() for m in conversation] for conversation in data.messages or []]
    prompts: list[Any] = list(data.prompts or [])
    if data.cache_key is not None and len(prompts) + len(conversations) != 1:
        message = "cache_key: names one prefix; give exactly one prompt (or one conversation) with it"
        raise APIError(400, message, param="cache_key", code="invalid_value")
    batch = engine.settings.scheduler.max_num_seqs  # in batches, so a long list never fills the waiting queue

    def warm() -> int:
        # chat templates and tokenisation happen here, off the event loop
        items = [engine.encode_prompt(p) for p in prompts]
        items += [engine.encode_prompt(None, conversation) for conversation in conversations]
        if data.cache_key is not None:
            remember_prefix(state_of(request), data.cache_key, items[0])
        return sum(engine.warm(items[i : i + batch], cache_salt=data.cache_salt) for i in range(0, len(items), batch))

    tokens = await asyncio.to_thread(warm)
    count = len(prompts) + len(conversations)
    log.info("cache_warmed", prompts=count, tokens=tokens)
    return {"warmed": count, "tokens": tokens, "blocks": tokens // engine.pool.block_size}


def setup(state: ServerState) -> None:
    if state.settings.monitoring.enabled:
        monitor = CacheMonitor(state)
        state.extras["cache_monitor"] = monitor
        monitor.start()


def teardown(state: ServerState) -> None:
    monitor: CacheMonitor | None = state.extras.pop("cache_monitor", None)  # type: ignore[assignment]
    if monitor is not None:
        monitor.stop()


ROUTES = [cache_stats, cache_clear, cache_offload, cache_warm]
