"""Secrets in settings (API keys) and keeping them out of every log line and settings dump.

A key is shown as its ``key_id`` (a short hash) wherever it must be named.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierserve.core.sections import AuthSettings, Settings

REDACTED = "[redacted]"


def key_id(key: str) -> str:
    """A short id of an API key that reveals nothing of it."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def auth_secrets(auth: AuthSettings) -> list[str]:
    """Every API key the settings hold (user, admin, tenants', shared)."""
    keys = [*auth.api_keys, *auth.admin_api_keys, *auth.shared_cache_keys]
    keys += [key for tenant_keys in auth.tenants.values() for key in tenant_keys]
    return [key for key in dict.fromkeys(keys) if key]


def settings_secrets(settings: Settings) -> list[str]:
    """Every secret the settings hold: the API keys, and what each cache tier's own settings name
    through a ``secrets()`` method (a remote tier's password)."""
    secrets = auth_secrets(settings.auth)
    for tier in settings.kv_cache.tiers:
        named = getattr(tier.options, "secrets", None)
        if callable(named):
            secrets.extend(named())
    return secrets


def redact_auth(values: dict[str, Any]) -> dict[str, Any]:
    """``[auth]`` as dumped (``model_dump``) with each key replaced by ``[redacted key-…]``."""

    def hide(keys: list[str]) -> list[str]:
        return [f"{REDACTED} {key_id(key)}" for key in keys]

    out = dict(values)
    for name in ("api_keys", "admin_api_keys", "shared_cache_keys"):
        if name in out:
            out[name] = hide(out[name])
    if "tenants" in out:
        out["tenants"] = {tenant: hide(keys) for tenant, keys in out["tenants"].items()}
    return out


class SecretScrubber:
    """A structlog processor: every configured secret in the event (or the rendered line) becomes ``[redacted]``.

    Runs last, after rendering, so it also covers tracebacks and messages of
    exceptions. Secrets shorter than 4 characters are not scrubbed (they would
    blank out ordinary text): real keys are far longer.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        # longest first, so a key containing another is replaced whole
        self.secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def scrub(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text

    def __call__(self, logger: Any, method: str, event: Any) -> Any:
        if not self.secrets:
            return event
        if isinstance(event, str):
            return self.scrub(event)
        if isinstance(event, bytes):
            return self.scrub(event.decode("utf-8", errors="replace")).encode("utf-8")
        if isinstance(event, dict):
            return {key: self._value(value) for key, value in event.items()}
        return event

    def _value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {k: self._value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._value(v) for v in value]
        return value
