"""API keys: ``Authorization: Bearer KEY``. Admin routes need an admin key when admin keys are configured.

The guard also records who is calling (``tenants.Caller``) in the request's
scope, so routes scope caches, cache keys, request ids and statistics to the
caller's tenant.
"""

from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from tierserve.server.errors import APIError
from tierserve.server.state import ServerState
from tierserve.server.tenants import CALLER, TenantMap, bearer_token


def tenant_map(state: ServerState) -> TenantMap:
    """The configured keys and their tenants (built once per server)."""
    tenants = state.extras.get("tenants")
    if tenants is None:
        tenants = state.extras["tenants"] = TenantMap(state.settings.auth)
    return tenants  # type: ignore[return-value]


def auth_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Route ``opt``: ``public`` (health/metrics when settings allow; ``page``: the dashboard's static
    files, which hold no data: the page sends the key it is given with each API call), ``admin`` (cache clear/warm)."""
    state: ServerState = connection.app.state.tierserve
    settings = state.settings
    token = bearer_token(connection.headers.get("authorization"))
    caller = tenant_map(state).resolve(token)
    if caller is not None:
        connection.scope.setdefault("state", {})[CALLER] = caller
    opt = handler.opt or {}
    public = opt.get("public")
    if public == "page" or public == "health" and settings.server.public_health or public == "metrics" and settings.server.public_metrics:
        return
    if opt.get("admin") and settings.auth.admin_api_keys:
        if caller is None or not caller.admin:
            status = 401 if caller is None else 403
            raise APIError(status, "this endpoint needs an admin API key (Authorization: Bearer ...)", code="admin_key_required")
        return
    if caller is None:
        message = "missing API key (Authorization: Bearer ...)" if token is None else "invalid API key"
        raise APIError(401, message, code="invalid_api_key")
