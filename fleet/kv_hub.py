"""The fleet's KV event hub: one Ray Serve deployment that every engine replica publishes its cache events to,
and every ingress router follows.

    EngineReplica ── when its cache changed (looked at every PUBLISH_SECONDS), its free blocks moved, or every
                     HEARTBEAT_SECONDS: engine.kv_events(cursor) + load ──► KVHub.publish ──► FleetKVIndex
    KVEventRouter's HubMirror ── KVHub.updates(version), answered once there is news (at most every
                                 MIRROR_SECONDS, or after WAIT_SECONDS without) ──► its own FleetKVIndex
    KVEventRouter ── per request, locally: mirror.match(prompt ids, salt) ──► {replica: ReplicaMatch}

One hub serves every router, so several ingress replicas see the same
events; a router's mirror applies them in the hub's order, or takes the
hub's whole state when it is too far behind (or the hub restarted). A publication that does not follow the last one (``FleetKVIndex``)
makes the hub drop that replica's holdings and answer ``False``: the replica
starts over with a snapshot. A replica that stops publishing (dead, or its
node gone) is stale after ``kv_index.STALE_SECONDS`` and routed to as holding
nothing; the router also tells the hub when Ray reports a replica dead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from tierserve.cache.kv_events import KVEvents
from tierserve.fleet.kv_index import STALE_SECONDS, FleetKVIndex, ReplicaLoad, ReplicaMatch

log = structlog.get_logger(__name__)

HUB_DEPLOYMENT = "kv-hub"
PUBLISH_SECONDS = 0.1
# a replica with nothing new still publishes this often: its TTFT and report stay current, and silence (STALE_SECONDS)
# means it is gone; publishing every PUBLISH_SECONDS regardless cost a 2-core fleet a tenth of its CPU (hub, replicas)
HEARTBEAT_SECONDS = 1.0
PRESSURE_SHARE = 1 / 64  # free blocks moved by this share of the pool since the last publication: publish it
MIRROR_SECONDS = 0.1
WAIT_SECONDS = 1.0  # a mirror's call waits this long for news before the hub answers with none
FORGET_SECONDS = 60.0  # a replica silent this long leaves the hub (and the fleet's views); stale ones are listed till then
REPORT_SECONDS = 1.0  # a replica's figures for the fleet's views (dashboard, top --fleet) go with a publication this often


class KVHub:
    """The hub's state: a ``FleetKVIndex``, and a numbered log of what it applied for the routers' mirrors (a Serve
    replica of its own, with no CPU reserved)."""

    def __init__(self, max_log: int = 4096) -> None:
        self.index = FleetKVIndex()
        self.version = 0
        self.log: deque[tuple[int, str, KVEvents | None, ReplicaLoad | None]] = deque(maxlen=max_log)
        self.reports: dict[str, dict[str, Any]] = {}  # replica -> its latest ``replica_report``, for the fleet's views
        self._news: asyncio.Event | None = None  # set (and replaced) whenever the version moves: mirrors waiting wake

    async def publish(self, replica: str, events: KVEvents, load: ReplicaLoad, report: dict[str, Any] | None = None) -> bool:
        """Apply a replica's events (and keep its ``report``); False: they did not follow the last ones, publish a
        snapshot next."""
        if report is not None:
            self.reports[replica] = report
        applied = self.index.apply(replica, events, load)
        self._append(replica, events if applied else None, load)  # None: start over
        if not applied:
            log.info("fleet_kv_resync", replica=replica, epoch=events.epoch, seq=events.seq)
        return applied

    async def forget(self, replica: str) -> None:
        self.index.forget(replica)
        self.reports.pop(replica, None)
        self._append(replica, None, None)

    def _append(self, replica: str, events: KVEvents | None, load: ReplicaLoad | None) -> None:
        self.version += 1
        self.log.append((self.version, replica, events, load))
        if self._news is not None:
            self._news.set()
            self._news = None

    async def updates(self, since: int, wait_seconds: float = 0.0) -> HubUpdates:
        """What a router's mirror needs after ``since``: the publications applied since then, in order, or (too far
        behind, or a hub that restarted) every replica's state as a snapshot. With nothing new yet, the answer waits
        up to ``wait_seconds`` for news (a long poll: a mirror asks again at once, and hears of a change when it
        happens rather than at its next poll)."""
        if since == self.version and wait_seconds > 0:
            if self._news is None:
                self._news = asyncio.Event()
            try:
                await asyncio.wait_for(self._news.wait(), wait_seconds)
            except asyncio.TimeoutError:
                pass
        oldest = self.log[0][0] if self.log else self.version + 1
        if since < oldest - 1 or since > self.version:
            full = {}
            for replica in list(self.index.replicas):
                state = self.index.snapshot_of(replica)
                if state is not None:
                    full[replica] = state
            return HubUpdates(self.version, full=full)
        return HubUpdates(self.version, entries=tuple(entry for entry in self.log if entry[0] > since))

    async def summary(self) -> dict[str, Any]:
        """Per replica: what it holds (``FleetKVIndex.summary``) and its latest report (``replica_report``); a
        replica stale for ``STALE_SECONDS`` is listed with ``stale: true``."""
        summary: dict[str, Any] = self.index.summary()
        for replica in [name for name, state in summary.items() if state["seconds_since_update"] > FORGET_SECONDS]:
            await self.forget(replica)  # long gone: no longer listed
            del summary[replica]
        for replica, state in summary.items():
            state.update(self.reports.get(replica, {}))
            state["stale"] = state["seconds_since_update"] > STALE_SECONDS
        return summary


@dataclass(frozen=True, slots=True)
class HubUpdates:
    """The hub's answer to a mirror: ``entries`` ``(version, replica, events or None to start over, load)`` after its
    version, or ``full``: replica -> (snapshot, load, seconds since it published)."""

    version: int
    entries: tuple[tuple[int, str, KVEvents | None, ReplicaLoad | None], ...] = ()
    full: dict[str, tuple[KVEvents, ReplicaLoad, float]] | None = None


class HubMirror:
    """A router's copy of the hub's index, kept current by a thread that asks the hub for updates (a handle's
    blocking call, never on the router's event loop): the hub answers when there is news, and the thread asks
    again ``MIRROR_SECONDS`` later, so news waits at most that long; a quiet fleet costs a call per replica's
    heartbeat (at most one per ``MIRROR_SECONDS``). Reads are locked."""

    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self.index = FleetKVIndex()
        self.lock = threading.Lock()
        self.version = -1
        self._stop = threading.Event()
        self._failing = False
        self.thread = threading.Thread(target=self._run, name="tierserve-kv-mirror", daemon=True)

    def start(self) -> HubMirror:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def match(self, token_ids: Sequence[int], cache_salt: str | None) -> tuple[dict[str, ReplicaMatch], int]:
        """Each live replica's hold on a prompt, and the prompt's full blocks."""
        with self.lock:
            matches = self.index.match(token_ids, cache_salt)
            sizes = [s.load.block_size for s in self.index.live().values() if s.load is not None]
        return matches, (len(token_ids) // sizes[0]) if sizes else 0

    def forget(self, replica: str) -> None:
        with self.lock:
            self.index.forget(replica)

    def expect(self, replica: str, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """This router just sent the prompt to ``replica`` (``FleetKVIndex.expect``)."""
        with self.lock:
            self.index.expect(replica, token_ids, cache_salt)

    def apply(self, updates: HubUpdates) -> None:
        with self.lock:
            if updates.full is not None:
                self.index.replicas.clear()
                for replica, (events, load, age) in updates.full.items():
                    self.index.apply(replica, events, load)
                    self.index.age(replica, age)
            for _, replica, events, load in updates.entries:
                if events is None or load is None:
                    self.index.forget(replica)
                elif not self.index.apply(replica, events, load):
                    self.version = -1  # out of step with the hub: take its whole state next time
                    return
            self.version = updates.version

    def _run(self) -> None:
        from ray import serve

        hub = None
        while not self._stop.wait(MIRROR_SECONDS):
            try:
                hub = hub or serve.get_deployment_handle(HUB_DEPLOYMENT, app_name=self.app_name)
                self.apply(hub.updates.remote(self.version, WAIT_SECONDS).result(timeout_s=10 + WAIT_SECONDS))
                if self._failing:
                    log.info("fleet_kv_mirror_recovered")
                    self._failing = False
            except Exception as exc:  # the hub restarting: route by load meanwhile (its replicas go stale)
                if not self._failing:
                    log.warning("fleet_kv_mirror_failed", error=repr(exc))
                    self._failing = True
                time.sleep(MIRROR_SECONDS * 10)


class EventPublisher:
    """A replica's thread that publishes its engine's cache events to the hub (see the module docstring)."""

    def __init__(self, replica: str, engine: Any, hub: Any, ttft_p50: Any, where: dict[str, str] | None = None) -> None:
        """``where``: what the fleet's views show of the replica's place (its deployment, node), sent with reports."""
        self.replica, self.engine, self.hub, self.ttft_p50, self.where = replica, engine, hub, ttft_p50, where or {}
        self.reported = 0.0
        self.published = 0.0  # when it last published, and what its engine had then (events recorded, free blocks)
        self.seen: tuple[int, int] | None = None
        self.cursor: tuple[str | None, int] = (None, -1)
        self._stop = threading.Event()
        self._failing = False
        self.thread = threading.Thread(target=self._run, name="tierserve-kv-events", daemon=True)

    def start(self) -> EventPublisher:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def publish_once(self) -> bool:
        """One publication if one is due (nothing when the cache is off); False when the hub asked for a snapshot.

        Due: the engine recorded block events since the last one, its free blocks moved by ``PRESSURE_SHARE`` of
        its pool, ``HEARTBEAT_SECONDS`` passed, the hub asked to start over, or another core took over (a restart:
        another epoch, whose counts start again)."""
        stats = self.engine.stats()
        now = time.monotonic()
        same_core = self.cursor[0] is not None and stats.kv_events_epoch == self.cursor[0]
        if self.seen is not None and same_core and now - self.published < HEARTBEAT_SECONDS:
            recorded, free = self.seen
            moved = abs(stats.kv_blocks_free - free) >= max(1.0, PRESSURE_SHARE * stats.kv_blocks_total)
            if stats.kv_events_recorded == recorded and not moved:
                return True
        events = self.engine.kv_events(*self.cursor)
        if events is None:
            return True
        load = ReplicaLoad(self.engine.info.fingerprint, self.engine.info.block_size, stats.kv_blocks_free,
                           stats.kv_blocks_total, self.ttft_p50())  # fmt: skip
        report = None
        if time.monotonic() - self.reported >= REPORT_SECONDS:
            report, self.reported = {**self.where, **replica_report(stats)}, time.monotonic()
        applied = self.hub.publish.remote(self.replica, events, load, report).result()
        self.cursor = (events.epoch, events.seq) if applied else (None, -1)
        self.published, self.seen = now, (stats.kv_events_recorded, stats.kv_blocks_free)
        return applied

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_SECONDS):
            try:
                self.publish_once()
                if self._failing:
                    log.info("fleet_kv_publish_recovered", replica=self.replica)
                    self._failing = False
            except Exception as exc:  # the hub restarting, the engine gone: keep the cursor, try again
                if not self._failing:
                    log.warning("fleet_kv_publish_failed", replica=self.replica, error=repr(exc))
                    self._failing = True
                time.sleep(PUBLISH_SECONDS * 10)


def replica_report(snapshot: Any) -> dict[str, Any]:
    """What the fleet's views show of one replica, from its engine's ``EngineSnapshot``: its requests, prompt
    tokens served from cache, L1 blocks, and each tier below L1 (those on a ``remote`` medium are the shared ones)."""
    cache = snapshot.cache
    cached = cache.cached_tokens if cache is not None else 0
    computed = cache.computed_tokens if cache is not None else 0
    tiers = {
        name: {"medium": tier.medium, "entries": tier.entries, "bytes": tier.bytes, "hits": tier.hits, "misses": tier.misses}
        for name, tier in (cache.tiers.items() if cache is not None else ())
        if name != "l1"
    }
    return {
        "requests_running": snapshot.requests_running,
        "requests_waiting": snapshot.requests_waiting,
        "prompt_tokens_cached": cached,
        "prompt_tokens_computed": computed,
        "hit_rate": round(cached / (cached + computed), 4) if cached + computed else None,
        "kv_blocks_used": snapshot.kv_blocks_total - snapshot.kv_blocks_empty,
        "tiers": tiers,
    }
