"""Prometheus metrics from the engine's published statistics (``tierserve_*``; counters end in ``_total``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tierserve.cache.figures import FigureGroup, metric_name

if TYPE_CHECKING:
    from tierserve.engine.stats import EngineSnapshot

TIER_COUNTERS = {
    "hits": "Cache lookups that found the block",
    "misses": "Cache lookups that did not",
    "evictions": "Entries evicted to make room",
    "expirations": "Entries dropped by ttl_seconds",
    "corrupt": "Entries found corrupt, truncated or foreign, and deleted",
    "corrupt_indexes": "Indexes found corrupt at start, moved aside and rebuilt from the value files",
    "dropped_writes": "Writes dropped because the write queue was full",
    "write_errors": "Writes that failed (disk full, read-only, a remote server out of memory, ...)",
    "connection_errors": "Commands to a remote tier's server that failed to connect or timed out",
    "errors": "Calls into the tier's plugin that raised (contained: a miss or a dropped write, then a back-off)",
    "get_seconds": "Time spent reading entries",
    "put_seconds": "Time spent storing entries",
}


def plugin_families(groups: list[FigureGroup]) -> Iterator:
    """Components' own figures (``cache.figures``): one family per figure, a sample per instance."""
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for group in groups:
        for name, figure in group.values.items():
            family_name = metric_name(group, name)
            family = families.get(family_name)
            if family is None:
                kind = CounterMetricFamily if figure.kind == "counter" else GaugeMetricFamily
                family = families[family_name] = kind(family_name, figure.description, labels=["plugin", "instance"])
            family.add_metric([group.plugin, group.instance], figure.value)
    yield from families.values()


class EngineCollector(Collector):
    """Turns the engine's latest published ``EngineSnapshot`` into metric families on every scrape.

    Args:
        read: returns the snapshot to report (``EngineClient.stats``); a scrape never waits for a step.
    """

    def __init__(self, read: Callable[[], EngineSnapshot]) -> None:
        self.read = read

    def collect(self) -> Iterator:
        snapshot = self.read()
        cache = snapshot.cache
        tiers = cache.tiers if cache is not None else {}
        for field, help_text in TIER_COUNTERS.items():
            family = CounterMetricFamily(f"tierserve_cache_{field}", help_text, labels=["tier"])
            for name, tier in tiers.items():
                family.add_metric([name], getattr(tier, field))
            yield family
        for field, help_text in (("entries", "Entries held"), ("bytes", "Bytes held (as stored)")):
            family = GaugeMetricFamily(f"tierserve_cache_{field}", help_text, labels=["tier"])
            for name, tier in tiers.items():
                family.add_metric([name], getattr(tier, field))
            yield family
        for field, help_text in (
            ("capacity_entries", "Entries a tier holds at most (bounded tiers only)"),
            ("capacity_bytes", "Bytes a tier holds at most (bounded tiers only)"),
        ):
            family = GaugeMetricFamily(f"tierserve_cache_{field}", help_text, labels=["tier"])
            for name, tier in tiers.items():
                if getattr(tier, field) is not None:
                    family.add_metric([name], getattr(tier, field))
            yield family
        ratio = GaugeMetricFamily("tierserve_cache_compression_ratio", "Raw bytes / stored bytes", labels=["tier"])
        for name, tier in tiers.items():
            ratio.add_metric([name], tier.compression_ratio)
        yield ratio
        speculation = snapshot.speculation
        for name, help_text in (
            ("proposed", "Draft tokens proposed"),
            ("accepted", "Draft tokens accepted"),
            ("verifications", "Target forwards that verified drafts"),
            ("early_stops", "Requests that stopped inside an accepted draft run"),
        ):
            yield CounterMetricFamily(f"tierserve_spec_{name}", help_text, value=getattr(speculation, name))
        yield GaugeMetricFamily(
            "tierserve_spec_acceptance_rate", "Accepted / proposed draft tokens", value=speculation.acceptance_rate
        )
        if snapshot.profiling is not None:  # [monitoring] detailed_profiling
            phases = HistogramMetricFamily(
                "tierserve_step_phase_seconds",
                "Engine step time by phase: schedule, cache_lookup, forward, sample, detokenize",
                labels=["phase"],
            )
            for phase, stats in snapshot.profiling.phases().items():
                phases.add_metric([phase], stats.cumulative(), sum_value=stats.seconds)
            yield phases
        yield from plugin_families(snapshot.plugin_figures)
        if cache is None:
            return
        for name, values, help_text in (
            ("promotions", cache.promotions, "Blocks loaded into L1 from a lower tier"),
            ("demotions", cache.demotions, "Blocks written down to a lower tier on eviction"),
        ):
            family = CounterMetricFamily(f"tierserve_cache_{name}", help_text, labels=["tier"])
            for tier, value in values.items():
                family.add_metric([tier], value)
            yield family
        for name, help_text in (
            ("lookups", "Prefix lookups"),
            ("prefix_matches", "Lookups that reused at least one block"),
            ("cached_tokens", "Prompt tokens served from the cache"),
            ("partial_block_tokens", "Of those, tokens copied from the start of a cached block a prompt shares in part"),
            ("computed_tokens", "Tokens whose KV was computed and published"),
            ("write_through", "Blocks written through to a persistent tier"),
        ):
            yield CounterMetricFamily(f"tierserve_cache_{name}", help_text, value=getattr(cache, name))
        index = cache.index
        yield GaugeMetricFamily("tierserve_cache_active_prefixes", "Cached prefixes (index leaves)", value=index.active_prefixes)
        yield GaugeMetricFamily("tierserve_cache_avg_prefix_tokens", "Average cached prefix length", value=index.avg_prefix_tokens)
        yield GaugeMetricFamily("tierserve_kv_blocks", "Blocks in the L1 pool", value=snapshot.kv_blocks_total)
        yield GaugeMetricFamily("tierserve_kv_usage", "Fraction of L1 blocks in use", value=snapshot.kv_usage)
