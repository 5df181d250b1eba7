"""What the app holds: settings, plugins, the engine client (loaded in the background) and readiness."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from tierserve.settings.config import Settings
from tierserve.engine.process import EngineProcessError
from tierserve.core.errors import TierserveError
from tierserve.core.plugins import PluginManager
from tierserve.server.model_registry import ModelRegistry, Target

if TYPE_CHECKING:
    from litestar import Request

    from tierserve.engine import EngineClient

log = structlog.get_logger(__name__)
BODY_REQUEST_ID = "body_request_id"  # ASGI scope state: the request_id a request body gave (echoed in X-Request-Id)


@dataclass
class ServerState:
    settings: Settings
    plugins: PluginManager
    given_engine: EngineClient | None = None  # built by the caller for the single [model] (tests share one)
    ready: bool = False
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)
    active_requests: int = 0
    extras: dict[str, object] = field(default_factory=dict)  # per-concern state (metrics, monitor, ...)
    on_load_failure: Callable[[str], None] | None = None  # told the one-line reason when the model fails to load
    registry: ModelRegistry = field(init=False)

    def __post_init__(self) -> None:
        self.registry = ModelRegistry(self.settings, self.plugins, self.given_engine)

    @property
    def engine(self) -> EngineClient | None:
        """The default model's engine (cache management, health and metrics without a ``model``)."""
        default = self.registry.default
        return default.engine if default is not None else None

    @property
    def model_names(self) -> list[str]:
        """Every name clients may send as ``model``, the default first."""
        return self.registry.names()

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def target(self, model: str | None, *, admit: bool = False) -> Target:
        """The model version (and LoRA adapter) a request's ``model`` selects; 404 for an unknown name."""
        return self.registry.resolve(model, admit=admit)

    async def target_loaded(self, model: str | None, *, admit: bool = False) -> Target:
        """``target``, after loading the version again when ``[registry] unload_idle`` had unloaded it."""
        import asyncio

        from tierserve.server.errors import APIError

        try:
            return self.target(model, admit=admit)
        except APIError as exc:
            if exc.code != "model_unloaded" or not await asyncio.to_thread(self.registry.reload_if_unloaded, model):
                raise
            return self.target(model, admit=admit)

    def load(self) -> None:
        """Build and start every configured model (on a background thread at start-up); ready when done."""
        try:
            self.registry.load_configured()
            if self.engine is not None:
                self.plugins.call_lifecycle("on_startup", self.engine)
            self.ready = True
            log.info("server_ready", model=self.model_name, models=sorted(self.registry.models))
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, (TierserveError, EngineProcessError)):  # the reason is the message; no traceback
                log.error("engine_load_failed", error=self.load_error)
            else:
                log.exception("engine_load_failed")
            if self.on_load_failure is not None:
                self.on_load_failure(self.load_error.splitlines()[0])

    def start_loading(self) -> threading.Thread:
        thread = threading.Thread(target=self.load, name="tierserve-load", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop serving: in-flight requests are aborted (their blocks freed), queued L3 writes flushed."""
        if self.engine is not None:
            self.plugins.call_lifecycle("on_shutdown", self.engine)
        self.registry.close()
        self.ready = False


def state_of(request: Request) -> ServerState:
    return request.app.state.tierserve


def ready_engine(request: Request) -> EngineClient:
    """The engine of the model ``?model=`` names (default: the default model), or a 503 (with Retry-After)
    while it is still loading or its core process restarts. The cache routes manage that model's cache."""
    from tierserve.server.errors import APIError, engine_down

    state = state_of(request)
    model = request.query_params.get("model")
    if model is not None and state.ready:
        return state.target(model).engine
    if not state.ready or state.engine is None:
        message = f"the model failed to load: {state.load_error}" if state.load_error else "the model is still loading"
        if state.ready and not state.load_error:
            message = "no model is loaded (every served model was unloaded); load one with POST /v1/models"
        raise APIError(503, message, code="not_ready", headers={"Retry-After": "5"})
    if not state.engine.alive:
        raise engine_down(state.engine)
    return state.engine
