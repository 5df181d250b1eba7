"""API keys: ``Authorization: Bearer KEY``. Admin routes need an admin key when admin keys are configured."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from tierserve.server.errors import APIError


def _bearer(connection: ASGIConnection) -> str | None:
    header = connection.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str | None, keys: list[str]) -> bool:
    return token is not None and any(hmac.compare_digest(token, key) for key in keys)


def auth_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Route ``opt``: ``public`` (health/metrics when settings allow), ``admin`` (cache clear/warm)."""
    settings = connection.app.state.tierserve.settings
    opt = handler.opt or {}
    public = opt.get("public")
    if public == "health" and settings.server.public_health or public == "metrics" and settings.server.public_metrics:
        return
    auth = settings.auth
    token = _bearer(connection)
    if opt.get("admin") and auth.admin_api_keys:
        if not _matches(token, auth.admin_api_keys):
            status = 401 if token is None else 403
            raise APIError(status, "this endpoint needs an admin API key (Authorization: Bearer ...)", code="admin_key_required")
        return
    keys = auth.api_keys + auth.admin_api_keys
    if keys and not _matches(token, keys):
        message = "missing API key (Authorization: Bearer ...)" if token is None else "invalid API key"
        raise APIError(401, message, code="invalid_api_key")
