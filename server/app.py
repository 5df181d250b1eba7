"""``create_app(settings)``: the Litestar app, composed from route modules grouped by concern.

Each module in ``ROUTE_MODULES`` exposes ``ROUTES`` (Litestar handlers), or
``routes(settings)`` where settings decide which exist, and may expose
``MIDDLEWARE`` and ``setup(state)`` / ``teardown(state)`` for its own background work; plugins add handlers through the ``register_routes`` hook. The engine is
built on a background thread at start-up, so ``/health/live`` answers at once
and ``/health/ready`` turns 200 when the model is loaded and warmed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from litestar import Litestar
from litestar.middleware.rate_limit import RateLimitConfig
from litestar.openapi import OpenAPIConfig

from tierserve.core import __version__
from tierserve.settings.config import LoadedSettings, Settings
from tierserve.core.plugins import PluginManager, load_plugins
from tierserve.server.auth import auth_guard, tenant_map, warn_about_admin_keys
from tierserve.server.errors import EXCEPTION_HANDLERS
from tierserve.server.json_body import check_json_body
from tierserve.server.state import ServerState
from tierserve.server.tenants import bearer_token

if TYPE_CHECKING:
    import uvicorn

ROUTE_MODULES: tuple[str, ...] = (
    "tierserve.server.openai_routes",
    "tierserve.server.model_routes",
    "tierserve.server.responses_routes",
    "tierserve.server.embedding_routes",
    "tierserve.server.tokenizer_routes",
    "tierserve.server.cache_routes",
    "tierserve.server.health_routes",
    "tierserve.server.metrics_routes",
    "tierserve.server.plugin_routes",
    "tierserve.server.dashboard_routes",
)


def _rate_limit_identity(request) -> str:
    """The bucket of a request: its API key (however the header is spelled), else its client address."""
    caller = tenant_map(request.app.state.tierserve).resolve(bearer_token(request.headers.get("authorization")))
    if caller is not None and caller.key_id is not None:
        return caller.key_id
    return request.client.host if request.client else "unknown"


def create_app(
    settings: Settings | LoadedSettings,
    *,
    engine: Any | None = None,
    plugins: PluginManager | None = None,
    load_in_background: bool = True,
    on_load_failure: Callable[[str], None] | None = None,
) -> Litestar:
    """Build the app. ``engine`` may be given (tests share one); otherwise it is built from ``settings``.

    ``on_load_failure`` is called with the one-line reason when the model fails to load
    (``tierserve serve`` then stops the server and exits non-zero); without it the app stays
    up and reports the failure on ``/health/ready`` and with 503s.
    """
    if isinstance(settings, LoadedSettings):
        plugins = plugins or settings.plugins
        settings = settings.settings
    plugins = plugins or load_plugins()
    warn_about_admin_keys(settings)
    state = ServerState(
        settings=settings, plugins=plugins, given_engine=engine, on_load_failure=on_load_failure
    )
    modules = [importlib.import_module(name) for name in ROUTE_MODULES]
    handlers: list[Any] = []
    for module in modules:
        handlers += module.routes(settings) if hasattr(module, "routes") else module.ROUTES
    handlers += [component.factory for component in plugins.registry("routes")]

    def on_startup(app: Litestar) -> None:
        app.state.tierserve = state
        for module in modules:
            if hasattr(module, "setup"):
                module.setup(state)
        if load_in_background:
            state.start_loading()
        else:
            state.load()

    def on_shutdown(app: Litestar) -> None:
        for module in modules:
            if hasattr(module, "teardown"):
                module.teardown(state)
        state.close()

    middleware: list[Any] = [m for module in modules for m in getattr(module, "MIDDLEWARE", [])]
    if settings.server.rate_limit_per_minute:
        limit = RateLimitConfig(
            rate_limit=("minute", settings.server.rate_limit_per_minute),
            identifier_for_request=_rate_limit_identity,
            exclude=[r"^/health(/|$)", r"^/metrics$"],  # regexes, searched: anchored, or /v1/models/health skips
        )
        middleware.append(limit.middleware)

    app = Litestar(
        route_handlers=handlers,
        on_startup=[on_startup],
        on_shutdown=[on_shutdown],
        guards=[auth_guard],
        before_request=check_json_body,
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=middleware,
        request_max_body_size=settings.server.max_request_bytes,
        openapi_config=OpenAPIConfig(title="tierserve", version=__version__, path="/docs", use_handler_docstrings=True),
        debug=False,
        logging_config=None,  # tierserve.settings.logs configures logging; Litestar must not replace it
    )
    app.state.tierserve = state
    return app


def server_config(loaded: LoadedSettings, on_load_failure: Callable[[str], None] | None = None) -> uvicorn.Config:
    """What ``tierserve serve`` runs: the app on ``[server] host`` and ``port``; at shutdown, requests
    in flight get ``shutdown_grace_seconds`` to finish before they are cancelled. ``on_load_failure``:
    see ``create_app``."""
    import uvicorn

    from tierserve.server.http_protocol import timed_protocol

    server = loaded.settings.server
    return uvicorn.Config(
        create_app(loaded, on_load_failure=on_load_failure),
        host=server.host,
        port=server.port,
        http=timed_protocol(server.header_timeout_seconds, server.body_timeout_seconds),
        limit_concurrency=server.max_connections,
        log_config=None,  # uvicorn's loggers go through tierserve's structlog handler
        access_log=False,  # tierserve logs each request itself, with its request id and timings
        timeout_graceful_shutdown=server.shutdown_grace_seconds,  # type: ignore[arg-type]  # a float is what it waits
    )
