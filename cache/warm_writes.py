"""A prompt warm's writes: they wait for room in the tiers' write queues instead of being dropped, and are counted.

    EngineClient.warm(prompts) ──► requests tagged with one warm ──► their computed blocks, written through:
        tier.put_waiting(entry, tally, deadline)   waits while the write queue is full (the warm's time allows)
    all done ──► flush (what time is left) ──► per write-through tier: written, dropped, pending

A warm waits at most ``[kv_cache] warm_write_timeout_seconds`` in all, its
writes and the final flush together; decoding of other requests pauses while
a warm's write waits, so the bound is kept short.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tierserve.cache.tier import CacheEntry, CacheTier, WriteTally


@dataclass(slots=True)
class WarmWrites:
    """The write-through of one prompt warm.

    Attributes:
        wait_seconds: how long its writes may still wait for room, in all.
        tallies: what became of its writes, per tier name.
    """

    wait_seconds: float
    tallies: dict[str, WriteTally] = field(default_factory=dict)

    def put(self, name: str, tier: CacheTier, entry: CacheEntry) -> list[CacheEntry]:
        """Write ``entry`` to the tier called ``name``, waiting for room while time is left."""
        tally = self.tallies.setdefault(name, WriteTally())
        started = time.monotonic()
        evicted = tier.put_waiting(entry, tally, started + max(0.0, self.wait_seconds))
        self.wait_seconds -= time.monotonic() - started
        return evicted

    def report(self, names: Iterable[str]) -> dict[str, dict[str, int]]:
        """``{"written": n, "dropped": m, "pending": p}`` for each of ``names`` (zeros where nothing was written)."""
        report = {}
        for name in names:
            tally = self.tallies.get(name, WriteTally())
            report[name] = {"written": tally.written, "dropped": tally.dropped, "pending": tally.pending}
        return report


@dataclass(slots=True)
class WarmedPrompts:
    """What ``EngineClient.warm`` did.

    Attributes:
        tokens: prompt tokens in full blocks, now cached.
        writes: per write-through tier, the warm's blocks ``written``, ``dropped`` and still
            ``pending`` when its time to wait ran out (``WarmWrites.report``).
    """

    tokens: int
    writes: dict[str, dict[str, int]] = field(default_factory=dict)

    def plus(self, other: WarmedPrompts) -> WarmedPrompts:
        """Both warms' figures added up (a long list is warmed in batches)."""
        writes = {name: dict(counts) for name, counts in self.writes.items()}
        for name, counts in other.writes.items():
            mine = writes.setdefault(name, dict.fromkeys(counts, 0))
            for what, n in counts.items():
                mine[what] = mine.get(what, 0) + n
        return WarmedPrompts(self.tokens + other.tokens, writes)
