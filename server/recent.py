"""What the server saw lately: rates over the last minute and the latency of the last requests.

The engine's counters only grow; a rate needs two readings. Every
``/v1/cache/stats`` request and every monitor sample adds a reading, and a
rate is taken between now and the oldest reading of the last
``RATE_WINDOW_SECONDS`` (or the start-up, zero counters, before there is one):
its span is reported with it, so a rate is never older than it says.

    readings: (t0, c0) (t1, c1) ... (tn, cn)   kept: those within the window, plus the newest older one
    rate = (c_now - c_oldest_kept) / (now - t_oldest_kept)

Latencies (time to first token, time per output token) are the server's own
measurements of each completed generation request; the last
``LATENCY_REQUESTS`` are kept and their percentiles reported.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierserve.server.state import ServerState

RATE_WINDOW_SECONDS = 60.0
MAX_READINGS = 600  # a client polling many times a second keeps the deque bounded; rates stay exact
LATENCY_REQUESTS = 1000


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of ``values`` (not empty): the smallest value with at least
    ``fraction`` of them at or below it."""
    ordered = sorted(values)
    rank = max(1, math.ceil(round(len(ordered) * fraction, 9)))  # 100 × 0.99 must be rank 99, not 100
    return ordered[rank - 1]


class RecentRates:
    """Rates of cumulative counters over the last ``window`` seconds, from readings taken when asked."""

    def __init__(self, started_at: float, window: float = RATE_WINDOW_SECONDS) -> None:
        self.window = window
        self._lock = threading.Lock()
        self._readings: deque[tuple[float, dict[str, float]]] = deque(maxlen=MAX_READINGS)
        self._started_at = started_at

    def add(self, counters: dict[str, float], now: float | None = None) -> None:
        """Record the counters' values at ``now`` (``time.time()``)."""
        now = time.time() if now is None else now
        with self._lock:
            self._readings.append((now, dict(counters)))
            while len(self._readings) > 1 and self._readings[1][0] <= now - self.window:
                self._readings.popleft()

    def since(self, counters: dict[str, float], now: float | None = None) -> tuple[float, dict[str, float]]:
        """``(seconds, increases)``: how much each counter grew from the oldest kept reading (the
        start-up, from zero, when none was taken) to ``counters`` now, and over how many seconds."""
        now = time.time() if now is None else now
        with self._lock:
            if self._readings:
                then, old = self._readings[0]
            else:
                then, old = self._started_at, {}
        return max(0.0, now - then), {name: value - old.get(name, 0) for name, value in counters.items()}


class LatencyWindow:
    """The last ``size`` requests' time to first token and time per output token, in seconds."""

    def __init__(self, size: int = LATENCY_REQUESTS) -> None:
        self._lock = threading.Lock()
        self._ttft: deque[float] = deque(maxlen=size)
        self._tpot: deque[float] = deque(maxlen=size)

    def observe(self, ttft: float | None, tpot: float | None) -> None:
        """One completed request: its time to first token (``None``: it produced none) and its
        mean time per output token after the first (``None``: one token or fewer)."""
        with self._lock:
            if ttft is not None:
                self._ttft.append(ttft)
            if tpot is not None:
                self._tpot.append(tpot)

    def document(self) -> dict[str, Any]:
        """``{"requests", "ttft_seconds", "tpot_seconds"}``: p50 and p99 of each (``None`` before any request)."""
        with self._lock:
            ttft, tpot = list(self._ttft), list(self._tpot)

        def summary(values: list[float]) -> dict[str, Any]:
            if not values:
                return {"count": 0, "p50": None, "p99": None}
            return {"count": len(values), "p50": round(percentile(values, 0.5), 6), "p99": round(percentile(values, 0.99), 6)}

        return {"window_requests": self._ttft.maxlen, "ttft_seconds": summary(ttft), "tpot_seconds": summary(tpot)}


def recent_rates(state: ServerState) -> RecentRates:
    """The server's rate readings (made on first use)."""
    rates = state.extras.get("recent_rates")
    if rates is None:
        rates = state.extras["recent_rates"] = RecentRates(state.started_at)
    return rates  # type: ignore[return-value]


def latency_window(state: ServerState) -> LatencyWindow:
    """The server's latency window (made on first use)."""
    window = state.extras.get("latency_window")
    if window is None:
        window = state.extras["latency_window"] = LatencyWindow()
    return window  # type: ignore[return-value]
