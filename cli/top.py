"""``tierserve top``: a running server's cache in the terminal, live (the figures of ``/dashboard``, from the same API);
``--fleet``: a fleet's replicas (``cli.top_fleet``).

Each frame is one ``GET /v1/cache/stats``; the most used prefixes and the
named prefixes (``/v1/cache/prefixes``, ``/v1/cache/keys``: they walk the
server's index) are read every ``LISTS_EVERY`` frames. ``--once`` prints one
frame and exits (scripts, and terminals without cursor control).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tierserve.core.errors import TierserveError

CallServer = Callable[..., Any]
LISTS_EVERY = 5
TOP_ROWS = 5
SPARKS = "▁▂▃▄▅▆▇█"
ONCE_WIDTH = 160  # columns of a frame printed to a pipe or a file (no terminal to measure)
TREND_POINTS = 24  # the newest samples a sparkline shows


@dataclass(slots=True)
class Frame:
    """What one frame shows: the stats document, and the lists (``None`` until read, or when refused)."""

    url: str
    stats: dict[str, Any] | None = None
    prefixes: list[dict[str, Any]] | None = None
    keys: list[dict[str, Any]] | None = None
    error: str | None = None
    notes: tuple[str, ...] = ()


def integer(value: float | None) -> str:
    return "–" if value is None else f"{round(value):,}"


def size(value: float | None) -> str:
    """Bytes in binary units, as the page shows them."""
    if value is None:
        return "–"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    unit = 0
    while value >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    return f"{int(value)} B" if unit == 0 else f"{value:.1f} {units[unit]}"


def millis(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{1000 * seconds:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def of_capacity(used: str, capacity: float | None, fmt: Callable[[float | None], str], fraction: float | None) -> str:
    if capacity is None:  # no bound of this kind (a disk tier counts bytes, not blocks)
        return used
    share = f" {100 * fraction:.0f}%" if fraction is not None else ""
    return f"{used} / {fmt(capacity)}{share}"


def sparkline(values: list[float], top: float = 1.0) -> str:
    """Fractions of ``top`` as block characters, oldest first."""
    steps = len(SPARKS) - 1
    return "".join(SPARKS[max(0, min(steps, round(steps * v / top)))] for v in values) if top else ""


def read_frame(call: CallServer, args: argparse.Namespace, frame: Frame, lists: bool) -> Frame:
    """A new frame: the stats now, and the lists when ``lists`` (else the previous frame's)."""
    stats = call(args, "GET", "/v1/cache/stats")
    new = Frame(frame.url, stats, frame.prefixes, frame.keys)
    if lists and stats.get("scope") != "tenant":
        notes = []
        for path, field in (("/v1/cache/prefixes?limit=10", "prefixes"), ("/v1/cache/keys", "keys")):
            try:
                setattr(new, field, call(args, "GET", path)["data"])
            except TierserveError as exc:
                notes.append(str(exc))
        new.notes = tuple(notes)
    else:
        new.notes = frame.notes
    return new


def heading(frame: Frame, command: str) -> list[Any]:
    """A frame's first lines: the command, the server, the time, and why the figures are old if they are."""
    from rich.text import Text

    stamp = datetime.now().strftime("%H:%M:%S")
    parts: list[Any] = [Text.assemble((command, "bold"), f"  {frame.url}  ", (f"updated {stamp}", "dim"))]
    if frame.error:
        parts.append(Text(frame.error, style="red"))
    return parts


def render(frame: Frame) -> Any:
    """The frame as a ``rich`` renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = heading(frame, "tierserve top")
    stats = frame.stats
    if stats is None:
        return Group(*parts)
    if stats.get("scope") == "tenant":
        parts.append(Text("This key is not an admin key: your tenant's usage. The cache figures need the admin key.", style="yellow"))
        table = Table("requests", "prompt tokens", "cached tokens", "completion tokens", "block hit rate", "token hit rate",
                      title=plain(f"tenant {stats['tenant'] or '(open)'}"), title_justify="left")  # fmt: skip
        table.add_row(integer(stats["requests"]), integer(stats["prompt_tokens"]), integer(stats["cached_tokens"]),
                      integer(stats["completion_tokens"]), f"{stats['hit_rate']:.1f}%", f"{stats['token_hit_rate']:.1f}%")  # fmt: skip
        parts.append(table)
        return Group(*parts)
    parts += [figures_table(stats), tiers_table(stats), alerts_text(stats)]
    if frame.prefixes is not None:
        parts.append(prefixes_table(frame.prefixes))
    if frame.keys is not None:
        parts.append(keys_table(frame.keys))
    parts += [Text(note, style="dim") for note in frame.notes]
    return Group(*parts)


def figures_table(stats: dict[str, Any]) -> Any:
    from rich.table import Table

    overall, recent, latency = stats["overall"], stats["recent"], stats["latency"]
    kv, spec = stats["cache_manager"]["kv_cache"], stats["cache_manager"]["speculation"]
    table = Table(title="now", title_justify="left")
    row = {
        "running": integer(overall["requests_running"]),
        "waiting": integer(overall["requests_waiting"]),
        f"tokens/s ({round(recent['seconds'])} s)": f"{recent['generation_tokens_per_second']:.1f}",
        "TTFT p50": millis(latency["ttft_seconds"]["p50"]),
        "TTFT p99": millis(latency["ttft_seconds"]["p99"]),
        "spec. acceptance": f"{100 * spec['acceptance_rate']:.1f}%" if spec["enabled"] or spec["proposed"] else "off",
        "block hit rate": f"{kv['hit_rate']:.1f}%",
        "alerts": str(len(stats["alerts"])),
    }
    for name in row:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_row(*row.values())
    return table


def plain(text: str) -> Any:
    """A server-provided string (a cache key, a tenant, a tier name) as literal text: rich never reads it as
    markup, so a name like ``[/x]`` neither breaks the view nor styles it."""
    from rich.text import Text

    return Text(text)


def tiers_table(stats: dict[str, Any]) -> Any:
    from rich.table import Table

    tiers = stats["cache_manager"]["kv_cache"]["tiers"]
    recent = stats["recent"]
    points = [p for p in stats["trend_points"] if "tiers" in p]
    table = Table(title="tiers", title_justify="left")
    for name, justify in (("tier", "left"), ("medium", "left"), ("blocks held", "right"), ("bytes", "right"),
                          ("hit rate", "right"), ("hits", "right"), ("evictions", "right"),
                          (f"evicted {round(recent['seconds'])} s", "right")):  # fmt: skip
        table.add_column(name, justify=justify, no_wrap=True, min_width=len(name))  # type: ignore[arg-type]
    table.add_column("hit rate over time", no_wrap=True, overflow="crop", max_width=TREND_POINTS)  # gives way first
    for name, tier in tiers.items():
        entries_of = tier["entries"] / tier["capacity_entries"] if tier["capacity_entries"] else None
        bytes_of = tier["bytes"] / tier["capacity_bytes"] if tier["capacity_bytes"] else None
        trend = [p["tiers"][name]["hit_rate"] for p in points if name in p["tiers"]] + [tier["hit_rate"]]
        table.add_row(
            plain(name.upper()),
            plain(tier["medium"]),
            of_capacity(integer(tier["entries"]), tier["capacity_entries"], integer, entries_of),
            of_capacity(size(tier["bytes"]), tier["capacity_bytes"], size, bytes_of),
            f"{100 * tier['hit_rate']:.1f}%",
            integer(tier["hits"]),
            integer(tier["evictions"]),
            integer(recent["evictions"].get(name, 0)),
            sparkline(trend[-TREND_POINTS:]),
        )
    return table


def alerts_text(stats: dict[str, Any]) -> Any:
    from rich.text import Text

    if not stats["alerts"]:
        return Text("no alert", style="green")
    return Text("\n".join(f"ALERT {a['name']}: {a['message']}" for a in stats["alerts"]), style="red")


def prefixes_table(prefixes: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table("prefix (last block)", "hits", "tokens", "tiers", "cache key", title="top prefixes by hits", title_justify="left")
    for prefix in prefixes[:TOP_ROWS]:
        table.add_row(plain(prefix["key"][:12] + "…"), integer(prefix["hits"]), integer(prefix["tokens"]),
                      plain("+".join(t.upper() for t in prefix["tiers"])), plain(prefix["cache_key"] or ""))  # fmt: skip
    return table


def keys_table(keys: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table("cache key", "tenant", "hits", "requests", "tokens", title="top cache keys by hits", title_justify="left")
    for key in sorted(keys, key=lambda k: (-k["hits"], -k["requests"]))[:TOP_ROWS]:
        table.add_row(plain(key["id"]), plain(key["tenant"] or ""), integer(key["hits"]), integer(key["requests"]),
                      integer(key["prefix_tokens"]))  # fmt: skip
    return table


def add_top_command(commands: Any, add_server_arguments: Callable[[argparse.ArgumentParser], None], call: CallServer) -> None:
    """The ``top`` command; ``call(args, method, path)`` does one JSON request."""

    def cmd_top(args: argparse.Namespace) -> int:
        from rich.console import Console
        from rich.live import Live

        from tierserve.cli.main import server_url

        if args.interval <= 0:
            raise TierserveError(f"--interval: got {args.interval}; allowed: a number of seconds above 0")
        read, draw = read_frame, render
        if args.fleet:
            from tierserve.cli.top_fleet import read_fleet_frame, render_fleet

            read, draw = read_fleet_frame, render_fleet
        frame = read(call, args, Frame(server_url(args)), lists=True)
        if args.once:
            console = Console()
            if not console.is_terminal:
                console = Console(width=ONCE_WIDTH)
            console.print(draw(frame))
            return 0
        frames = 1
        try:
            with Live(draw(frame), auto_refresh=False, screen=False) as live:
                while True:
                    time.sleep(args.interval)
                    try:
                        frame = read(call, args, frame, lists=frames % LISTS_EVERY == 0)
                        frame.error = None
                    except TierserveError as exc:  # a restart or a blip: keep the last figures, say why they are old
                        frame.error = f"not updated: {exc}"
                    frames += 1
                    live.update(draw(frame), refresh=True)
        except KeyboardInterrupt:
            return 0

    top = commands.add_parser("top", help="a running server's cache, live in the terminal (the /dashboard figures)")
    add_server_arguments(top)
    top.add_argument("--interval", type=float, default=2.0, help="seconds between frames (default: 2)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--fleet", action="store_true",
                     help="a fleet's replicas, load, hit rates and routing (/v1/fleet/stats at `tierserve fleet`'s address)")
    top.set_defaults(handler=cmd_top)
