"""The ``/v1/cache/stats`` document and its alerts, built from one typed ``EngineSnapshot``.

The snapshot is what the engine core last published: building this never
waits for a step. Tier names come from the snapshot (from settings), so a
plugin tier shows up like the built-in ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierserve.core.config import MonitoringSettings
    from tierserve.core.engine import EngineSnapshot


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
    lookups = total_hits + misses
    summary: dict[str, Any] = {
        "hits": total_hits,
        "misses": misses,
        "hit_rate": round(total_hits / lookups, 4) if lookups else 0.0,
        "memory_bytes": sum(t.bytes for t in tiers.values() if t.medium == "memory"),
        "disk_bytes": sum(t.bytes for t in tiers.values() if t.medium == "disk"),
        "evictions": sum(t.evictions for t in tiers.values()),
    }
    for name in tiers:
        summary[f"{name}_hits"] = hits[name]
    summary["promotions"] = dict(cache.promotions) if cache is not None else {}
    summary["demotions"] = dict(cache.demotions) if cache is not None else {}
    summary["tiers"] = {name: tier.as_dict() for name, tier in tiers.items()}
    return summary


def dropped_writes(snapshot: EngineSnapshot) -> int:
    cache = snapshot.cache
    return sum(t.dropped_writes for t in cache.tiers.values()) if cache is not None else 0


def current_alerts(monitoring: MonitoringSettings, max_waiting: int, snapshot: EngineSnapshot) -> list[dict[str, Any]]:
    """Thresholds of ``[monitoring]`` that the engine is past, as of the snapshot."""
    kv = kv_cache_summary(snapshot)
    alerts: list[dict[str, Any]] = []

    def alert(name: str, message: str, value: float, threshold: float) -> None:
        alerts.append({"name": name, "message": message, "value": value, "threshold": threshold})

    threshold = monitoring.alert_hit_rate_below
    if threshold is not None and kv["hits"] + kv["misses"] and kv["hit_rate"] < threshold:
        alert("low_hit_rate", f"KV cache block hit rate {kv['hit_rate']:.2%} is below {threshold:.2%}", kv["hit_rate"], threshold)
    threshold = monitoring.alert_memory_bytes_above
    if threshold is not None and kv["memory_bytes"] > threshold:
        message = f"host-memory tiers hold {kv['memory_bytes']} bytes, above {threshold}"
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
    snapshot: EngineSnapshot, alerts: list[dict[str, Any]], trends: list[dict[str, Any]]
) -> dict[str, Any]:
    """The ``/v1/cache/stats`` body."""
    cache = snapshot.cache
    counters = snapshot.counters
    index = cache.index if cache is not None else None
    cached_tokens = cache.cached_tokens if cache is not None else 0
    prompt_tokens = counters.prompt_tokens
    return {
        "cache_manager": {
            "kv_cache": kv_cache_summary(snapshot),
            "radix_tree": {
                "cached_blocks": index.cached_blocks if index is not None else 0,
                "active_prefixes": index.active_prefixes if index is not None else 0,
                "avg_prefix_tokens": round(index.avg_prefix_tokens, 2) if index is not None else 0.0,
                "prefix_matches": cache.prefix_matches if cache is not None else 0,
                "lookups": cache.lookups if cache is not None else 0,
            },
            "speculation": snapshot.speculation.as_dict(),
            "sliding_window": snapshot.sliding_window.as_dict(),
        },
        "overall": {
            "cached_tokens": cached_tokens,
            "computed_tokens": cache.computed_tokens if cache is not None else 0,
            "prompt_tokens": prompt_tokens,
            "generation_tokens": counters.generation_tokens,
            "token_hit_rate": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
            "requests_running": snapshot.requests_running,
            "requests_waiting": snapshot.requests_waiting,
        },
        "alerts": alerts,
        "trends": trends,
    }
