"""Typed cache statistics: per-tier counters, the store's counters, per-request match results and snapshots.

Every figure is kept as it happens, so a snapshot costs O(number of tiers)
however much is cached: it runs on the engine's step thread for every
``/v1/cache/stats`` request and Prometheus scrape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class TierStats:
    """Counters of one tier; read by ``/v1/cache/stats`` and Prometheus."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    expirations: int = 0
    corrupt: int = 0
    corrupt_indexes: int = 0  # indexes found corrupt at start, moved aside and rebuilt (disk tiers)
    dropped_writes: int = 0
    write_errors: int = 0
    connection_errors: int = 0  # a remote tier's server unreachable, timed out or refusing (remote tiers)
    errors: int = 0  # calls into the tier's plugin that raised (cache.guarded_tier: contained, backed off)
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    stored_bytes: int = 0  # bytes as stored (compressed for disk)
    raw_bytes: int = 0  # bytes of the tensors they hold

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass(slots=True)
class StoreStats:
    """Counters of the whole store (per-tier counters live on each tier).

    ``promotions`` and ``demotions`` are keyed by the lower tiers' names:
    blocks loaded into L1 from that tier, and blocks written down into it.
    """

    promotions: dict[str, int] = field(default_factory=dict)
    demotions: dict[str, int] = field(default_factory=dict)
    lookups: int = 0
    prefix_matches: int = 0
    write_through: int = 0
    cached_tokens: int = 0
    partial_block_tokens: int = 0  # of cached_tokens: copied from the start of a block the prompt shares in part
    computed_tokens: int = 0
    token_mismatches: int = 0
    lookup_seconds: float = 0.0
    loads: int = 0  # prompts whose prefix below L1 was read off the step (``TieredStore.start_load``)
    load_timeouts: int = 0  # of those, read too late: the prompt computed those tokens instead
    load_failures: int = 0  # of those, failed (an error in a tier): computed instead

    @classmethod
    def for_tiers(cls, lower_tiers: Sequence[str]) -> StoreStats:
        """Zeroed counters for a store whose tiers below L1 are ``lower_tiers``."""
        return cls(promotions=dict.fromkeys(lower_tiers, 0), demotions=dict.fromkeys(lower_tiers, 0))


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What one prefix lookup found, for per-request cache accounting.

    Attributes:
        lookup_blocks: full prompt blocks the lookup could use (a hit never
            covers the prompt's last token, whose logits are needed).
        hits: blocks served per tier name, ``"l1"`` first, one entry for every
            tier of the store (0 where that tier served nothing). Blocks count
            where they were found: a lower-tier hit was promoted into L1.
        seconds: time the lookup took, promotions included.
    """

    lookup_blocks: int
    hits: dict[str, int]
    seconds: float

    @property
    def cached_blocks(self) -> int:
        """Blocks the sequence starts with (the hits of every tier)."""
        return sum(self.hits.values())


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """One tier's figures at a moment; ``blocks_total``/``blocks_free`` only for L1 (the block pool)."""

    name: str
    hits: int
    misses: int
    hit_rate: float
    entries: int
    bytes: int
    evictions: int
    expirations: int
    corrupt: int
    dropped_writes: int
    write_errors: int
    get_seconds: float
    put_seconds: float
    compression_ratio: float
    corrupt_indexes: int = 0
    connection_errors: int = 0
    errors: int = 0
    blocks_total: int | None = None
    blocks_free: int | None = None
    medium: str = "memory"  # where the tier keeps its data: "arena" (L1), "memory", "disk", "remote"
    capacity_entries: int | None = None  # the tier's bounds (None: unbounded or unknown)
    capacity_bytes: int | None = None

    @classmethod
    def of(
        cls,
        name: str,
        stats: TierStats,
        entries: int,
        stored: int,
        blocks_total: int | None = None,
        blocks_free: int | None = None,
        medium: str = "memory",
        capacity: tuple[int | None, int | None] = (None, None),
    ) -> TierSnapshot:
        """The snapshot of a tier holding ``entries`` entries in ``stored`` bytes, from its counters;
        ``capacity``: its bounds, ``(entries, bytes)``."""
        return cls(
            name=name,
            hits=stats.hits,
            misses=stats.misses,
            hit_rate=stats.hit_rate,
            entries=entries,
            bytes=stored,
            evictions=stats.evictions,
            expirations=stats.expirations,
            corrupt=stats.corrupt,
            dropped_writes=stats.dropped_writes,
            write_errors=stats.write_errors,
            get_seconds=stats.get_seconds,
            put_seconds=stats.put_seconds,
            compression_ratio=stats.compression_ratio,
            corrupt_indexes=stats.corrupt_indexes,
            connection_errors=stats.connection_errors,
            errors=stats.errors,
            blocks_total=blocks_total,
            blocks_free=blocks_free,
            medium=medium,
            capacity_entries=capacity[0],
            capacity_bytes=capacity[1],
        )

    def as_dict(self) -> dict[str, object]:
        """Plain data (rates and times rounded), without the name: the caller keys it."""
        data: dict[str, object] = {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hit_rate, 4),
            "entries": self.entries,
            "bytes": self.bytes,
            "evictions": self.evictions,
            "expirations": self.expirations,
            "corrupt": self.corrupt,
            "corrupt_indexes": self.corrupt_indexes,
            "dropped_writes": self.dropped_writes,
            "write_errors": self.write_errors,
            "connection_errors": self.connection_errors,
            "errors": self.errors,
            "get_seconds": round(self.get_seconds, 6),
            "put_seconds": round(self.put_seconds, 6),
            "compression_ratio": round(self.compression_ratio, 3),
            "medium": self.medium,
            "capacity_entries": self.capacity_entries,
            "capacity_bytes": self.capacity_bytes,
        }
        if self.blocks_total is not None:
            data["blocks_total"] = self.blocks_total
        if self.blocks_free is not None:
            data["blocks_free"] = self.blocks_free
        return data


