"""The fleet's Ray Serve request router: the replica with the longest cached prefix, or the least loaded.

It runs where the engine deployment's handle lives (the ingress replica) and
sees each forwarded request's path, headers and body; ``prefix_affinity``
does the bookkeeping. The router records a request's prefix against the
replica Ray hands it (Ray calls ``on_request_routed`` only with strict queue
limits on, so the routing future's result is what it follows), and counts
each decision once by reason
(``prefix_affinity.DECISIONS``, served at ``/v1/fleet/stats``, and the Ray
metric ``tierserve_fleet_routing_decisions``).
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict
from typing import Any

import structlog

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tierserve.fleet import prefix_affinity
from tierserve.fleet.kv_index import choose as choose_by_cache
from tierserve.fleet.prefix_affinity import PrefixAffinity, RouteKey, choose, route_key

log = structlog.get_logger(__name__)

SEEN_REQUESTS = 100_000  # requests in flight this router keeps track of


def forwarded_request(args: list[Any]) -> tuple[dict[str, str], bytes] | None:
    """The headers (lower-case names) and body of a forwarded request (its first argument, as ``Ingress`` builds it)."""
    if not args or not isinstance(args[0], dict):
        return None
    request = args[0]
    return {_text(name).lower(): _text(value) for name, value in request.get("headers", [])}, request.get("body", b"")


def request_route_key(args: list[Any]) -> RouteKey | None:
    """The route key of a forwarded request."""
    forwarded = forwarded_request(args)
    return route_key(*forwarded) if forwarded is not None else None


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


class CacheAwareRouter(RequestRouter):
    """Sends a request to the replica that last received the longest prefix of its prompt (or its
    ``cache_key``) unless that replica has more than ``max_imbalance`` requests ongoing beyond the least
    loaded one; then, and for prompts nothing matches, to the least loaded replica (ties at random).

    What a request is recorded against (its prefix, its count of ongoing requests, its decision) is the
    replica Ray actually hands it (its routing future's result), from then until
    ``on_request_completed``: exact for what this router sent, where Ray's queue-length cache is
    refreshed only now and then. Requests are matched to replicas by id (no FIFO reassignment).
    """

    def initialize_state(self, max_imbalance: int = 8, max_chunks: int = 200_000) -> None:
        self.affinity = PrefixAffinity(max_chunks=max_chunks)
        self.max_imbalance = max_imbalance
        self._metric = _decision_metric()
        self._routing: dict[int, tuple[Any, str]] = {}  # id(routing future) -> (key, reason), until it resolves
        self._placed: OrderedDict[str, str] = OrderedDict()  # internal request id -> replica, until completed
        self._ongoing: Counter[str] = Counter()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if not by_name:
            return []
        ongoing = {name: self._ongoing[name] for name in by_name}
        started = time.perf_counter()
        chosen, reason, key = self._decide(pending_request, ongoing)
        prefix_affinity.DECIDE_SECONDS.append(time.perf_counter() - started)
        if pending_request is not None:
            self._follow(pending_request, key, reason)
        others = [replica for name, replica in by_name.items() if name != chosen]
        return [[by_name[chosen]], others] if others else [[by_name[chosen]]]

    def _decide(self, pending_request: PendingRequest | None, ongoing: dict[str, int]) -> tuple[str, str, Any]:
        """The replica (among ``ongoing``'s) for the request, the reason, and the key ``_placed_on`` records."""
        key = request_route_key(pending_request.args) if pending_request is not None else None
        preferred, reason, _ = self.affinity.prefer(key, ongoing)
        chosen, kept = choose(preferred, ongoing, self.max_imbalance, random.choice)
        if preferred is not None and not kept:
            reason = "overloaded"
        return chosen, reason, key

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._release(self._placed.pop(internal_request_id, None))

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def on_replica_actor_unavailable(self, replica_id: Any) -> None:
        """A call to the replica could not reach it (its node lost, its process gone): what it held is not counted
        on until it is heard from again; Ray routes around it meanwhile."""
        super().on_replica_actor_unavailable(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's new set of running replicas: those no longer in it are forgotten."""
        before = {replica_id.unique_id for replica_id in self._replica_id_set}
        super().update_replicas(replicas)
        for gone in before - {replica.replica_id.unique_id for replica in replicas}:
            self._forget(gone)

    def _forget(self, replica: str) -> None:
        self.affinity.forget_replica(replica)
        self._ongoing.pop(replica, None)

    def _follow(self, pending_request: PendingRequest, key: Any, reason: str) -> None:
        """Remember the latest decision for this routing attempt; record it once Ray assigns a replica."""
        future = pending_request.future
        first = id(future) not in self._routing
        self._routing[id(future)] = (key, reason)
        if first:
            request_id = pending_request.metadata.internal_request_id
            future.add_done_callback(lambda done: self._routed(request_id, done))

    def _routed(self, request_id: str, future: Any) -> None:
        key, reason = self._routing.pop(id(future), (None, "unparsed"))
        if future.cancelled() or future.exception() is not None:
            return  # cancelled before a replica took it: nothing to count
        replica = future.result().replica_id.unique_id
        self._placed_on(key, replica)
        self._release(self._placed.pop(request_id, None))  # a retried request moves
        self._placed[request_id] = replica
        self._ongoing[replica] += 1
        while len(self._placed) > SEEN_REQUESTS:  # completions never reported (should not happen): forget
            self._release(self._placed.popitem(last=False)[1])
        # through the module: Ray ships this router module by value, so a name imported here would be a copy
        prefix_affinity.DECISIONS[reason] += 1
        prefix_affinity.REPLICA_DECISIONS[replica][reason] += 1
        if self._metric is not None:
            self._metric.inc(tags={"reason": reason})

    def _placed_on(self, key: Any, replica: str) -> None:
        """Ray handed the request with ``key`` to ``replica``: its prefix now points there."""
        self.affinity.record(key, replica)

    def _release(self, replica: str | None) -> None:
        if replica is not None:
            self._ongoing[replica] = max(0, self._ongoing[replica] - 1)


class KVEventRouter(CacheAwareRouter):
    """Routes on what the replicas' caches actually hold, as their published block events say (``kv_hub``):
    the replica holding the longest prefix of the request's prompt blocks (L1 first, private tiers below at a
    discount), unless it is overloaded, short of free KV blocks or slow (``kv_index.choose``); the least loaded
    otherwise. The prompt's token ids and salt are made here as the replicas' servers make them
    (``request_tokens``), and matched against this router's mirror of the hub (``kv_hub.HubMirror``): no call
    leaves the process while a request is routed.
    """

    def initialize_state(self, max_imbalance: int = 8, sources: dict[str, Any] | None = None, app_name: str = "tierserve") -> None:
        """``sources``: the fleet's ``SettingsSources.as_json()`` (the model's tokenizer and the tenants come from
        them); ``app_name``: the Serve application whose hub to follow."""
        from tierserve.fleet.kv_hub import HubMirror
        from tierserve.fleet.request_tokens import RequestTokens
        from tierserve.fleet.settings_sources import SettingsSources

        super().initialize_state(max_imbalance=max_imbalance)
        self.tokens = RequestTokens(SettingsSources.from_json(sources).load().settings) if sources is not None else None
        self.mirror = HubMirror(app_name).start()

    def _decide(self, pending_request: PendingRequest | None, ongoing: dict[str, int]) -> tuple[str, str, Any]:
        forwarded = forwarded_request(pending_request.args) if pending_request is not None else None
        read = self.tokens.of(*forwarded) if forwarded is not None and self.tokens is not None else None
        matches, blocks = self.mirror.match(*read) if read is not None else ({}, 0)
        chosen, reason = choose_by_cache(matches, ongoing, blocks, self.max_imbalance, random.choice)
        return chosen, reason if read is not None else "unparsed", read

    def _placed_on(self, key: Any, replica: str) -> None:
        """The prompt (``key``: its ids and salt) counts as held where Ray sent it until its events arrive."""
        if key is not None:
            self.mirror.expect(replica, *key)

    def _forget(self, replica: str) -> None:
        super()._forget(replica)
        self.mirror.forget(replica)  # the hub ages it out by itself (kv_index.STALE_SECONDS)


def _decision_metric() -> Any:
    """The Ray metric of routing decisions, or None where Ray's metrics are unavailable."""
    try:
        from ray.util.metrics import Counter

        return Counter(
            "tierserve_fleet_routing_decisions",
            description="Requests routed by the cache-aware router, by reason",
            tag_keys=("reason",),
        )
    except Exception:  # metrics need a running Ray worker; routing does not
        return None
