"""What each replica's cache holds, as its published block events say, and the replica a request should go to.

Each engine replica publishes its ``cache.kv_events`` (blocks stored in and
removed from L1 and its private tiers, in numbered batches) with its load;
``FleetKVIndex`` applies them per replica. A batch that does not follow the
last one applied (lost, repeated, out of order, another epoch) is not
applied: the replica's holdings are dropped at once and it is asked for a
snapshot, so a wrong belief never outlives one publication. A replica that
has not published for ``stale_seconds`` counts as holding nothing.

A request is matched by the chained hashes of its prompt's full blocks
(``cache.hashing``, rooted in the model's fingerprint, the block size and
the tenant's salt): a replica's match is the longest run of them it holds
in L1, and the longer run it holds in L1 or a private tier below. A prompt
just routed to a replica counts as held there for ``EXPECT_SECONDS``, until
its events arrive: a conversation's next turn, sent before the replica
published its blocks, still finds its way back.

    choose(matches, ongoing, ...) ─► (replica, reason)
        reason: "kv_l1" | "kv_tier" (the prefix decided), "no_match", "overloaded", "kv_pressure", "slow"
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tierserve.cache.hashing import extend_hashes, root_hash
from tierserve.cache.kv_events import KVEvents

L1 = 0
STALE_SECONDS = 5.0  # a replica publishes at least every second: silent this long, it is gone (its node lost, its process dead)
LOWER_TIER_WEIGHT = 0.5  # a block in a private tier below L1 saves its compute but costs a read
# a replica whose TTFT p50 is over eight times the other replicas' median loses the prefix's claim: a degraded
# replica, not one that served more misses lately (a p50 mixing hits and misses swings fourfold on shared cores;
# at four times it sent 15 requests a run away from their prefix, at three times the fleet's best 66)
SLOW_FACTOR = 8.0
# a replica's hold counts when it covers at least this share of the prompt's blocks (SGLang's cache_threshold):
# a chat template's or a BOS's first block, held everywhere, would otherwise send every new prompt to one replica
MIN_MATCH_SHARE = 0.5
EXPECT_SECONDS = 5.0  # a prompt just routed counts as held there until its events arrive (or this passes)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a replica reports beside its events: its model's hashing, its free KV blocks and its recent TTFT."""

    fingerprint: str
    block_size: int
    free_blocks: int
    total_blocks: int
    ttft_p50: float | None = None  # seconds, over its recent requests; None before any


@dataclass(slots=True)
class ReplicaCache:
    """One replica's published state, as applied so far."""

    epoch: str | None = None
    seq: int = -1
    holds: dict[bytes, int] = field(default_factory=dict)  # key -> bit per position (bit 0: L1)
    expected: dict[bytes, float] = field(default_factory=dict)  # key -> until when: routed here, events not in yet
    load: ReplicaLoad | None = None
    updated: float = 0.0
    resyncs: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaMatch:
    """How much of a request's prompt one replica holds (blocks from the start), and its load."""

    l1_blocks: int
    tier_blocks: int  # L1 or a private tier below, from the start
    free_blocks: int
    ttft_p50: float | None

    @property
    def value(self) -> float:
        """Blocks the replica would not compute: L1's in full, the lower tiers' at ``LOWER_TIER_WEIGHT``."""
        return self.l1_blocks + LOWER_TIER_WEIGHT * (self.tier_blocks - self.l1_blocks)


