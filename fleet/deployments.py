"""The fleet's two Ray Serve deployments: engine replicas, each the single server, and one ingress.

    client ─► Ray Serve proxy ─► Ingress ─► handle.forward (router: prefix / cache_key / least loaded)
                                              └► EngineReplica: the tierserve app on a loopback port ─► engine

Each engine replica runs the same Litestar app ``tierserve serve`` runs (its
own engine, tiers and auth), so routes, authentication and errors are the
single server's; the ingress only moves bytes. A request whose replica
dies before it answered is sent again (the router picks a live replica);
a stream cut short by a dying replica ends with an OpenAI-style error event.

With prefill replicas (``[fleet] prefill_replicas``), a generation request
first goes to one of them as the same request for one token: its prompt's
blocks are computed there and written through to the shared tier, and the
replica waits until they are stored; then the request itself goes to a
decode replica, which finds the prompt there (a cache hit) and generates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import httpx
import structlog
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tierserve.fleet.fleet_view import fleet_document
from tierserve.fleet.prefix_affinity import DECIDE_SECONDS, DECISIONS, REPLICA_DECISIONS
from tierserve.fleet.settings_sources import SettingsSources, replica_settings

log = structlog.get_logger(__name__)

# not forwarded: hop-by-hop headers, and those the proxy in front sets itself
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "date", "server"}
)
REPLICA_HEADER = "x-tierserve-replica"
START_ATTEMPTS = 3
REPLICA_GONE = (RayActorError, ActorUnavailableError, BackPressureError, DeploymentUnavailableError)
READY_TIMEOUT_SECONDS = 600.0
# what a prefill replica computes first when the fleet is disaggregated: every route that generates from a prompt
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/cached/completions", "/v1/cached/chat/completions")
# the ingress's own page, by the name after /dashboard/: the fleet's view, not one replica's
FLEET_PAGE = {
    "": ("fleet.html", "text/html; charset=utf-8"),
    "common.js": ("common.js", "text/javascript; charset=utf-8"),
    "fleet.js": ("fleet.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


class EngineReplica:
    """One tierserve server in a Ray Serve replica: uvicorn on a loopback port in a thread of this actor."""

    def __init__(self, sources: SettingsSources, hub: Any | None = None) -> None:
        import uvicorn
        from ray import serve

        from tierserve.server.app import server_config
        from tierserve.settings.logs import configure_logging
        from tierserve.settings.secrets import settings_secrets

        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        rank = getattr(context.rank, "rank", context.rank)
        loaded = replica_settings(sources, f"{context.deployment}-{rank if isinstance(rank, int) else self.name}")
        configure_logging(loaded.settings.logging, secrets=settings_secrets(loaded.settings))
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request otherwise
        self.failure: str | None = None

        def failed(reason: str) -> None:
            self.failure = reason

        self.server = uvicorn.Server(server_config(loaded, on_load_failure=failed))
        self.app = self.server.config.app
        self.thread = threading.Thread(target=self.server.run, name="tierserve-replica-server", daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{loaded.settings.server.port}"
        self._wait_ready()
        # streams hold their connection for the whole generation: no pool bound below the engine's own
        # idle connections closed before uvicorn's 5 s keep-alive ends them: reusing one it is closing is a ReadError
        unbounded = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=None, limits=unbounded)
        self.health_client = httpx.AsyncClient(base_url=self.base_url, timeout=10)  # never queued behind streams
        self.publisher = None
        if hub is not None:  # the fleet's views follow this replica through the hub; kv_events routing too
            import ray

            from tierserve.fleet.kv_hub import EventPublisher
            from tierserve.server.recent import latency_window

            state = self.app.state.tierserve
            where = {"deployment": context.deployment, "node": ray.get_runtime_context().get_node_id()}
            self.publisher = EventPublisher(
                self.name, state.engine, hub, lambda: latency_window(state).document()["ttft_seconds"]["p50"], where
            ).start()
        log.info("fleet_replica_ready", replica=self.name, url=self.base_url)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            if self.failure is not None:
                raise RuntimeError(f"the engine replica failed to load its model: {self.failure}")
            if not self.thread.is_alive():
                raise RuntimeError("the engine replica's server stopped while starting")
            try:
                if httpx.get(self.base_url + "/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine replica was not ready after {READY_TIMEOUT_SECONDS:.0f}s")
            time.sleep(0.5)

    async def forward(self, request: dict[str, Any]):
        """Send one HTTP request to this replica's server; yields the status and headers, then the body."""
        headers = _forwardable(request["headers"])
        outgoing = self.client.build_request(
            request["method"], request["path"], params=request.get("query") or None, headers=headers, content=request["body"]
        )
        response = await self.client.send(outgoing, stream=True)
        try:
            kept = _forwardable(response.headers.raw)
            yield {"status": response.status_code, "headers": [*kept, (REPLICA_HEADER.encode(), self.name.encode())]}
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    async def prefill(self, request: dict[str, Any]) -> dict[str, Any]:
        """Compute the prompt of a generation request (the same request for one token, not streamed) and
        wait until its blocks are in the tiers it writes through to; returns the status and the usage."""
        try:
            body = json.loads(request["body"])
        except ValueError:
            return {"status": 400}
        if not isinstance(body, dict):
            return {"status": 400}
        body.update(max_tokens=1, stream=False, n=1)
        # a named prefix (cache_key) is pinned where the request decodes, not on the replica that only computes it
        for key in ("stream_options", "max_completion_tokens", "min_tokens", "cache_key"):
            body.pop(key, None)
        response = await self.client.post(request["path"], json=body, headers=_forwardable(request["headers"]))
        engine = self.app.state.tierserve.engine
        await asyncio.to_thread(engine.flush_cache)  # the decode replica looks the blocks up next
        usage = response.json().get("usage") if response.status_code == 200 else None
        return {"status": response.status_code, "usage": usage, "replica": self.name}

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine died is replaced."""
        if not self.thread.is_alive():
            raise RuntimeError("the replica's server stopped")
        response = await self.health_client.get("/health")
        if response.status_code != 200:
            raise RuntimeError(f"/health answered {response.status_code}: {response.text[:200]}")

    def __del__(self) -> None:
        if getattr(self, "publisher", None) is not None:
            self.publisher.stop()
        server = getattr(self, "server", None)
        if server is not None:
            server.should_exit = True


class Ingress:
    """The fleet's HTTP entry point: forwards every request to an engine replica and streams the answer."""

    def __init__(self, engine: Any, sources: SettingsSources, prefill: Any | None = None, hub: Any | None = None) -> None:
        self.engine = engine.options(stream=True)
        self.prefill = prefill
        self.hub = hub
        settings = sources.load().settings
        self.routing = settings.fleet.routing
        self.admin_keys = set(settings.auth.admin_api_keys or settings.auth.api_keys)
        self.max_body = settings.server.max_request_bytes

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/v1/fleet/stats":
            return await self._fleet_stats(request)
        if request.method == "GET" and (request.url.path == "/dashboard" or request.url.path.startswith("/dashboard/")):
            return fleet_page(request.url.path)
        forwarded = {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": list(request.headers.raw),  # bytes: any latin-1 value passes as sent
            "body": b"",
        }
        body = bytearray()
        async for chunk in request.stream():  # bounded as the single server bounds it, before anything is held
            body += chunk
            if len(body) > self.max_body:
                message = f"request body: more than server.max_request_bytes = {self.max_body} bytes"
                return _error(413, message, "invalid_request_error")
        forwarded["body"] = bytes(body)
        if self.prefill is not None and request.method == "POST" and forwarded["path"] in GENERATION_PATHS:
            await self._prefill(forwarded)
        for attempt in range(START_ATTEMPTS):
            stream = self.engine.forward.remote(forwarded)
            try:
                head = await stream.__anext__()
                if _event_stream(head):
                    break
                # a whole answer (not a stream) is read before anything is sent, so a replica that dies
                # after its status line but before the last byte costs a retry, not a cut response
                body = b"".join([chunk async for chunk in stream])
                response = Response(body, status_code=head["status"])
                response.raw_headers = [*head["headers"], *response.raw_headers]
                return response
            except REPLICA_GONE as exc:  # the replica died before the client got anything
                log.warning("fleet_request_retried", path=forwarded["path"], attempt=attempt + 1, error=repr(exc))
                if attempt == START_ATTEMPTS - 1:
                    return _error(503, f"no engine replica could take the request: {type(exc).__name__}")
                await asyncio.sleep(0.2 * (attempt + 1))
            except Exception as exc:  # not a replica's death: sending it again would not help
                log.exception("fleet_request_failed", path=forwarded["path"])
                return _error(502, f"the engine replica could not take the request: {type(exc).__name__}", "server_error")
        response = StreamingResponse(_body(stream), status_code=head["status"])
        response.raw_headers = [*head["headers"], *response.raw_headers]  # repeated headers (set-cookie) kept
        return response

    async def _prefill(self, forwarded: dict[str, Any]) -> None:
        """Have a prefill replica compute the prompt into the shared tier; a failure only costs the decode
        replica the prefill (it computes what it does not find), so it is logged, not returned."""
        try:
            done = await self.prefill.prefill.remote(forwarded)
        except Exception as exc:
            log.warning("fleet_prefill_failed", path=forwarded["path"], error=repr(exc))
            return
        if done.get("status") != 200:
            log.info("fleet_prefill_refused", path=forwarded["path"], status=done.get("status"))

    async def _fleet_stats(self, request: Request) -> Response:
        if self.admin_keys:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if given not in self.admin_keys:
                return _error(401, "a valid admin API key is required for /v1/fleet/stats", "authentication_error")
        replicas = await self.hub.summary.remote() if self.hub is not None else {}
        return JSONResponse(fleet_document(self.routing, DECISIONS, REPLICA_DECISIONS, replicas, list(DECIDE_SECONDS)))


