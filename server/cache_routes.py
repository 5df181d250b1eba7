"""Cache operations: ``GET /v1/cache/stats`` (with alerts and trends), ``POST /v1/cache/clear``, ``/offload``
and ``/warm``, the most used prefixes (``GET /v1/cache/prefixes``), and the named prefixes:
``GET /v1/cache/keys``, ``DELETE /v1/cache/keys/{key}``.

A monitor thread samples the published statistics every
``monitoring.collection_interval_seconds`` into a rolling window of
``monitoring.trend_samples`` points; alerts are evaluated on each stats
request (and logged by the monitor when they start).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Annotated, Any

import structlog
from litestar import Request, delete, get, post
from litestar.params import FromPath, FromQuery, JSONBody
from pydantic import BaseModel, ConfigDict, Field

from tierserve.cache.warm_writes import WarmedPrompts
from tierserve.server.errors import APIError
from tierserve.server.openai_responses import usage_table
from tierserve.server.recent import latency_window, recent_rates
from tierserve.server.schemas import MAX_MESSAGES, MAX_PROMPTS, MAX_TIERS
from tierserve.server.state import ServerState, ready_engine, state_of
from tierserve.server.tenants import OPEN_TENANT, Caller, cache_scope, caller_of, split_scope
from tierserve.server.stats_document import (
    Activity,
    current_alerts,
    dropped_writes,
    kv_cache_summary,
    operations,
    recent_counters,
    recent_document,
    stats_document,
    tier_trend,
)

if TYPE_CHECKING:
    from tierserve.cache.named_prefixes import NamedPrefix
    from tierserve.engine import EngineClient, EngineSnapshot

log = structlog.get_logger(__name__)

class CacheMonitor:
    """Samples the published statistics on a background thread into a rolling window, and logs new alerts."""

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

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def window_seconds(self) -> float:
        """The span of history the samples can cover."""
        return self.interval * (self.samples.maxlen or 0)

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
        snapshot = engine.stats()
        kv = kv_cache_summary(snapshot)
        self.samples.append(
            {
                "timestamp": round(time.time(), 3),
                "hit_rate": kv["hit_rate"],
                "memory_bytes": kv["memory_bytes"],
                "cached_tokens": snapshot.cache.cached_tokens if snapshot.cache is not None else 0,
                "requests_running": snapshot.requests_running,
                "requests_waiting": snapshot.requests_waiting,
                "dropped_writes": dropped_writes(snapshot),
                "operations": operations(snapshot),
                "generation_tokens": snapshot.counters.generation_tokens,
                "tiers": tier_trend(snapshot),
            }
        )
        recent_rates(state).add(recent_counters(snapshot))
        alerts = {a["name"]: a for a in alerts_now(state, engine, snapshot)}
        for name in alerts.keys() - self._active_alerts:
            log.warning("cache_alert", **alerts[name])
        self._active_alerts = set(alerts)


def alerts_now(state: ServerState, engine: EngineClient, snapshot: EngineSnapshot) -> list[dict[str, Any]]:
    return current_alerts(state.settings.monitoring, engine.settings.scheduler.max_waiting_requests, snapshot)


def build_stats(state: ServerState, engine: EngineClient) -> dict[str, Any]:
    """The ``/v1/cache/stats`` document, from the statistics the engine last published."""
    snapshot = engine.stats()
    monitor: CacheMonitor | None = state.extras.get("cache_monitor")  # type: ignore[assignment]
    points = list(monitor.samples) if monitor is not None else []
    window = monitor.window_seconds if monitor is not None else 0.0
    activity = Activity(operations_per_second(state, snapshot, points), monitor is not None and monitor.alive)
    document = stats_document(snapshot, alerts_now(state, engine, snapshot), points, window, activity)
    rates, counters = recent_rates(state), recent_counters(snapshot)
    document["recent"] = recent_document(*rates.since(counters))
    rates.add(counters)
    document["latency"] = latency_window(state).document()
    return document


def operations_per_second(state: ServerState, snapshot: EngineSnapshot, points: list[dict[str, Any]]) -> float:
    """Cache operations per second over the sampled window (since start-up before the first sample)."""
    now = time.time()
    if points:
        elapsed, done = now - points[0]["timestamp"], operations(snapshot) - points[0]["operations"]
    else:
        elapsed, done = now - state.started_at, operations(snapshot)
    return done / elapsed if elapsed > 0 else 0.0


class ClearRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tiers: Annotated[list[str], Field(max_length=MAX_TIERS)] | str = "all"


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class WarmRequest(BaseModel):
    """``POST /v1/cache/warm``: prompts (or conversations) to prefill, or none to promote the most used prefixes."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1, max_length=MAX_PROMPTS)
    messages: list[Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]] | None = Field(
        None, min_length=1, max_length=MAX_PROMPTS
    )
    cache_salt: str | None = Field(None, max_length=256)
    cache_key: str | None = Field(None, min_length=1, max_length=256)  # name and pin the (single) warmed prompt
    limit_blocks: int | None = Field(None, gt=0)  # no prompts: blocks promoted at most (kv_cache.warm_frequent_blocks)


