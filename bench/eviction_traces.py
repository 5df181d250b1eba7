"""Synthetic access traces and a replay loop for comparing eviction policies.

Each trace is a deterministic (seeded) list of keys. ``replay`` drives a
policy exactly as a cache tier does: a hit touches the key, a miss inserts it
and evicts until the tier is back within capacity.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Hashable, Sequence

from tierserve.cache.eviction import EvictionPolicy


def zipf_sampler(n: int, alpha: float, rng: random.Random) -> Callable[[], int]:
    """Ranks 0..n-1 with P(rank r) proportional to 1/(r+1)**alpha."""
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) ** alpha for rank in range(n)))
    total = cumulative[-1]
    return lambda: min(bisect.bisect_left(cumulative, rng.random() * total), n - 1)


def mixed_trace(length: int = 60_000, seed: int = 1) -> list[Hashable]:
    """A Zipf hot set that moves to new keys every phase, with periodic scans.

    Scans of never-reused keys flush a pure-recency cache; the hot set moving
    leaves a pure-frequency cache full of stale counts. An adaptive policy
    should survive both.
    """
    rng = random.Random(seed)
    hot_size, phase_length, scan_every, scan_length = 400, 15_000, 2_000, 300
    sample = zipf_sampler(hot_size, 0.9, rng)
    trace: list[Hashable] = []
    scan_id = 0
    for t in range(length):
        if t % scan_every == 0 and t:
            trace.extend(("scan", scan_id, i) for i in range(scan_length))
            scan_id += 1
        trace.append(("hot", t // phase_length, sample()))
    return trace


def recency_trace(length: int = 60_000, seed: int = 2) -> list[Hashable]:
    """Mostly re-uses of keys seen a few steps ago (geometric reuse distance),
    with a steady stream of new keys: the workload LRU is built for."""
    rng = random.Random(seed)
    history: list[int] = []
    next_key = 0
    trace: list[Hashable] = []
    for _ in range(length):
        if not history or rng.random() < 0.25:
            key = next_key
            next_key += 1
        else:
            distance = min(int(rng.expovariate(1 / 400)), len(history) - 1)
            key = history[-1 - distance]
        history.append(key)
        trace.append(key)
    return trace


def frequency_trace(length: int = 60_000, seed: int = 3) -> list[Hashable]:
    """Independent draws from a fixed Zipf popularity: LFU's best case."""
    rng = random.Random(seed)
    sample = zipf_sampler(5_000, 0.9, rng)
    return [sample() for _ in range(length)]


TRACES: dict[str, Callable[[], list[Hashable]]] = {
    "mixed": mixed_trace,
    "recency": recency_trace,
    "frequency": frequency_trace,
}


def replay(policy: EvictionPolicy, trace: Sequence[Hashable], capacity: int) -> float:
    """Hit rate of ``policy`` on ``trace`` for a cache of ``capacity`` unit-size entries."""
    hits = 0
    for key in trace:
        if key in policy:
            hits += 1
            policy.touch(key)
            continue
        policy.insert(key, 1)
        while policy.total_size > capacity:
            policy.evict()
    return hits / len(trace)