@dataclass(frozen=True, slots=True)
class IndexStats:
    """The shape of the cached prefixes across all tiers.

    Attributes:
        cached_blocks: blocks some tier holds.
        active_prefixes: cached blocks no cached block extends (leaves).
        avg_prefix_tokens: mean length in tokens of those prefixes, each as
            long as it was when its last block was indexed (``BlockHashIndex``).
    """

    cached_blocks: int
    active_prefixes: int
    avg_prefix_tokens: float

    def as_dict(self) -> dict[str, object]:
        return {
            "cached_blocks": self.cached_blocks,
            "active_prefixes": self.active_prefixes,
            "avg_prefix_tokens": self.avg_prefix_tokens,
        }


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """Everything the store counts, at a moment: every tier (``"l1"`` first, then the lower
    tiers in order), the index, and the store's counters (see ``StoreStats``)."""

    tiers: dict[str, TierSnapshot]
    index: IndexStats
    lookups: int
    prefix_matches: int
    promotions: dict[str, int]
    demotions: dict[str, int]
    write_through: int
    cached_tokens: int
    computed_tokens: int
    token_mismatches: int
    lookup_seconds: float
    partial_block_tokens: int = 0
    loads: int = 0
    load_timeouts: int = 0
    load_failures: int = 0

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON and Prometheus (times rounded to microseconds)."""
        return {
            "tiers": {name: tier.as_dict() for name, tier in self.tiers.items()},
            "index": self.index.as_dict(),
            "lookups": self.lookups,
            "prefix_matches": self.prefix_matches,
            "promotions": dict(self.promotions),
            "demotions": dict(self.demotions),
            "write_through": self.write_through,
            "cached_tokens": self.cached_tokens,
            "partial_block_tokens": self.partial_block_tokens,
            "computed_tokens": self.computed_tokens,
            "token_mismatches": self.token_mismatches,
            "lookup_seconds": round(self.lookup_seconds, 6),
            "loads": self.loads,
            "load_timeouts": self.load_timeouts,
            "load_failures": self.load_failures,
        }