@get("/v1/cache/stats", sync_to_thread=False)
def cache_stats(request: Request) -> dict[str, Any]:
    """The global document for an admin key (or anyone with ``[auth] public_stats``, or without API
    keys); a tenant's own figures for any other key."""
    engine = ready_engine(request)
    state = state_of(request)
    caller = caller_of(request.scope)
    if caller.admin or state.settings.auth.public_stats:
        return build_stats(state, engine)
    return usage_table(state).document(caller.tenant)


def _requested_tiers(tiers: list[str] | str, known: tuple[str, ...]) -> list[str]:
    if isinstance(tiers, str):
        tiers = [tiers]
    unknown = [tier for tier in tiers if tier not in (*known, "all")]
    if unknown or not tiers:
        got = ", ".join(repr(t) for t in unknown) if unknown else "an empty list"
        names = ", ".join(known) if known else "(no cache tiers: prefix caching is off)"
        message = f"tiers: got {got}; allowed: a list of {names}, or \"all\""
        raise APIError(400, message, param="tiers", code="invalid_value")
    return ["all"] if "all" in tiers else list(dict.fromkeys(tiers))


@post("/v1/cache/clear", opt={"admin": True}, status_code=200)
async def cache_clear(request: Request, data: JSONBody[ClearRequest | None] = None) -> dict[str, Any]:
    """Drop cached prefixes from every tier (``"all"``) or the ``tiers`` named; answers the entries removed per tier.
    Clearing every tier also releases every named prefix (``cache_key``: its pins, and its entry in
    ``/v1/cache/keys``), counted in ``released_keys``; clearing some tiers keeps the keys, whose pinned blocks stay
    where they are (``kept_pinned_keys`` says how many). Admin key."""
    engine = ready_engine(request)
    known = engine.info.tier_names
    tiers = _requested_tiers((data or ClearRequest()).tiers, known)
    everything = "all" in tiers or set(tiers) >= set(known)

    def clear() -> tuple[dict[str, int], int, int]:
        released = 0
        if everything:  # a pin outlives any clear: the keys go first, so their blocks go with the rest
            for key in engine.list_cache_keys():
                released += int(engine.delete_cache_key(key.namespace, key.name))
        cleared: dict[str, int] = {}
        for tier in tiers:
            for name in known if tier == "all" else (tier,):
                cleared.setdefault(name, 0)
            cleared.update(engine.clear_cache(tier))
        return cleared, released, len(engine.list_cache_keys())

    cleared, released, kept = await asyncio.to_thread(clear)
    log.info("cache_cleared", tiers=tiers, cleared=cleared, released_keys=released, kept_pinned_keys=kept)
    return {"cleared": cleared, "released_keys": released, "kept_pinned_keys": kept}


@post("/v1/cache/offload", opt={"admin": True}, status_code=200)
async def cache_offload(request: Request) -> dict[str, Any]:
    """Free the live pool but keep its idle cached prefixes, moved to L2 (or L3)."""
    engine = ready_engine(request)
    moved = await asyncio.to_thread(engine.offload_cache)
    log.info("cache_offloaded", blocks=moved)
    return {"offloaded_blocks": moved}


