"""Exceptions of the core that carry a message meant for the user."""

from __future__ import annotations


class TierserveError(Exception):
    """Base class of tierserve's user-facing errors."""


class RequestError(TierserveError, ValueError):
    """A request that cannot be served as asked (the server answers 400).

    Attributes:
        message: what is wrong and what is allowed, led by the field's name.
        param: the request field at fault (``"max_tokens"``, ``"prompt"``, ...), or ``None``.
        code: a machine-readable reason (``"invalid_value"``, ``"context_length_exceeded"``).
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self):  # param and code survive the pipe from an engine core process
        return (_rebuild_request_error, (type(self), self.message, self.param, self.code))


def _rebuild_request_error(cls: type[RequestError], message: str, param: str | None, code: str) -> RequestError:
    return cls(message, param=param, code=code)


class EngineFault(TierserveError, RuntimeError):
    """The engine ended a request because code it runs (a scheduler or backend plugin) raised; the message names
    the plugin. The HTTP API answers it with a 500 (a stream: an error event)."""


class QueueFullError(TierserveError, RuntimeError):
    """The waiting queue is at ``max_waiting_requests``; the server answers 503 + Retry-After."""


class RequestTimeoutError(TierserveError, TimeoutError):
    """A request ran past its deadline (``server.timeout_seconds``); it was aborted and its blocks freed."""


class ConfigError(TierserveError):
    """Settings could not be loaded; the message names the key, value and source."""


class DuplicateComponentError(TierserveError):
    """Two plugins registered the same component name for one kind."""


class UnknownComponentError(TierserveError):
    """A component name that no plugin registered.

    Attributes:
        kind: the registry kind, e.g. ``"eviction policy"``.
        name: the name that was asked for.
        available: the registered names, sorted.
        suggestion: the closest registered name, or ``None``.
    """

    def __init__(self, kind: str, name: str, available: list[str], suggestion: str | None) -> None:
        self.kind = kind
        self.name = name
        self.available = available
        self.suggestion = suggestion
        listing = ", ".join(available) if available else "(none registered)"
        message = f"unknown {kind} {name!r}; available: {listing}"
        if suggestion:
            message += f"; did you mean {suggestion!r}?"
        super().__init__(message)
