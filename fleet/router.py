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
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from tierserve.fleet import prefix_affinity
from tierserve.fleet.prefix_affinity import PrefixAffinity, RouteKey, choose, route_key

SEEN_REQUESTS = 100_000  # requests in flight this router keeps track of


def request_route_key(args: list[Any]) -> RouteKey | None:
    """The route key of a forwarded request (its first argument, as ``Ingress`` builds it)."""
    if not args or not isinstance(args[0], dict):
        return None
    request = args[0]
    headers = {name.lower(): value for name, value in request.get("headers", [])}
    return route_key(request.get("path", ""), headers, request.get("body", b""))


class CacheAwareRouter(FIFOMixin, RequestRouter):
    """Sends a request to the replica that last received the longest prefix of its prompt (or its
    ``cache_key``) unless that replica has more than ``max_imbalance`` requests ongoing beyond the least
    loaded one; then, and for prompts nothing matches, to the least loaded replica (ties at random).

    Ongoing requests are counted here, from the choice to ``on_request_completed``: exact for what
    this router sent, where Ray's queue-length cache is refreshed only now and then.
    """

    def initialize_state(self, max_imbalance: int = 8, max_chunks: int = 200_000) -> None:
        self.affinity = PrefixAffinity(max_chunks=max_chunks)
        self.max_imbalance = max_imbalance
        self._metric = _decision_metric()
        self._placed: OrderedDict[str, str] = OrderedDict()  # internal request id -> replica, until completed
        self._ongoing: Counter[str] = Counter()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if not by_name:
            return []
        key = request_route_key(pending_request.args) if pending_request is not None else None
        preferred, reason, _ = self.affinity.prefer(key, by_name)
        ongoing = {name: self._ongoing[name] for name in by_name}
        chosen, kept = choose(preferred, ongoing, self.max_imbalance, random.choice)
        if preferred is not None and not kept:
            reason = "overloaded"
        self.affinity.record(key, chosen)
        if pending_request is not None:
            self._place(pending_request.metadata.internal_request_id, chosen, reason)
        others = [replica for name, replica in by_name.items() if name != chosen]
        return [[by_name[chosen]], others] if others else [[by_name[chosen]]]

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        placed = self._placed.pop(internal_request_id, None)
        if placed is not None:
            self._ongoing[placed] = max(0, self._ongoing[placed] - 1)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget_replica(replica_id.unique_id)
        self._ongoing.pop(replica_id.unique_id, None)

    def _place(self, request_id: str, replica: str, reason: str) -> None:
        """Count the request on ``replica`` (a retried choice moves it) and its decision once."""
        earlier = self._placed.get(request_id)
        if earlier is not None:
            self._ongoing[earlier] = max(0, self._ongoing[earlier] - 1)
        self._placed[request_id] = replica
        self._ongoing[replica] += 1
        while len(self._placed) > SEEN_REQUESTS:  # completions never reported (should not happen): forget
            self._placed.popitem(last=False)
        if earlier is not None:
            return
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