@post("/v1/cache/flush", opt={"admin": True}, status_code=200)
async def cache_flush(request: Request) -> dict[str, Any]:
    """Answer once every queued tier write (write-through, demotions) is stored; the engine keeps stepping."""
    engine = ready_engine(request)
    started = time.perf_counter()
    await asyncio.to_thread(engine.flush_cache)
    seconds = time.perf_counter() - started
    log.info("cache_flushed", seconds=round(seconds, 3))
    return {"flushed": True, "seconds": seconds}


@post("/v1/cache/warm", opt={"admin": True}, status_code=200)
async def cache_warm(request: Request, data: JSONBody[WarmRequest | None] = None) -> dict[str, Any]:
    """Prefill the prompts given; with none, promote the most used cached prefixes into the faster tiers."""
    engine = ready_engine(request)
    data = data or WarmRequest()
    if data.prompts is None and data.messages is None:
        return await warm_frequent(engine, data)
    if data.limit_blocks is not None:
        message = "limit_blocks: bounds a warm of the most used prefixes; send it without prompts or messages"
        raise APIError(400, message, param="limit_blocks", code="invalid_value")
    conversations = [[m.model_dump() for m in conversation] for conversation in data.messages or []]
    prompts: list[Any] = list(data.prompts or [])
    if data.cache_key is not None and len(prompts) + len(conversations) != 1:
        message = "cache_key: names one prefix; give exactly one prompt (or one conversation) with it"
        raise APIError(400, message, param="cache_key", code="invalid_value")
    batch = engine.settings.scheduler.max_num_seqs  # in batches, so a long list never fills the waiting queue
    scope = cache_scope(caller_of(request.scope).tenant, data.cache_salt)
    named = {"cache_key": data.cache_key, "cache_namespace": scope or ""} if data.cache_key else {}

    def warm() -> WarmedPrompts:
        # chat templates and tokenisation happen here, off the event loop
        items = [engine.encode_prompt(p) for p in prompts]
        items += [engine.encode_prompt(None, conversation) for conversation in conversations]
        done = WarmedPrompts(0)
        for i in range(0, len(items), batch):
            done = done.plus(engine.warm(items[i : i + batch], cache_salt=scope, **named))
        return done

    done = await asyncio.to_thread(warm)
    count = len(prompts) + len(conversations)
    log.info("cache_warmed", prompts=count, tokens=done.tokens, writes=done.writes)
    blocks = done.tokens // engine.info.block_size
    return {"source": "prompts", "warmed": count, "tokens": done.tokens, "blocks": blocks, "writes": done.writes}


async def warm_frequent(engine: EngineClient, data: WarmRequest) -> dict[str, Any]:
    """The spec's "frequent patterns": the most used prefixes (access counts kept with the tier
    indexes, so they survive a restart) move from L3/L2 into the faster tiers."""
    if data.cache_key is not None:
        message = "cache_key: names one warmed prompt; give exactly one prompt (or one conversation) with it"
        raise APIError(400, message, param="cache_key", code="invalid_value")
    limit = data.limit_blocks or engine.settings.kv_cache.warm_frequent_blocks
    report = await asyncio.to_thread(engine.warm_frequent, limit)  # the same default, named in the response
    blocks = sum(report.blocks.values())
    log.info("cache_warmed_frequent", prefixes=report.prefixes, blocks=report.blocks, skipped=report.skipped)
    return {
        "source": "frequent",
        "warmed": report.prefixes,
        "tokens": report.tokens,
        "blocks": blocks,
        "blocks_by_tier": report.blocks,
        "skipped": report.skipped,
        "limit_blocks": limit,
    }


MAX_TOP_PREFIXES = 100


@get("/v1/cache/prefixes", opt={"admin": True})
async def cache_prefixes(request: Request, limit: FromQuery[int] = 10) -> dict[str, Any]:
    """The cached prefixes used most, every tier's uses counted, best first (``?limit=``, 1 to 100);
    a prefix that a named prefix (``cache_key``) covers carries its name. Walks the whole index."""
    if not 1 <= limit <= MAX_TOP_PREFIXES:
        message = f"limit: got {limit}; allowed: 1 to {MAX_TOP_PREFIXES}"
        raise APIError(400, message, param="limit", code="invalid_value")
    engine = ready_engine(request)
    top, named = await asyncio.gather(
        asyncio.to_thread(engine.top_prefixes, limit), asyncio.to_thread(engine.list_cache_keys)
    )
    names = {block.hex(): entry for entry in named for block in entry.block_hashes}
    block_size = engine.info.block_size
    data = []
    for prefix in top:
        entry = names.get(prefix.key)
        data.append({
            "object": "cache_prefix",
            "key": prefix.key,
            "hits": prefix.hits,
            "blocks": prefix.blocks,
            "tokens": prefix.blocks * block_size,
            "tiers": list(prefix.tiers),
            "cache_key": entry.name if entry is not None else None,
            "tenant": (split_scope(entry.namespace)[0] or None) if entry is not None else None,
        })  # fmt: skip
    return {"object": "list", "data": data}


