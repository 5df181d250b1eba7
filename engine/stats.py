"""The engine's statistics as typed records: counters kept as work happens, and the snapshot the core publishes.

The core builds an ``EngineSnapshot`` between steps (every piece is O(1) to
read) and hands it to the client, which keeps the latest; the server, the
Prometheus collector and the monitor read that, never the core's live state,
so a stats request never waits for, or delays, a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tierserve.engine.profiling import PhaseTimings
from tierserve.cache.figures import FigureGroup
from tierserve.core.speculation import SpeculationStats


@dataclass(slots=True)
class EngineCounters:
    """Request and token counters of one engine core."""

    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    beam_searches: int = 0  # completed; they run between steps, a forward at a time
    beams: int = 0  # beam_width summed over the completed searches
    beam_tokens_generated: int = 0  # tokens their beams generated: beam_width per step
    beam_early_stops: int = 0  # of them, those that ended before max_tokens (BeamSearchOutput.stopped_early)
    finish_reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SpeculationSnapshot:
    """Speculative decoding: whether it is configured, and how drafts fared."""

    enabled: bool
    method: str | None
    verifications: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    early_stops: int = 0
    depth: int = 0
    tree_verifications: int = 0
    tree_nodes: int = 0
    errors: int = 0  # speculator calls that raised (those requests decoded on without drafts)

    @classmethod
    def of(cls, enabled: bool, method: str | None, stats: SpeculationStats, early_stops: int) -> SpeculationSnapshot:
        return cls(
            enabled, method, stats.verifications, stats.proposed, stats.accepted, stats.emitted, early_stops,
            stats.depth, stats.tree_verifications, stats.tree_nodes, stats.errors,
        )  # fmt: skip

    @property
    def acceptance_rate(self) -> float:
        return round(self.accepted / self.proposed, 4) if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return round(self.accepted / self.verifications, 4) if self.verifications else 0.0

    @property
    def avg_depth(self) -> float:
        """The mean depth of what one verification checked: k drafts for a linear run, a token tree's deepest
        path (``mean_accepted_length`` is how deep it was accepted)."""
        return round(self.depth / self.verifications, 4) if self.verifications else 0.0

    @property
    def tree_nodes_per_step(self) -> float:
        """Token trees: the mean number of nodes one verification checked."""
        return round(self.tree_nodes / self.tree_verifications, 4) if self.tree_verifications else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "method": self.method,
            "verifications": self.verifications,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "early_stops": self.early_stops,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "tree_verifications": self.tree_verifications,
            "tree_nodes_per_step": self.tree_nodes_per_step,
            "avg_depth": self.avg_depth,
            "errors": self.errors,
        }


@dataclass(frozen=True, slots=True)
class WindowSnapshot:
    """Sliding windows: whether streaming mode is on by default, what windows released, and the
    windowed sequences now: the KV they hold and how full their windows are.

    ``cache_hits``/``cache_misses`` are the prefix-cache block hits and misses of windowed
    sequences' lookups (attention state reused across similar windows); ``memory_bytes`` the KV
    windowed sequences hold now; ``utilization`` their held blocks over what their windows allow.
    """

    enabled: bool
    windows_slid: int
    tokens_dropped: int
    blocks_released: int
    blocks_in_use: int
    cache_hits: int = 0
    cache_misses: int = 0
    memory_bytes: int = 0
    utilization: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Everything the engine reports, as of ``created`` (``time.time()``).

    ``cache`` is the tiered store's ``CacheSnapshot``, or ``None`` when prefix
    caching is off (or the backend keeps no paged arena). ``profiling`` holds the
    per-phase step timings with ``[monitoring] detailed_profiling`` on, else ``None``.
    """

    created: float
    cache: Any
    speculation: SpeculationSnapshot
    sliding_window: WindowSnapshot
    counters: EngineCounters
    requests_running: int
    requests_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int = 0  # tokens per block
    kv_block_bytes: int = 0  # bytes of one L1 block, all layers
    kv_blocks_empty: int = 0  # L1 blocks holding nothing (neither in use nor cached)
    sharing_hits: int = 0  # L1 lookups that reused a block another running sequence was using
    profiling: PhaseTimings | None = None  # per-phase step timings (monitoring.detailed_profiling), else None
    kv_blocks_pinned: int = 0  # L1 blocks kept only by a pin (named prefixes): neither free nor in use
    cache_keys: int = 0  # named prefixes (cache_key) registered
    cache_keys_pinned_bytes: int = 0  # bytes of the distinct blocks they pin
    plugin_figures: list[FigureGroup] = field(default_factory=list)  # components' own figures (cache.figures)
    kv_events_recorded: int = 0  # block events recorded so far (cache.kv_events): unchanged, none to publish
    kv_events_epoch: str | None = None  # the event log's epoch: another one is another core (a restarted engine)

    @property
    def kv_usage(self) -> float:
        """Fraction of L1 blocks in use."""
        return 1 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def requests_queued(self) -> int:
        return self.requests_running + self.requests_waiting

    @property
    def l1_bytes(self) -> int:
        """KV bytes L1 holds: blocks in use and cached blocks."""
        return (self.kv_blocks_total - self.kv_blocks_empty) * self.kv_block_bytes


def empty_snapshot(kv_blocks_total: int = 0) -> EngineSnapshot:
    """The snapshot of an engine that has done nothing yet."""
    return EngineSnapshot(
        created=time.time(),
        cache=None,
        speculation=SpeculationSnapshot(False, None),
        sliding_window=WindowSnapshot(False, 0, 0, 0, 0),
        counters=EngineCounters(),
        requests_running=0,
        requests_waiting=0,
        kv_blocks_total=kv_blocks_total,
        kv_blocks_free=kv_blocks_total,
    )
