"""The fleet's Ray Serve request router: the replica with the longest cached prefix, or the least loaded.

It runs where the engine deployment's handle lives (the ingress replica) and
sees each forwarded request's path, headers and body; ``prefix_affinity``
does the bookkeeping. The router records a request's prefix against the
replica it chose when it chooses (Ray calls ``on_request_routed`` only with
strict queue limits on), and counts each decision once by reason
(``prefix_affinity.DECISIONS``, served at ``/v1/fleet/stats``, and the Ray
metric ``tierserve_fleet_routing_decisions``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from tierserve.fleet import prefix_affinity
from tierserve.fleet.prefix_affinity import PrefixAffinity, RouteKey, choose, route_key

SEEN_REQUESTS = 10_000  # request ids remembered so a retried routing counts once


def request_route_key(args: list[Any]) -> RouteKey | None:
    """The route key of a forwarded request (its first argument, as ``Ingress`` builds it)."""
    if not args or not isinstance(args[0], dict):
        return None
    request = args[0]
    headers = {name.lower(): value for name, value in request.get("headers", [])}
    return route_key(request.get("path", ""), headers, request.get("body", b""))


class CacheAwareRouter(FIFOMixin, RequestRouter):
    """Sends a request to the replica that last received the longest prefix of its prompt (or its
    ``cache_key``) unless that replica has more than ``affinity_max_queue`` requests ongoing; then, and
    for prompts nothing matches, to the least loaded replica (ties broken at random)."""

    def initialize_state(self, affinity_max_queue: int = 8, max_chunks: int = 200_000) -> None:
        self.affinity = PrefixAffinity(max_chunks=max_chunks)
        self.max_queue = affinity_max_queue
        self._metric = _decision_metric()
        self._seen: OrderedDict[str, None] = OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if not by_name:
            return []
        key = request_route_key(pending_request.args) if pending_request is not None else None
        preferred, reason, _ = self.affinity.prefer(key, by_name)
        queues = {name: self._replica_queue_len_cache.get(r.replica_id) for name, r in by_name.items()}
        chosen, kept = choose(preferred, queues, self.max_queue, random.choice)
        if preferred is not None and not kept:
            reason = "overloaded"
        self.affinity.record(key, chosen)
        if pending_request is not None:
            self._count_once(pending_request.metadata.internal_request_id, reason)
        others = [replica for name, replica in by_name.items() if name != chosen]
        return [[by_name[chosen]], others] if others else [[by_name[chosen]]]

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget_replica(replica_id.unique_id)

    def _count_once(self, request_id: str, reason: str) -> None:
        if request_id in self._seen:
            return
        self._seen[request_id] = None
        while len(self._seen) > SEEN_REQUESTS:
            self._seen.popitem(last=False)
        # through the module: Ray ships this router module by value, so a name imported here would be a copy
        prefix_affinity.DECISIONS[reason] += 1
        if self._metric is not None:
            self._metric.inc(tags={"reason": reason})


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
