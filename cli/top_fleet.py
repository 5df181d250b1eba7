"""``tierserve top --fleet``: a fleet's replicas in the terminal, live (the fleet dashboard's figures).

Each frame is one ``GET /v1/fleet/stats`` at the fleet's ingress
(``fleet.fleet_view``): a row per replica (its node, load, prompt-token hit
rate, blocks held, routing decisions), the decisions by reason and the shared
tiers.
"""

from __future__ import annotations

import argparse
from typing import Any

from tierserve.cli.top import CallServer, Frame, heading, integer, millis, plain, size


def read_fleet_frame(call: CallServer, args: argparse.Namespace, frame: Frame, lists: bool = False) -> Frame:
    """A new frame: the fleet document now (``lists`` is unused: a fleet frame has no lists)."""
    return Frame(frame.url, call(args, "GET", "/v1/fleet/stats"))


def blocks_held(replica: dict[str, Any]) -> tuple[int, int]:
    """Blocks the replica holds in L1, and in its private tiers below (position 0 is L1)."""
    held = {int(position): count for position, count in (replica.get("blocks_held") or {}).items()}
    return held.get(0, 0), sum(count for position, count in held.items() if position > 0)


def fleet_hit_rate(replicas: dict[str, dict[str, Any]]) -> float | None:
    """Prompt tokens served from cache over all prompt tokens, the fleet over."""
    cached = sum(r.get("prompt_tokens_cached") or 0 for r in replicas.values())
    computed = sum(r.get("prompt_tokens_computed") or 0 for r in replicas.values())
    return cached / (cached + computed) if cached + computed else None


def percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def decisions_text(decisions: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in sorted(decisions.items(), key=lambda kv: -kv[1])) or "–"


def render_fleet(frame: Frame) -> Any:
    """The frame as a ``rich`` renderable."""
    from rich.console import Group
    from rich.table import Table

    parts = heading(frame, "tierserve top --fleet")
    fleet = frame.stats
    if fleet is None:
        return Group(*parts)
    replicas = fleet.get("replicas") or {}
    live = [r for r in replicas.values() if not r.get("stale")]
    summary = Table("routing", "replicas", "running", "waiting", "prompt-token hit rate", "decisions", title_justify="left")
    summary.add_row(plain(fleet.get("routing", "")), f"{len(live)} live / {len(replicas)}",
                    integer(sum(r.get("requests_running") or 0 for r in live)),
                    integer(sum(r.get("requests_waiting") or 0 for r in live)), percent(fleet_hit_rate(replicas)),
                    plain(decisions_text(fleet.get("routing_decisions") or {})))  # fmt: skip
    parts.append(summary)
    table = Table("replica", "deployment", "node", "running", "waiting", "hit rate", "L1 blocks", "tier blocks",
                  "free / total", "TTFT p50", "decisions", "updated", title="replicas", title_justify="left")  # fmt: skip
    for name, replica in replicas.items():
        l1, lower = blocks_held(replica)
        updated = "stale" if replica.get("stale") else f"{replica.get('seconds_since_update', 0):.1f}s ago"
        free, total = replica.get("free_blocks"), replica.get("total_blocks")
        table.add_row(plain(name), plain(replica.get("deployment", "")), plain((replica.get("node") or "")[:12]),
                      integer(replica.get("requests_running")), integer(replica.get("requests_waiting")),
                      percent(replica.get("hit_rate")), integer(l1), integer(lower), f"{integer(free)} / {integer(total)}",
                      millis(replica.get("ttft_p50")), plain(decisions_text(replica.get("routing_decisions") or {})),
                      updated, style="dim" if replica.get("stale") else None)  # fmt: skip
    parts.append(table)
    shared = fleet.get("shared_tiers") or {}
    if shared:
        tiers = Table("tier", "entries", "bytes", "hits", "misses", "hit rate", "replicas", title="shared tiers", title_justify="left")
        for name, tier in shared.items():
            lookups = tier["hits"] + tier["misses"]
            tiers.add_row(plain(name), integer(tier["entries"]), size(tier["bytes"]), integer(tier["hits"]),
                          integer(tier["misses"]), percent(tier["hits"] / lookups if lookups else None), integer(tier["replicas"]))  # fmt: skip
        parts.append(tiers)
    return Group(*parts)