class FleetKVIndex:
    """The replicas' published cache holdings; not thread-safe (one hub, one event loop)."""

    def __init__(self, stale_seconds: float = STALE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_seconds = stale_seconds
        self.clock = clock
        self.replicas: dict[str, ReplicaCache] = {}

    def cursor(self, replica: str) -> tuple[str | None, int]:
        """What ``replica`` should publish next: the events after this ``(epoch, seq)``."""
        state = self.replicas.get(replica)
        return (state.epoch, state.seq) if state is not None else (None, -1)

    def apply(self, replica: str, events: KVEvents, load: ReplicaLoad) -> bool:
        """Apply one publication; False when it does not follow the last one applied (the replica's holdings
        are then dropped and its cursor reset, so its next publication is a snapshot)."""
        state = self.replicas.setdefault(replica, ReplicaCache())
        state.load, state.updated = load, self.clock()
        if events.snapshot is not None:
            state.holds, state.expected = {}, {}  # the replica's own word replaces every guess
            for position, keys in events.snapshot.items():
                for key in keys:
                    state.holds[key] = state.holds.get(key, 0) | (1 << position)
            state.epoch, state.seq = events.epoch, events.seq
            return True
        if events.epoch != state.epoch:
            return self._resync(state)
        expected = state.seq + 1
        for batch in events.batches:
            if batch.seq != expected:
                return self._resync(state)
            for stored, position, key in batch.changes:
                state.expected.pop(key, None)  # the replica says where it is (or that it is gone)
                bits = state.holds.get(key, 0)
                bits = bits | (1 << position) if stored else bits & ~(1 << position)
                if bits:
                    state.holds[key] = bits
                else:
                    state.holds.pop(key, None)
            expected += 1
        if events.seq != expected - 1:  # the log numbered batches this publication does not carry
            return self._resync(state)
        state.seq = events.seq
        return True

    def _resync(self, state: ReplicaCache) -> bool:
        state.holds, state.epoch, state.seq = {}, None, -1
        state.resyncs += 1
        return False

    def forget(self, replica: str) -> None:
        """A replica died or left: nothing it held is routed to."""
        self.replicas.pop(replica, None)

    def snapshot_of(self, replica: str) -> tuple[KVEvents, ReplicaLoad, float] | None:
        """What is believed of ``replica`` as a snapshot publication, its load and the seconds since it published
        (for a mirror starting over), or None."""
        state = self.replicas.get(replica)
        if state is None or state.load is None or state.epoch is None:
            return None
        by_position: dict[int, list[bytes]] = {}
        for key, bits in state.holds.items():
            position = 0
            while bits:
                if bits & 1:
                    by_position.setdefault(position, []).append(key)
                bits >>= 1
                position += 1
        return KVEvents(state.epoch, state.seq, snapshot=by_position), state.load, self.clock() - state.updated

    def age(self, replica: str, seconds: float) -> None:
        """Date ``replica``'s last publication ``seconds`` back (a mirror told how old its source's news is)."""
        if replica in self.replicas:
            self.replicas[replica].updated = self.clock() - seconds

    def live(self) -> dict[str, ReplicaCache]:
        """The replicas heard from within ``stale_seconds``."""
        now = self.clock()
        return {name: state for name, state in self.replicas.items() if now - state.updated <= self.stale_seconds}

    def match(self, token_ids: Sequence[int], cache_salt: str | None) -> dict[str, ReplicaMatch]:
        """Each live replica's hold on the prompt ``token_ids`` of a request salted ``cache_salt``."""
        matches: dict[str, ReplicaMatch] = {}
        hashes_by_model: dict[tuple[str, int], list[bytes]] = {}
        now = self.clock()
        for name, state in self.live().items():
            load = state.load
            if load is None:
                continue
            l1 = tiers = 0
            for key in self._hashes(hashes_by_model, load, token_ids, cache_salt):
                bits = state.holds.get(key, 0) or (1 if state.expected.get(key, 0) > now else 0)
                if not bits:
                    break
                tiers += 1
                if bits & 1 and l1 == tiers - 1:
                    l1 += 1
            matches[name] = ReplicaMatch(l1, tiers, load.free_blocks, load.ttft_p50)
        return matches

    def expect(self, replica: str, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """A request with this prompt was just routed to ``replica``: count its blocks as held in its L1 for
        ``EXPECT_SECONDS`` (its events confirm them, or the expectation lapses)."""
        state = self.replicas.get(replica)
        if state is None or state.load is None:
            return
        now = self.clock()
        state.expected = {key: until for key, until in state.expected.items() if until > now}
        until = now + EXPECT_SECONDS
        for key in self._hashes({}, state.load, token_ids, cache_salt):
            state.expected[key] = until

    @staticmethod
    def _hashes(cache: dict[tuple[str, int], list[bytes]], load: ReplicaLoad, token_ids: Sequence[int],
                cache_salt: str | None) -> list[bytes]:  # fmt: skip
        model = (load.fingerprint, load.block_size)
        if model not in cache:
            hashes: list[bytes] = []
            extend_hashes(hashes, root_hash(*model, cache_salt), token_ids, load.block_size, len(token_ids))
            cache[model] = hashes
        return cache[model]

    def summary(self) -> dict[str, dict[str, object]]:
        """Per replica: blocks held per position, free blocks, TTFT p50, resyncs, seconds since it published."""
        now = self.clock()
        summary: dict[str, dict[str, object]] = {}
        for name, state in self.replicas.items():
            counts: dict[int, int] = {}
            for bits in state.holds.values():
                position = 0
                while bits:
                    if bits & 1:
                        counts[position] = counts.get(position, 0) + 1
                    bits >>= 1
                    position += 1
            load = state.load
            summary[name] = {
                "blocks_held": {str(position): count for position, count in sorted(counts.items())},
                "free_blocks": load.free_blocks if load else None,
                "total_blocks": load.total_blocks if load else None,
                "ttft_p50": load.ttft_p50 if load else None,
                "resyncs": state.resyncs,
                "seconds_since_update": round(now - state.updated, 3),
            }
        return summary


def choose(
    matches: Mapping[str, ReplicaMatch],
    ongoing: Mapping[str, int],
    prompt_blocks: int,
    max_imbalance: int,
    pick: Callable[[list[str]], str],
) -> tuple[str, str]:
    """The replica a request goes to among ``ongoing``'s (the live candidates), and why.

    The replica holding the most of the prompt (``ReplicaMatch.value``, at least ``MIN_MATCH_SHARE`` of its blocks)
    takes it, unless it has more than
    ``max_imbalance`` ongoing requests beyond the least loaded (``overloaded``), too few free blocks for the part
    it would compute (``kv_pressure``), or a TTFT p50 over ``SLOW_FACTOR`` times the other replicas' median (``slow``):
    then the next best that has none of these does; with no hold anywhere, the least loaded (``no_match``).
    """
    shortest = min(ongoing.values())
    enough = max(1e-9, MIN_MATCH_SHARE * prompt_blocks)
    held = {name: match for name, match in matches.items() if name in ongoing and match.value >= enough}
    refused: dict[str, str] = {}
    for name in sorted(held, key=lambda name: (-held[name].value, ongoing[name], name)):
        match = held[name]
        if ongoing[name] - shortest > max_imbalance:
            refused[name] = "overloaded"
        elif match.free_blocks < prompt_blocks - match.l1_blocks:
            refused[name] = "kv_pressure"
        elif _slow(name, matches):
            refused[name] = "slow"
        else:
            return name, "kv_l1" if match.l1_blocks * 2 >= match.tier_blocks else "kv_tier"
    candidates = [name for name in ongoing if name not in refused] or list(ongoing)
    fewest = min(ongoing[name] for name in candidates)
    reason = next(iter(refused.values()), "no_match")
    return pick([name for name in candidates if ongoing[name] == fewest]), reason


def _slow(name: str, matches: Mapping[str, ReplicaMatch]) -> bool:
    """``name``'s TTFT p50 is over ``SLOW_FACTOR`` times the other replicas' median."""
    mine = matches[name].ttft_p50
    others = sorted(m.ttft_p50 for other, m in matches.items() if other != name and m.ttft_p50)
    if not mine or not others:
        return False
    middle = len(others) // 2
    median = others[middle] if len(others) % 2 else (others[middle - 1] + others[middle]) / 2
    return mine > SLOW_FACTOR * median
