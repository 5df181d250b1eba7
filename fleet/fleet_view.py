"""The ``/v1/fleet/stats`` document: each replica as the hub sees it, the ingress's routing decisions, the shared tiers.

    hub.summary()  (per replica: blocks held, free blocks, TTFT p50, its latest report)
      + the ingress's routing decisions (in total and per replica)
      ─► fleet_document ─► /v1/fleet/stats ─► the fleet dashboard, ``tierserve top --fleet``

A tier on a ``remote`` medium (Redis) is one store every replica reads: its
entries and bytes are the largest any replica last saw, its hits and misses
the sum of the replicas' own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tierserve.server.recent import percentile


def fleet_document(
    routing: str,
    decisions: Mapping[str, int],
    replica_decisions: Mapping[str, Mapping[str, int]],
    replicas: Mapping[str, dict[str, Any]],
    decide_seconds: Sequence[float] = (),
) -> dict[str, Any]:
    """The document: ``routing`` (``fleet.routing``), ``routing_decisions`` (reason -> requests), ``routing_seconds``
    (what the router's latest decisions took: how many, p50, p99, max), ``replicas`` (name -> the hub's summary of it,
    with ``routing_decisions`` of its own), ``shared_tiers`` (name -> figures)."""
    listed = {
        name: {**state, "routing_decisions": dict(replica_decisions.get(name, {}))} for name, state in sorted(replicas.items())
    }
    return {
        "routing": routing,
        "routing_decisions": dict(decisions),
        "routing_seconds": decision_times(decide_seconds),
        "replicas": listed,
        "shared_tiers": shared_tiers(listed.values()),
    }


def decision_times(seconds: Sequence[float]) -> dict[str, Any]:
    """How long the router took to decide, over its latest decisions (a request may be decided more than once:
    Ray asks again when a chosen replica cannot take it)."""
    if not seconds:
        return {"decisions": 0, "p50": None, "p99": None, "max": None}
    values = list(seconds)
    return {
        "decisions": len(values),
        "p50": round(percentile(values, 0.5), 6),
        "p99": round(percentile(values, 0.99), 6),
        "max": round(max(values), 6),
    }


def shared_tiers(replicas: Any) -> dict[str, dict[str, int]]:
    """The tiers every replica shares (``remote`` medium), merged over the replicas' reports (module docstring)."""
    merged: dict[str, dict[str, int]] = {}
    for state in replicas:
        if state.get("stale"):
            continue
        for name, tier in (state.get("tiers") or {}).items():
            if tier.get("medium") != "remote":
                continue
            figures = merged.setdefault(name, {"entries": 0, "bytes": 0, "hits": 0, "misses": 0, "replicas": 0})
            figures["entries"] = max(figures["entries"], tier["entries"])
            figures["bytes"] = max(figures["bytes"], tier["bytes"])
            figures["hits"] += tier["hits"]
            figures["misses"] += tier["misses"]
            figures["replicas"] += 1
    return merged
