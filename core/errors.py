"""Exceptions of the core that carry a message meant for the user."""

from __future__ import annotations


class TierserveError(Exception):
    """Base class of tierserve's user-facing errors."""


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
