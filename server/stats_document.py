"""The ``/v1/cache/stats`` document and its alerts, built from one typed ``EngineSnapshot``.

The snapshot is what the engine core last published: building this never
waits for a step. Every field the serving spec shows is here with the spec's
meaning and unit (rates in percent); tierserve's own detail sits beside them
under keys that do not clash (``tiers``, ``trend_points``, ...). Each field is
described in the README (the stats table). Tier names come from settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierserve.cache.figures import figures_document

if TYPE_CHECKING:
    from tierserve.settings.config import MonitoringSettings
    from tierserve.engine import EngineSnapshot

SPEC_TIER_NAMES = ("l1", "l2", "l3")  # the spec always shows these three hit counts


def percent(part: float, whole: float) -> float:
    return round(100 * part / whole, 2) if whole else 0.0


def operations(snapshot: EngineSnapshot) -> int:
    """Cache operations so far: prefix lookups, blocks published, promotions and demotions."""
    cache = snapshot.cache
    if cache is None:
        return 0
    published = cache.computed_tokens // max(1, snapshot.kv_block_size)
    return cache.lookups + published + sum(cache.promotions.values()) + sum(cache.demotions.values())


@dataclass(frozen=True, slots=True)
class Activity:
    """What the server measured around the snapshot: operations per second, and whether the background work runs."""

    operations_per_second: float
    background_tasks_active: bool


def kv_cache_summary(snapshot: EngineSnapshot) -> dict[str, Any]:
    """Block-level totals over the tiers; each prompt block a lookup could use counts once.

    A block missed in L1 but found in a lower tier is a hit of that tier, so
    ``misses`` are L1 misses less the lower tiers' hits.
    """
    cache = snapshot.cache
    tiers = cache.tiers if cache is not None else {}
    hits = {name: tier.hits for name, tier in tiers.items()}
    l1 = tiers.get("l1")
    lower_hits = sum(count for name, count in hits.items() if name != "l1")
    misses = max(0, (l1.misses if l1 is not None else 0) - lower_hits)
    total_hits = sum(hits.values())
    memory_tiers = sum(t.bytes for t in tiers.values() if t.medium == "memory")
    memory_bounds = [t.capacity_bytes for t in tiers.values() if t.medium == "memory"]
    l1_pool = snapshot.kv_blocks_total * snapshot.kv_block_bytes if cache is not None else 0
    summary: dict[str, Any] = {
        "hits": total_hits,
        "misses": misses,
        "hit_rate": percent(total_hits, total_hits + misses),
        "memory_bytes": (snapshot.l1_bytes if cache is not None else 0) + memory_tiers,
        # what memory_bytes may reach: L1's pool (l1_capacity blocks) plus each memory tier's max_bytes (the
        # flat max_memory_bytes is L2's); None where a memory tier has no byte bound
        "memory_limit_bytes": None if None in memory_bounds else l1_pool + sum(memory_bounds),
        "disk_bytes": sum(t.bytes for t in tiers.values() if t.medium == "disk"),
        "remote_bytes": sum(t.bytes for t in tiers.values() if t.medium == "remote"),
        "evictions": sum(t.evictions for t in tiers.values()),
    }
    for name in (*SPEC_TIER_NAMES, *tiers):
        summary[f"{name}_hits"] = hits.get(name, 0)
    summary["promotions"] = dict(cache.promotions) if cache is not None else {}
    summary["demotions"] = dict(cache.demotions) if cache is not None else {}
    # prefix reads on the store's loader thread, and those given up (computed instead)
    for name in ("loads", "load_timeouts", "load_failures"):
        summary[name] = getattr(cache, name) if cache is not None else 0
    summary["tiers"] = {name: tier.as_dict() for name, tier in tiers.items()}
    if "l1" in summary["tiers"]:
        summary["tiers"]["l1"].update(l1_occupancy(snapshot))
    summary["cache_keys"] = {"count": snapshot.cache_keys, "pinned_bytes": snapshot.cache_keys_pinned_bytes}
    return summary


def l1_occupancy(snapshot: EngineSnapshot) -> dict[str, int]:
    """L1's blocks by state: in use by running requests, empty (holding nothing); the rest are cached and idle."""
    return {
        "blocks_in_use": snapshot.kv_blocks_total - snapshot.kv_blocks_free,
        "blocks_empty": snapshot.kv_blocks_empty,
    }


