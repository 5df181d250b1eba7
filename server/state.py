"""What the app holds: settings, plugins, the engine client (loaded in the background) and readiness."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from tierserve.core.config import Settings
from tierserve.core.engine.process import EngineProcessError
from tierserve.core.errors import TierserveError
from tierserve.core.plugins import PluginManager

if TYPE_CHECKING:
    from litestar import Request

    from tierserve.core.engine import EngineClient

log = structlog.get_logger(__name__)
BODY_REQUEST_ID = "body_request_id"  # ASGI scope state: the request_id a request body gave (echoed in X-Request-Id)


@dataclass
class ServerState:
    settings: Settings
    plugins: PluginManager
    engine: EngineClient | None = None
    ready: bool = False
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)
    active_requests: int = 0
    extras: dict[str, object] = field(default_factory=dict)  # per-concern state (metrics, monitor, ...)
    owns_engine: bool = True  # False when the caller passed an engine in (it outlives the app)
    on_load_failure: Callable[[str], None] | None = None  # told the one-line reason when the model fails to load

    @property
    def model_names(self) -> list[str]:
        """Every name clients may send as ``model``, the default first."""
        return self.settings.model.model_names or [self.settings.model.path]

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def resolve_model(self, model: str | None) -> str:
        """The served name a request's ``model`` selects (the default when it sends none); 404 otherwise."""
        from tierserve.server.errors import APIError

        if model is None:
            return self.model_name
        if model in self.model_names or model == self.settings.model.path:
            return model
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {', '.join(repr(n) for n in self.model_names)}",
            param="model",
            code="model_not_found",
        )

    def load(self) -> None:
        """Build and start the engine (on a background thread at start-up); ready when done."""
        from tierserve.core.engine import EngineClient

        try:
            if self.engine is None:
                self.engine = EngineClient.from_settings(self.settings, self.plugins)
            self.engine.start()
            self.plugins.call_lifecycle("on_startup", self.engine)
            self.ready = True
            log.info("server_ready", model=self.model_name)
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
        if self.engine is None:
            return
        self.plugins.call_lifecycle("on_shutdown", self.engine)
        if self.owns_engine:
            self.engine.close()
        else:
            self.engine.shutdown()
        self.ready = False


def state_of(request: Request) -> ServerState:
    return request.app.state.tierserve


def ready_engine(request: Request) -> EngineClient:
    """The engine, or a 503 (with Retry-After) while it is still loading."""
    from tierserve.server.errors import APIError

    state = state_of(request)
    if not state.ready or state.engine is None:
        message = f"the model failed to load: {state.load_error}" if state.load_error else "the model is still loading"
        raise APIError(503, message, code="not_ready", headers={"Retry-After": "5"})
    if not state.engine.alive:
        raise APIError(503, "the engine core is not running; restart the server", code="engine_unavailable")
    return state.engine
