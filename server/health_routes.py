"""Health probes: ``/health`` (what is loaded, memory, load errors), ``/health/ready`` and ``/health/live``."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

from litestar import Request, Response, get

from tierserve.core import __version__
from tierserve.server.state import ServerState, ready_engine, state_of

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
    if state.load_error:
        status = "failed"
    else:
        status = "ready" if state.ready else "loading"
    if engine is not None:
        tiers = list(engine.store.tier_names) if engine.store is not None else []
    else:  # not built yet: what the settings ask for
        kv = settings.kv_cache
        tiers = ["l1"] if kv.enable_prefix_caching else []
        tiers += ["l2"] if tiers and kv.l2_capacity > 0 and kv.max_memory_bytes > 0 else []
        tiers += ["l3"] if tiers and kv.disk_path else []
    return {
        "engine": status,
        "backend": settings.model.backend,
        "scheduler": settings.scheduler.name,
        "cache_tiers": tiers,
        "load_error": state.load_error,
    }


@get("/health", opt=HEALTH)
async def health(request: Request) -> Response[dict[str, Any]]:
    """200 while ``ok`` or ``loading``; 503 once loading failed (a restart with fixed settings is needed)."""
    state = state_of(request)
    engine = state.engine
    parts = components(state)
    status = {"ready": "ok", "loading": "loading", "failed": "error"}[parts["engine"]]
    body = {
        "status": status,
        "timestamp": round(time.time(), 3),
        "version": __version__,
        "uptime_seconds": round(time.time() - state.started_at, 3),
        "memory": {
            "rss_bytes": rss_bytes(),
            "kv_blocks_total": engine.pool.num_blocks if engine is not None else 0,
            "kv_blocks_free": engine.pool.num_free_blocks if engine is not None else 0,
        },
        "active_requests": state.active_requests,
        "components": parts,
    }
    return Response(body, status_code=503 if status == "error" else 200)


@get("/health/ready", opt=HEALTH)
async def health_ready(request: Request) -> dict[str, str]:
    ready_engine(request)
    return {"status": "ready"}


@get("/health/live", opt=HEALTH)
async def health_live() -> dict[str, str]:
    return {"status": "alive"}


ROUTES = [health, health_ready, health_live]