def tier_trend(snapshot: EngineSnapshot) -> dict[str, dict[str, Any]]:
    """Each tier's cumulative figures at a trend sample: hits, misses, hit rate (fraction), evictions, entries."""
    cache = snapshot.cache
    if cache is None:
        return {}
    return {
        name: {"hits": t.hits, "misses": t.misses, "hit_rate": round(t.hit_rate, 4), "evictions": t.evictions,
               "entries": t.entries}
        for name, t in cache.tiers.items()
    }  # fmt: skip


def recent_counters(snapshot: EngineSnapshot) -> dict[str, float]:
    """The cumulative counters whose recent rates ``/v1/cache/stats`` reports (``server.recent``)."""
    counters = snapshot.counters
    values: dict[str, float] = {
        "generation_tokens": counters.generation_tokens,
        "prompt_tokens": counters.prompt_tokens,
        "requests_finished": counters.requests_finished,
    }
    for name, tier in (snapshot.cache.tiers.items() if snapshot.cache is not None else ()):
        values[f"evictions.{name}"] = tier.evictions
    return values


def recent_document(seconds: float, increases: dict[str, float]) -> dict[str, Any]:
    """The ``recent`` section: rates over ``seconds``, and each tier's evictions in that time."""

    def rate(name: str) -> float:
        return round(increases.get(name, 0) / seconds, 2) if seconds > 0 else 0.0

    return {
        "seconds": round(seconds, 3),
        "generation_tokens_per_second": rate("generation_tokens"),
        "prompt_tokens_per_second": rate("prompt_tokens"),
        "requests_per_second": rate("requests_finished"),
        "evictions": {
            name.removeprefix("evictions."): int(value) for name, value in increases.items() if name.startswith("evictions.")
        },
    }


def radix_tree(snapshot: EngineSnapshot) -> dict[str, Any]:
    """Prefix sharing: matches, blocks shared with running sequences, KV not recomputed, and the index's shape."""
    cache = snapshot.cache
    if cache is None:
        return {"prefix_matches": 0, "sharing_hits": 0, "memory_saved": 0, "active_prefixes": 0,
                "avg_prefix_length": 0.0, "cached_blocks": 0, "lookups": 0}  # fmt: skip
    index = cache.index
    bytes_per_token = snapshot.kv_block_bytes / max(1, snapshot.kv_block_size)
    return {
        "prefix_matches": cache.prefix_matches,
        "sharing_hits": snapshot.sharing_hits,
        "memory_saved": int(cache.cached_tokens * bytes_per_token),  # KV bytes reused instead of recomputed
        "active_prefixes": index.active_prefixes,
        "avg_prefix_length": round(index.avg_prefix_tokens, 2),
        "cached_blocks": index.cached_blocks,
        "lookups": cache.lookups,
    }


def speculation(snapshot: EngineSnapshot) -> dict[str, Any]:
    """Drafts verified and beam searches (the spec's speculative decoding is both): ``hits``/``misses`` are
    draft tokens; ``tokens_generated`` and ``early_stops`` count both, and are split out beside them."""
    spec = snapshot.speculation
    counters = snapshot.counters
    rejected = spec.proposed - spec.accepted
    drafts = spec.as_dict()
    drafts["draft_early_stops"] = drafts.pop("early_stops")
    return {
        "hits": spec.accepted,
        "misses": rejected,
        "hit_rate": percent(spec.accepted, spec.proposed),
        "tokens_generated": spec.emitted + counters.beam_tokens_generated,
        "early_stops": spec.early_stops + counters.beam_early_stops,
        **drafts,
        "beam_searches": counters.beam_searches,
        "beams": counters.beams,
        "beam_tokens_generated": counters.beam_tokens_generated,
        "beam_early_stops": counters.beam_early_stops,
    }


def sliding_window(snapshot: EngineSnapshot) -> dict[str, Any]:
    window = snapshot.sliding_window
    return {
        "hits": window.cache_hits,
        "misses": window.cache_misses,
        "hit_rate": percent(window.cache_hits, window.cache_hits + window.cache_misses),
        "memory_bytes": window.memory_bytes,
        "evictions": window.blocks_released,
        "utilization": window.utilization,
        "enabled": window.enabled,
        "windows_slid": window.windows_slid,
        "tokens_dropped": window.tokens_dropped,
        "blocks_released": window.blocks_released,
        "blocks_in_use": window.blocks_in_use,
    }


def efficiency_score(snapshot: EngineSnapshot) -> float:
    """Percent of all tokens the engine produced or read that it did not compute one position at a time:
    prompt tokens served from the cache plus draft tokens accepted, over prompt plus generated tokens."""
    counters = snapshot.counters
    cached = snapshot.cache.cached_tokens if snapshot.cache is not None else 0
    return percent(cached + snapshot.speculation.accepted, counters.prompt_tokens + counters.generation_tokens)