def fleet_page(path: str) -> Response:
    """The fleet dashboard's files (``server/dashboard/fleet.*``, polling ``/v1/fleet/stats``): public, as the single
    server's page is, for they hold no figures; the data is behind the admin key."""
    from tierserve.server.dashboard_routes import SECURITY_HEADERS, asset

    name = path.removeprefix("/dashboard").lstrip("/")
    if name not in FLEET_PAGE:
        files = ", ".join(f"/dashboard/{file}".rstrip("/") for file in FLEET_PAGE)
        return _error(404, f"no fleet dashboard file {name!r}; the page's files: {files}", "not_found")
    file, media_type = FLEET_PAGE[name]
    return Response(asset(file), media_type=media_type, headers=SECURITY_HEADERS)


def _event_stream(head: dict[str, Any]) -> bool:
    return any(n.lower() == b"content-type" and b"text/event-stream" in v for n, v in head["headers"])


async def _body(stream: Any):
    """An event stream's chunks as they come; tokens already sent cannot be taken back, so a replica that dies
    mid-stream ends it with an error event instead of silently."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception as exc:
        log.warning("fleet_stream_cut", error=repr(exc))
        error = {"message": f"the engine replica serving this stream stopped: {type(exc).__name__}", "type": "server_error", "code": 502}
        yield f"data: {json.dumps({'error': error})}\n\n".encode()


def _forwardable(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The end-to-end headers, names lower-cased (as ASGI wants them), values as bytes."""
    kept = [(name.lower(), value) for name, value in headers]
    return [(name, value) for name, value in kept if name.decode("latin-1") not in HOP_BY_HOP]


def _error(status: int, message: str, kind: str = "service_unavailable") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)
