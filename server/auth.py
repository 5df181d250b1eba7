"""API keys: ``Authorization: Bearer KEY``. Once any key is configured, admin routes need an admin key: with
tenant keys and no ``auth.admin_api_keys`` they are refused (403), so no tenant can act on another's caches or the
server's models. ``/metrics`` is public while no key is configured and private once one is, unless
``server.public_metrics`` says otherwise.

The guard also records who is calling (``tenants.Caller``) in the request's
scope, so routes scope caches, cache keys, request ids and statistics to the
caller's tenant.
"""

from __future__ import annotations

import structlog
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from tierserve.server.errors import APIError
from tierserve.server.state import ServerState
from tierserve.server.tenants import CALLER, TenantMap, bearer_token
from tierserve.settings.config import Settings

log = structlog.get_logger(__name__)


def tenant_map(state: ServerState) -> TenantMap:
    """The configured keys and their tenants (built once per server)."""
    tenants = state.extras.get("tenants")
    if tenants is None:
        tenants = state.extras["tenants"] = TenantMap(state.settings.auth)
    return tenants  # type: ignore[return-value]


def warn_about_admin_keys(settings: Settings) -> None:
    """Say at start-up that admin routes will be refused: tenant keys are configured, admin keys are not."""
    auth = settings.auth
    if (auth.api_keys or auth.tenants or auth.shared_cache_keys) and not auth.admin_api_keys:
        log.warning("admin_routes_refused", why="API keys are configured but auth.admin_api_keys is empty",
                    effect="cache management, model and LoRA loading answer 403 until an admin key is listed")  # fmt: skip


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
    keys = not tenant_map(state).open
    metrics_public = settings.server.public_metrics if settings.server.public_metrics is not None else not keys
    if public == "page" or public == "health" and settings.server.public_health or public == "metrics" and metrics_public:
        return
    if opt.get("admin") and keys:
        if not settings.auth.admin_api_keys:
            raise APIError(403, "admin endpoints are refused: API keys are configured but no admin key; list the keys "
                           "that may manage caches and models in auth.admin_api_keys", code="admin_key_required")  # fmt: skip
        if caller is None or not caller.admin:
            status = 401 if caller is None else 403
            raise APIError(status, "this endpoint needs an admin API key (Authorization: Bearer ...)", code="admin_key_required")
        return
    if caller is None:
        message = "missing API key (Authorization: Bearer ...)" if token is None else "invalid API key"
        raise APIError(401, message, code="invalid_api_key")