def overall(snapshot: EngineSnapshot, activity: Activity) -> dict[str, Any]:
    cache = snapshot.cache
    counters = snapshot.counters
    cached_tokens = cache.cached_tokens if cache is not None else 0
    kv = kv_cache_summary(snapshot)
    lookups = cache.lookups if cache is not None else 0
    return {
        "hit_rate": percent(cached_tokens, counters.prompt_tokens),
        "total_memory_bytes": kv["memory_bytes"] + kv["disk_bytes"] + kv["remote_bytes"],
        "operations_per_second": round(activity.operations_per_second, 2),
        "avg_response_time_us": round(1e6 * cache.lookup_seconds / lookups, 1) if lookups else 0.0,
        "efficiency_score": efficiency_score(snapshot),
        "background_tasks_active": activity.background_tasks_active,
        "cached_tokens": cached_tokens,
        "computed_tokens": cache.computed_tokens if cache is not None else 0,
        "prompt_tokens": counters.prompt_tokens,
        "generation_tokens": counters.generation_tokens,
        "token_hit_rate": round(cached_tokens / counters.prompt_tokens, 4) if counters.prompt_tokens else 0.0,
        "requests_running": snapshot.requests_running,
        "requests_waiting": snapshot.requests_waiting,
    }


def dropped_writes(snapshot: EngineSnapshot) -> int:
    cache = snapshot.cache
    return sum(t.dropped_writes for t in cache.tiers.values()) if cache is not None else 0


def current_alerts(monitoring: MonitoringSettings, max_waiting: int, snapshot: EngineSnapshot) -> list[dict[str, Any]]:
    """Thresholds of ``[monitoring]`` that the engine is past, as of the snapshot (rates in percent)."""
    kv = kv_cache_summary(snapshot)
    alerts: list[dict[str, Any]] = []

    def alert(name: str, message: str, value: float, threshold: float) -> None:
        alerts.append({"name": name, "message": message, "value": value, "threshold": threshold})

    threshold = monitoring.alert_hit_rate_below
    if threshold is not None and kv["hits"] + kv["misses"] and kv["hit_rate"] < 100 * threshold:
        below = round(100 * threshold, 2)
        alert("low_hit_rate", f"KV cache block hit rate {kv['hit_rate']:.2f}% is below {below:.2f}%", kv["hit_rate"], below)
    threshold = monitoring.alert_memory_bytes_above
    if threshold is not None and kv["memory_bytes"] > threshold:
        message = f"the memory tiers (L1 included) hold {kv['memory_bytes']} bytes, above {threshold}"
        alert("high_memory", message, kv["memory_bytes"], threshold)
    threshold = monitoring.alert_dropped_writes_above
    dropped = dropped_writes(snapshot)
    if threshold is not None and dropped > threshold:
        alert(
            "dropped_writes",
            f"{dropped} cache writes were dropped (a tier's write queue was full; raise its write_queue), above {threshold}",
            dropped,
            threshold,
        )
    fraction = monitoring.alert_queue_fraction_above
    if fraction is not None:
        limit = fraction * max_waiting
        waiting = snapshot.requests_waiting
        if waiting > limit:
            alert("queue_full", f"{waiting} requests are waiting, above {fraction:.0%} of max_waiting_requests", waiting, limit)
    return alerts


def stats_document(
    snapshot: EngineSnapshot,
    alerts: list[dict[str, Any]],
    trend_points: list[dict[str, Any]],
    window_seconds: float,
    activity: Activity,
) -> dict[str, Any]:
    """The ``/v1/cache/stats`` body."""
    manager: dict[str, Any] = {
        "kv_cache": kv_cache_summary(snapshot),
        "radix_tree": radix_tree(snapshot),
        "speculation": speculation(snapshot),
        "sliding_window": sliding_window(snapshot),
    }
    if snapshot.profiling is not None:  # [monitoring] detailed_profiling: where the step time goes
        manager["profiling"] = snapshot.profiling.as_dict()
    return {
        "cache_manager": manager,
        # components' own counters and gauges (cache.figures): {plugin: {tier entry or component: {name: value}}}
        "plugin_figures": figures_document(snapshot.plugin_figures),
        "overall": overall(snapshot, activity),
        "alerts": alerts,
        "trends": {"window_seconds": window_seconds, "data_points": len(trend_points)},
        "trend_points": trend_points,
    }
