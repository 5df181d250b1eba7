"""Per-phase step timings (``[monitoring] detailed_profiling``): histograms kept as steps run, O(1) to read.

    phase          measured in                      what
    schedule       EngineCore.step                  scheduler.schedule() + update_from_output(), less prefix matching
    cache_lookup   EngineCore.step                  prefix matching (the store's own lookup clock), steps that looked up
    forward        ModelRunner.execute              backend.forward (a GPU is synchronised, so this is compute)
    sample         ModelRunner.execute              sampling, draft verification, proposing the next drafts
    detokenize     OutputProcessor (client side)    token ids to text deltas, stop strings, per round of outputs

With profiling off no clock exists and nothing in the step reads the time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields
from typing import Any

CORE_PHASES = ("schedule", "cache_lookup", "forward", "sample")
CLIENT_PHASES = ("detokenize",)
# upper bounds in seconds: a decode step of a tiny CPU model (~100 µs phases) up to a long GPU prefill
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class PhaseStats:
    """One phase's histogram: ``counts[i]`` observations fell in ``(BUCKETS[i-1], BUCKETS[i]]``,
    the last entry above every bound."""

    count: int = 0
    seconds: float = 0.0
    counts: tuple[int, ...] = (0,) * (len(BUCKETS) + 1)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: ``(upper bound, observations at or below it)``, ending with ``+Inf``."""
        out, total = [], 0
        for bound, count in zip([*map(str, BUCKETS), "+Inf"], self.counts):
            total += count
            out.append((bound, total))
        return out

    def as_dict(self) -> dict[str, Any]:
        mean = self.seconds / self.count if self.count else 0.0
        return {"count": self.count, "seconds": round(self.seconds, 6), "mean_seconds": round(mean, 6)}


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """Where the engine's step time goes, by phase (``EngineSnapshot.profiling``)."""

    schedule: PhaseStats
    cache_lookup: PhaseStats
    forward: PhaseStats
    sample: PhaseStats
    detokenize: PhaseStats

    def phases(self) -> dict[str, PhaseStats]:
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {name: stats.as_dict() for name, stats in self.phases().items()}


class PhaseClock:
    """Accumulates the durations of some phases; one thread observes, any thread may read.

    A read taken while an observation is being recorded may lag it by that one observation.
    """

    def __init__(self, phases: tuple[str, ...]) -> None:
        self._count = dict.fromkeys(phases, 0)
        self._seconds = dict.fromkeys(phases, 0.0)
        self._counts = {phase: [0] * (len(BUCKETS) + 1) for phase in phases}

    def observe(self, phase: str, seconds: float) -> None:
        self._counts[phase][bisect.bisect_left(BUCKETS, seconds)] += 1
        self._count[phase] += 1
        self._seconds[phase] += seconds

    def read(self) -> dict[str, PhaseStats]:
        """Every phase's histogram as of now (a copy of a fixed number of counters)."""
        return {
            phase: PhaseStats(self._count[phase], self._seconds[phase], tuple(self._counts[phase]))
            for phase in self._count
        }


def core_timings(clock: PhaseClock) -> PhaseTimings:
    """What the core publishes: its phases, and an empty client phase the client fills in."""
    return PhaseTimings(detokenize=PhaseStats(), **clock.read())


def with_client_phases(timings: PhaseTimings, clock: PhaseClock) -> PhaseTimings:
    """The core's timings with the client's phases (``detokenize``) merged in."""
    values = timings.phases() | clock.read()
    return PhaseTimings(**values)