def key_document(entry: NamedPrefix) -> dict[str, Any]:
    """One named prefix as ``GET /v1/cache/keys`` lists it."""
    tenant, cache_salt = split_scope(entry.namespace)
    return {
        "object": "cache_key",
        "id": entry.name,
        "tenant": tenant or None,
        "cache_salt": cache_salt,
        "prefix_tokens": entry.prefix_tokens,
        "blocks": len(entry.block_hashes),
        "pinned_bytes": entry.pinned_bytes,
        "tiers": {"complete": entry.tiers.complete, "blocks": entry.tiers.blocks},
        "hits": entry.hits,
        "requests": entry.requests,
        "created": round(entry.created, 3),
        "last_used": round(entry.last_used, 3),
        "expires_at": round(entry.expires_at, 3) if entry.expires_at is not None else None,
    }


def tenant_asked(caller: Caller, tenant: str | None) -> str | None:
    """The tenant whose keys a caller may read or delete: its own, or with an admin key any (``None``: all)."""
    if caller.admin:
        return tenant
    if tenant is not None and tenant != caller.tenant:
        raise APIError(403, "tenant: only an admin key may read or delete another tenant's cache keys",
                       param="tenant", code="admin_key_required")  # fmt: skip
    return caller.tenant


@get("/v1/cache/keys")
async def cache_keys(
    request: Request, tenant: FromQuery[str | None] = None, cache_salt: FromQuery[str | None] = None
) -> dict[str, Any]:
    """Named prefixes (``cache_key``): the caller's tenant's; an admin key sees every tenant's
    (``?tenant=`` for one). ``?cache_salt=`` keeps one salt's."""
    engine = ready_engine(request)
    wanted = tenant_asked(caller_of(request.scope), tenant)
    entries = await asyncio.to_thread(engine.list_cache_keys)
    documents = [key_document(entry) for entry in entries]
    if wanted is not None:
        documents = [doc for doc in documents if (doc["tenant"] or OPEN_TENANT) == wanted]
    if cache_salt is not None:
        documents = [doc for doc in documents if doc["cache_salt"] == (cache_salt or None)]
    return {"object": "list", "data": documents}


@delete("/v1/cache/keys/{key:str}", status_code=200)
async def cache_key_delete(
    request: Request, key: FromPath[str], tenant: FromQuery[str | None] = None, cache_salt: FromQuery[str | None] = None
) -> dict[str, Any]:
    """Unpin a named prefix of the caller's tenant (an admin key: of ``?tenant=``) and evict its
    blocks from every tier (those no other key pins)."""
    engine = ready_engine(request)
    caller = caller_of(request.scope)
    owner = tenant_asked(caller, tenant)
    namespace = cache_scope(owner if owner is not None else caller.tenant, cache_salt) or ""
    if not await asyncio.to_thread(engine.delete_cache_key, namespace, key):
        where = f" with cache_salt {cache_salt!r}" if cache_salt else ""
        raise APIError(404, f"cache key {key!r}{where} is not registered", param="key", code="not_found")
    log.info("cache_key_deleted", cache_key=key, tenant=owner)
    return {"object": "cache_key", "id": key, "deleted": True}


def setup(state: ServerState) -> None:
    if state.settings.monitoring.enabled:
        monitor = CacheMonitor(state)
        state.extras["cache_monitor"] = monitor
        monitor.start()


def teardown(state: ServerState) -> None:
    monitor: CacheMonitor | None = state.extras.pop("cache_monitor", None)  # type: ignore[assignment]
    if monitor is not None:
        monitor.stop()


ROUTES = [cache_stats, cache_clear, cache_offload, cache_flush, cache_warm, cache_prefixes, cache_keys, cache_key_delete]
