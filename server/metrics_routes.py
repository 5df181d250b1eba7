"""``GET /metrics`` (Prometheus text) and the per-request middleware: request ids, access log, HTTP metrics.

Each app has its own ``CollectorRegistry`` (several apps can share a process);
``RequestMetrics`` lives at ``state.extras["metrics"]`` for other route modules
to record latencies, tokens and outcomes. With ``[monitoring] prometheus = false``
there is no registry and no ``/metrics`` route (404, like any unknown path);
request ids and the access log stay.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import structlog
from litestar import Request, Response, get
from litestar.datastructures import MutableScopeHeaders
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tierserve.settings.config import Settings
from tierserve.settings.logs import request_context
from tierserve.engine.metrics import EngineCollector
from tierserve.server.connection import CLIENT_CLOSED
from tierserve.server.state import BODY_REQUEST_ID, ServerState

log = structlog.get_logger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_LENGTH = 128

# Latencies of a CPU test model and of a large GPU model both need to land inside the buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
OUTCOMES = ("success", "abort", "error")


GENERATION_ENDPOINTS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/cached/completions", "/v1/cached/chat/completions"}
)


class RequestMetrics:
    """Request-level metrics in one app's registry; every method is thread-safe."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "tierserve_requests_total", "HTTP requests by route and status", ["endpoint", "status"], registry=registry
        )
        self.request_seconds = Histogram(
            "tierserve_request_seconds", "HTTP request duration (until the last body byte)", ["endpoint"], registry=registry
        )
        self.ttft = Histogram(
            "tierserve_time_to_first_token_seconds", "Time to the first generated token", buckets=TTFT_BUCKETS, registry=registry
        )
        self.tpot = Histogram(
            "tierserve_time_per_output_token_seconds",
            "Time per generated token after the first",
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "tierserve_e2e_request_latency_seconds",
            "Generation request latency, end to end",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter("tierserve_prompt_tokens_total", "Prompt tokens of served requests", registry=registry)
        self.generation_tokens = Counter("tierserve_generation_tokens_total", "Tokens generated", registry=registry)
        self.cached_tokens = Counter(
            "tierserve_cached_prompt_tokens_total", "Prompt tokens served from the KV cache", registry=registry
        )
        self.outcomes = Counter(
            "tierserve_request_outcomes_total", "Generation requests by outcome", ["outcome"], registry=registry
        )
        for outcome in OUTCOMES:  # present from the first scrape, so rate() works from zero
            self.outcomes.labels(outcome)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.request_seconds.labels(endpoint).observe(seconds)
        if status >= 400 and endpoint in GENERATION_ENDPOINTS:
            # rejected before or while generating (validation, limits, queue full, failures), or
            # abandoned by its client: with success this makes requests = successes + aborts + errors
            self.count_outcome("abort" if status == CLIENT_CLOSED else "error")

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def count_tokens(self, prompt: int, generated: int, cached: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.cached_tokens.inc(cached)

    def count_outcome(self, outcome: str) -> None:
        """``outcome`` is one of ``success``, ``abort``, ``error``."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome: got {outcome!r}, allowed: {', '.join(OUTCOMES)}")
        self.outcomes.labels(outcome).inc()


class ServerCollector(Collector):
    """Scrape-time gauges of the server, and the engine's cache metrics once it is ready."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        state = self.state
        engine = state.engine if state.ready and state.engine is not None and state.engine.alive else None
        snapshot = engine.stats() if engine is not None else None
        running = snapshot.requests_running if snapshot is not None else 0
        waiting = snapshot.requests_waiting if snapshot is not None else 0
        yield GaugeMetricFamily("tierserve_requests_running", "Sequences holding KV blocks", value=running)
        yield GaugeMetricFamily("tierserve_requests_waiting", "Sequences queued for a batch slot", value=waiting)
        yield GaugeMetricFamily("tierserve_active_http_requests", "HTTP requests in flight", value=state.active_requests)
        yield GaugeMetricFamily("tierserve_ready", "1 while the model is loaded and its engine runs (as /health/ready)",
                                value=1 if engine is not None else 0)  # fmt: skip
        if snapshot is not None:
            yield from EngineCollector(lambda: snapshot).collect()


def metrics_of(state: ServerState) -> RequestMetrics | None:
    return state.extras.get("metrics")  # type: ignore[return-value]


@get("/metrics", opt={"public": "metrics"}, media_type=CONTENT_TYPE, include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response[bytes]:
    """Prometheus metrics: requests, latencies, tokens, every tier's cache figures and plugins' own (``tierserve_*``)."""
    metrics = metrics_of(request.app.state.tierserve)
    if metrics is None:
        return Response(b"", media_type=CONTENT_TYPE)
    body = generate_latest(metrics.registry)  # reads the published snapshot: never waits for a step
    return Response(body, media_type=CONTENT_TYPE)


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1").strip()
            # echoed in a header and in logs: keep it short and printable
            if 0 < len(text) <= MAX_REQUEST_ID_LENGTH and text.isprintable():
                return text
            return None
    return None


def request_middleware(app: ASGIApp) -> ASGIApp:
    """Request id, in-flight count, one access log line and HTTP metrics per request (streams included)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        state: ServerState = scope["app"].state.tierserve
        started = time.perf_counter()
        status = 500  # if the app fails before sending a response start
        ended: float | None = None

        async def send_wrapper(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                # a body's own request_id (the cached routes) is the one the client knows: echo that
                echoed = scope["state"].get(BODY_REQUEST_ID, request_id)
                MutableScopeHeaders.from_message(message)[REQUEST_ID_HEADER] = echoed
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = time.perf_counter()
            await send(message)

        # probes are not work: a health check must not report itself as an active request
        counted = not scope.get("path", "").startswith("/health")
        with request_context(_incoming_request_id(scope)) as request_id:
            scope.setdefault("state", {})["request_id"] = request_id
            state.active_requests += counted
            try:
                await app(scope, receive, send_wrapper)
            finally:
                state.active_requests -= counted
                seconds = (ended or time.perf_counter()) - started
                path = scope.get("path", "")
                log.info(
                    "http_request",
                    method=scope.get("method"),
                    path=path,
                    status=status,
                    duration_ms=round(seconds * 1000, 2),
                    request_id=request_id,
                    completed=ended is not None,
                )
                metrics = metrics_of(state)
                if metrics is not None:
                    metrics.observe_request(scope.get("path_template") or path, status, seconds)

    return middleware


def setup(state: ServerState) -> None:
    if not state.settings.monitoring.prometheus:
        return
    registry = CollectorRegistry()
    registry.register(ServerCollector(state))
    state.extras["metrics"] = RequestMetrics(registry)


def routes(settings: Settings) -> list[Any]:
    return [metrics_endpoint] if settings.monitoring.prometheus else []


MIDDLEWARE = [request_middleware]
