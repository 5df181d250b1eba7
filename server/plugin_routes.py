"""``GET /v1/plugins``: the loaded plugins and what they registered, as ``tierserve plugins --json`` prints them."""

from __future__ import annotations

from typing import Any

from litestar import Request, get

from tierserve.server.state import state_of


@get("/v1/plugins")
async def list_plugins(request: Request) -> dict[str, list[dict[str, Any]]]:
    """The loaded plugins, their components and settings keys, and the plugins that failed to load with the reason."""
    return state_of(request).plugins.as_dict()


ROUTES = [list_plugins]
