"""Health probes: ``/health`` (what is loaded, memory, load errors, engine restarts), ``/health/ready`` and
``/health/live``."""

from __future__ import annotations

import resource
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from litestar import Request, Response, get

from tierserve.core import __version__
from tierserve.engine.process import EngineProcessError
from tierserve.server.errors import engine_down
from tierserve.server.state import ServerState, ready_engine, state_of

if TYPE_CHECKING:
    from tierserve.engine import EngineSnapshot
    from tierserve.engine.supervisor import SupervisorStatus

HEALTH = {"public": "health"}


def rss_bytes() -> int:
    """Resident memory now (Linux), else the peak (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def components(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    settings = engine.settings if engine is not None else state.settings
    error = state.load_error
    restarting = False
    if engine is not None and state.ready and not engine.alive:
        down = engine_down(engine)
        error = str(down)
        restarting = isinstance(down, EngineProcessError) and down.retry_after is not None
    elif state.ready and not error and not state.registry.servable():
        error = "no model is loaded (every served model was unloaded); load one with POST /v1/models"
    if restarting:
        status = "restarting"
    elif error:
        status = "failed"
    else:
        status = "ready" if state.ready else "loading"
    if engine is not None:
        tiers = list(engine.info.tier_names)
    else:  # not built yet: what the settings ask for
        kv = settings.kv_cache
        tiers = ["l1", *(tier.name for tier in kv.tiers)] if kv.enable_prefix_caching else []
    return {
        "engine": status,
        "attention_kernel": engine.info.attention_kernel if engine is not None else None,
        "linear_kernel": engine.info.linear_kernel if engine is not None else None,
        "quantization": settings.model.quantization,
        "kv_dtype": engine.info.kv_dtype if engine is not None else None,
        "backend": engine.info.backend if engine is not None else settings.model.backend,
        "scheduler": settings.scheduler.name,
        "cache_tiers": tiers,
        "load_error": error,
        # every loaded version's status (the figures above are the default model's)
        "models": state.registry.statuses(),
    }


def cache_system_status(state: ServerState, snapshot: EngineSnapshot | None) -> str:
    """``operational``; ``disabled`` (prefix caching off); ``degraded`` (a tier failed writes, found
    corrupt entries, rebuilt a corrupt index, lost its remote server or raised: it still answers);
    ``loading``/``failed`` with the engine."""
    if snapshot is None:
        return "failed" if state.load_error else "loading"
    if snapshot.cache is None:
        return "disabled"
    tiers = snapshot.cache.tiers.values()
    faults = (t.write_errors or t.corrupt or t.corrupt_indexes or t.connection_errors or t.errors for t in tiers)
    return "degraded" if any(faults) else "operational"


def restarts_document(supervision: SupervisorStatus | None) -> dict[str, Any] | None:
    """The engine core process's restarts (``None``: the core runs in the server process)."""
    if supervision is None:
        return None
    at = supervision.last_exit_at
    return {
        "count": supervision.restarts,
        "max_in_a_row": supervision.max_restarts,
        "in_a_row": supervision.attempt,
        "state": supervision.state,
        "engine_pid": supervision.pid,
        "last_exit_reason": supervision.last_exit_reason,
        "last_exit_code": supervision.last_exit_code,
        "last_exit_at": None if at is None else iso_time(at),
        "failure": supervision.failure,
    }


def iso_time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


@get("/health", opt=HEALTH, sync_to_thread=False)
def health(request: Request) -> Response[dict[str, Any]]:
    """``healthy`` (200), ``loading`` (200), ``restarting`` (503: the engine core process died and is being
    started again) or ``unhealthy`` (503: loading failed, or the engine core died and is not restarted).
    ``details.restarts`` counts the core process's restarts and tells its last exit.

    A cheap probe: it reads what the engine last published and counts nothing,
    itself included, as an active request.
    """
    state = state_of(request)
    engine = state.engine
    snapshot = engine.stats() if engine is not None and state.ready and engine.alive else None
    parts = components(state)
    status = {"ready": "healthy", "failed": "unhealthy"}.get(parts["engine"], parts["engine"])  # or loading, restarting
    runtime = {"ready": "operational"}.get(parts["engine"], parts["engine"])  # or loading, restarting, failed
    memory = rss_bytes()
    body = {
        "status": status,
        "timestamp": iso_time(time.time()),
        "version": __version__,
        "uptime_seconds": round(time.time() - state.started_at, 3),
        "details": {
            "memory_usage_bytes": memory,
            "active_requests": state.active_requests,
            "restarts": restarts_document(engine.supervision() if engine is not None else None),
            "components": {
                "inference_runtime": runtime,
                "model_registry": runtime,
                "cache_system": cache_system_status(state, snapshot),
            },
        },
        "memory": {
            "rss_bytes": memory,
            "kv_blocks_total": snapshot.kv_blocks_total if snapshot is not None else 0,
            "kv_blocks_free": snapshot.kv_blocks_free if snapshot is not None else 0,
        },
        "active_requests": state.active_requests,
        "components": parts,
    }
    return Response(body, status_code=503 if status in ("unhealthy", "restarting") else 200)


@get("/health/ready", opt=HEALTH)
async def health_ready(request: Request) -> dict[str, str]:
    """200 once the model is loaded and its engine runs (a readiness probe), else 503."""
    ready_engine(request)
    return {"status": "ready"}


@get("/health/live", opt=HEALTH)
async def health_live() -> dict[str, str]:
    """200 while the server process answers (a liveness probe)."""
    return {"status": "alive"}


ROUTES = [health, health_ready, health_live]
