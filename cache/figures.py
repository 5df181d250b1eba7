"""Counters and gauges a plugin's component publishes, beside the built-in statistics.

Every cache tier, scheduler and speculator has a ``figures`` attribute (a
``Figures``, made by its base class). A component declares what it counts
once, in its constructor, and updates it as it works::

    self.rows_read = self.figures.counter("rows_read", "entries read from SQLite")
    self.figures.gauge("database_bytes", "size of the SQLite file", read=lambda: path.stat().st_size)
    ...
    self.rows_read.inc()

The engine reads them with the rest of its statistics (in the engine
process, on its step thread, O(figures)), so they appear in
``/v1/cache/stats`` under ``plugin_figures`` (by plugin, then by tier entry or
component name) and in ``/metrics`` as
``tierserve_plugin_<kind>_<component>_<name>`` (counters end in ``_total``),
labelled with the plugin and the instance. A gauge's ``read`` that raises is
logged and its figure left out of that snapshot.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

FIGURE_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")
KINDS = ("counter", "gauge")


@dataclass(frozen=True, slots=True)
class FigureValue:
    """One figure at a moment: ``kind`` is ``"counter"`` (only grows) or ``"gauge"``."""

    kind: str
    description: str
    value: float


class Counter:
    """A figure that only grows (requests served, rows read)."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.value = 0

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (not negative)."""
        if amount < 0:
            raise ValueError(f"a counter only grows; inc({amount}) is negative")
        self.value += amount


class Gauge:
    """A figure that goes up and down (rows held, bytes on disk): ``set`` it, or give ``read`` to ask at each snapshot."""

    def __init__(self, description: str, read: Callable[[], float] | None = None) -> None:
        self.description = description
        self.value: float = 0
        self.read = read

    def set(self, value: float) -> None:
        self.value = value


class Figures:
    """The counters and gauges one component publishes, by name (``[a-z][a-z0-9_]*``, unique)."""

    def __init__(self) -> None:
        self._figures: dict[str, Counter | Gauge] = {}

    def counter(self, name: str, description: str) -> Counter:
        """Declare a counter called ``name``; returns it, starting at 0."""
        return self._declare(name, Counter(description))

    def gauge(self, name: str, description: str, read: Callable[[], float] | None = None) -> Gauge:
        """Declare a gauge called ``name``; ``read``, if given, is called for its value at every snapshot."""
        return self._declare(name, Gauge(description, read))

    def _declare(self, name: str, figure: Counter | Gauge) -> Counter | Gauge:
        if not isinstance(name, str) or not FIGURE_NAME.fullmatch(name):
            raise ValueError(f"figure name {name!r}: use lowercase letters, digits and _, starting with a letter")
        if name in self._figures:
            raise ValueError(f"figure {name!r} is declared twice")
        if not isinstance(figure.description, str) or not figure.description.strip():
            raise ValueError(f"figure {name!r} needs a description (it is the /metrics help text)")
        self._figures[name] = figure
        return figure

    def __len__(self) -> int:
        return len(self._figures)

    def values(self) -> dict[str, FigureValue]:
        """Every figure's value now; a gauge whose ``read`` raises is logged and left out."""
        values: dict[str, FigureValue] = {}
        for name, figure in self._figures.items():
            kind = "counter" if isinstance(figure, Counter) else "gauge"
            value = figure.value
            if isinstance(figure, Gauge) and figure.read is not None:
                try:
                    value = float(figure.read())
                except Exception:  # noqa: BLE001 - a plugin's callback; its failure costs only this figure
                    log.exception("plugin_figure_failed", figure=name)
                    continue
            values[name] = FigureValue(kind, figure.description, value)
        return values


@dataclass(frozen=True, slots=True)
class FigureSource:
    """A live component's figures and where they come from (the engine keeps one per component that declared any)."""

    plugin: str
    kind: str  # the component kind, as hooks name it: "cache_tier", "scheduler", "speculator"
    component: str  # its registered name
    instance: str  # a tier's [[kv_cache.tiers]] name; else the component name
    figures: Figures

    def read(self) -> FigureGroup:
        return FigureGroup(self.plugin, self.kind, self.component, self.instance, self.figures.values())


@dataclass(frozen=True, slots=True)
class FigureGroup:
    """One component's figures in an engine snapshot (plain data: it crosses to the HTTP process)."""

    plugin: str
    kind: str
    component: str
    instance: str
    values: dict[str, FigureValue]


def figures_document(groups: list[FigureGroup]) -> dict[str, dict[str, dict[str, float]]]:
    """``/v1/cache/stats``' ``plugin_figures``: ``{plugin: {instance: {name: value}}}``."""
    document: dict[str, dict[str, dict[str, float]]] = {}
    for group in groups:
        document.setdefault(group.plugin, {})[group.instance] = {name: v.value for name, v in group.values.items()}
    return document


def metric_name(group: FigureGroup, name: str) -> str:
    """The Prometheus family of one figure: ``tierserve_plugin_<kind>_<component>_<name>``."""
    component = re.sub(r"[^a-z0-9_]", "_", group.component.lower())
    return f"tierserve_plugin_{group.kind}_{component}_{name}"
