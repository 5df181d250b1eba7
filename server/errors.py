"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, never a traceback.

400 or 501: a value that is invalid, contradicts another field, or asks for what this server's settings or
model cannot do is a 400 (``APIError``); a valid request naming a feature tierserve deliberately does not
build (``best_of > 1``, fill-in-the-middle) is a 501 (``NotImplementedFeature``).
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from tierserve.engine import EngineClient, RequestError
from tierserve.engine.process import EngineProcessError
from tierserve.core.errors import EngineFault
from tierserve.core.scheduler import QueueFullError

log = structlog.get_logger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error response; raise it from any handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class NotImplementedFeature(APIError):
    """A recognised field or value that tierserve deliberately does not build: a 501, code ``not_implemented``.

    The message reads ``"{param}: got {value}; {feature} is not implemented here; supported: {supported}"``.
    It is no ``ValueError``, so pydantic passes it through unchanged: raise it from a
    ``model_validator(mode="after")``, which runs once every field is valid, so an invalid value is still the 400.
    ``x-should-retry: false`` tells OpenAI's clients, which retry any 5xx, that sending it again will not help.
    """

    def __init__(self, param: str, value: Any, feature: str, supported: str) -> None:
        shown = json.dumps(value, default=str)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        message = f"{param}: got {shown}; {feature} is not implemented here; supported: {supported}"
        super().__init__(501, message, param=param, code="not_implemented", headers={"x-should-retry": "false"})


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param=None, code=None, headers=None) -> Response:
    return Response(error_body(status, message, param, code), status_code=status, headers=headers or {})


def handle_api_error(_: Request, exc: APIError) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


def handle_request_error(_: Request, exc: RequestError) -> Response:
    return error_response(400, exc.message, exc.param, exc.code)


def timeout_body(timeout: float | None) -> dict[str, Any]:
    """The error a request past ``server.timeout_seconds`` gets (its blocks are already freed)."""
    message = (
        f"the request ran past server.timeout_seconds ({timeout:g} s) and was stopped; its KV blocks were freed. "
        "Ask for fewer tokens, or raise server.timeout_seconds"
    )
    return error_body(504, message, None, "timeout")


def engine_gone_body(exc: EngineProcessError) -> dict[str, Any]:
    """The 503 of a request the engine core process cannot serve: ``retryable`` says whether sending it again
    helps (the core is being restarted: ``code`` ``engine_restarting``) or not until the server is restarted."""
    body = error_body(503, str(exc), None, exc.code)
    body["error"]["retryable"] = exc.retry_after is not None
    return body


def handle_engine_gone(_: Request, exc: EngineProcessError) -> Response:
    headers = {}  # the supervisor logged the death and what it does about it
    if exc.retry_after is not None:
        headers = {"Retry-After": str(exc.retry_after), "x-should-retry": "true"}
    return Response(engine_gone_body(exc), status_code=503, headers=headers)


def engine_down(engine: EngineClient) -> Exception:
    """Why ``engine`` takes no request (its ``alive`` is false): a core process being restarted or given up
    (``EngineProcessError``), or a core thread that stopped."""
    supervision = engine.supervision()
    if supervision is not None:
        return supervision.error()
    return APIError(503, "the engine core is not running; restart the server", code="engine_unavailable")


def handle_engine_fault(_: Request, exc: EngineFault) -> Response:
    return error_response(500, str(exc), None, "engine_fault")


def handle_queue_full(request: Request, exc: QueueFullError) -> Response:
    retry = str(request.app.state.tierserve.settings.server.retry_after_seconds)
    return error_response(503, str(exc), None, "queue_full", {"Retry-After": retry})


def handle_validation(_: Request, exc: ValidationException) -> Response:
    details = exc.extra if isinstance(exc.extra, list) else []
    param = None
    parts = []
    for item in details:
        if isinstance(item, dict):
            key = item.get("key")
            param = param or key
            parts.append(f"{key}: {item.get('message')}" if key else str(item.get("message")))
    message = "; ".join(parts) or exc.detail or "invalid request"
    return error_response(400, message, param, "invalid_request")


def handle_http(_: Request, exc: HTTPException) -> Response:
    headers = dict(exc.headers or {})
    return error_response(exc.status_code, exc.detail or "error", None, None, headers)


def handle_internal(request: Request, exc: Exception) -> Response:
    log.exception("request_failed", path=request.url.path)
    return error_response(500, "internal server error; the server logged the details", None, "internal_error")


EXCEPTION_HANDLERS = {
    APIError: handle_api_error,
    RequestError: handle_request_error,
    EngineProcessError: handle_engine_gone,
    EngineFault: handle_engine_fault,
    QueueFullError: handle_queue_full,
    ValidationException: handle_validation,
    HTTPException: handle_http,
    Exception: handle_internal,
}
