"""Prometheus metrics read from the engine at scrape time (``tierserve_*``; counters end in ``_total``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tierserve.core.engine import Engine

TIER_COUNTERS = {
    "hits": "Cache lookups that found the block",
    "misses": "Cache lookups that did not",
    "evictions": "Entries evicted to make room",
    "expirations": "Entries dropped by ttl_seconds",
    "corrupt": "Entries found corrupt, truncated or foreign, and deleted",
    "dropped_writes": "Writes dropped because the write queue was full",
    "write_errors": "Writes that failed (disk full, read-only, ...)",
    "get_seconds": "Time spent reading entries",
    "put_seconds": "Time spent storing entries",
}


class EngineCollector(Collector):
    """Turns ``engine.cache_stats()`` into metric families on every scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator:
        stats = self.engine.cache_stats()
        tiers = stats.get("tiers", {})
        for field, help_text in TIER_COUNTERS.items():
            family = CounterMetricFamily(f"tierserve_cache_{field}", help_text, labels=["tier"])
            for tier, values in tiers.items():
                family.add_metric([tier], values[field])
            yield family
        for field, help_text in (("entries", "Entries held"), ("bytes", "Bytes held (as stored)")):
            family = GaugeMetricFamily(f"tierserve_cache_{field}", help_text, labels=["tier"])
            for tier, values in tiers.items():
                family.add_metric([tier], values[field])
            yield family
        ratio = GaugeMetricFamily("tierserve_cache_compression_ratio", "Raw bytes / stored bytes", labels=["tier"])
        for tier, values in tiers.items():
            ratio.add_metric([tier], values["compression_ratio"])
        yield ratio
        speculation = stats.get("speculation") or {}
        for name, help_text in (
            ("proposed", "Draft tokens proposed"),
            ("accepted", "Draft tokens accepted"),
            ("verifications", "Target forwards that verified drafts"),
            ("early_stops", "Requests that stopped inside an accepted draft run"),
        ):
            yield CounterMetricFamily(f"tierserve_spec_{name}", help_text, value=speculation.get(name, 0))
        yield GaugeMetricFamily(
            "tierserve_spec_acceptance_rate", "Accepted / proposed draft tokens", value=speculation.get("acceptance_rate", 0.0)
        )
        if not stats.get("index"):
            return
        for name, key, help_text in (
            ("promotions", "promotions", "Blocks loaded into L1 from a lower tier"),
            ("demotions", "demotions", "Blocks written down to a lower tier on eviction"),
        ):
            family = CounterMetricFamily(f"tierserve_cache_{name}", help_text, labels=["tier"])
            for tier, value in stats[key].items():
                family.add_metric([tier], value)
            yield family
        for name, help_text in (
            ("lookups", "Prefix lookups"),
            ("prefix_matches", "Lookups that reused at least one block"),
            ("cached_tokens", "Prompt tokens served from the cache"),
            ("computed_tokens", "Tokens whose KV was computed and published"),
            ("write_through", "Blocks written through to L3"),
        ):
            yield CounterMetricFamily(f"tierserve_cache_{name}", help_text, value=stats[name])
        index = stats["index"]
        yield GaugeMetricFamily("tierserve_cache_active_prefixes", "Cached prefixes (radix leaves)", value=index["active_prefixes"])
        yield GaugeMetricFamily("tierserve_cache_avg_prefix_tokens", "Average cached prefix length", value=index["avg_prefix_tokens"])
        l1 = tiers["l1"]
        yield GaugeMetricFamily("tierserve_kv_blocks", "Blocks in the L1 pool", value=l1["blocks_total"])
        yield GaugeMetricFamily(
            "tierserve_kv_usage", "Fraction of L1 blocks in use", value=1 - l1["blocks_free"] / l1["blocks_total"]
        )
