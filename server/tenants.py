"""Who is calling: the API key a request carries, resolved to a tenant.

With API keys configured, every key belongs to a tenant, and a tenant is a
cache namespace: its prefixes, named prefixes (``cache_key``) and in-flight
request ids are its own. A key listed under ``[auth.tenants]`` belongs to
that tenant (several keys may share one), a key of ``[auth]
shared_cache_keys`` to the tenant ``shared``; any other key is a tenant of
its own, named by a hash of the key (never the key). Without API keys there
is one tenant, ``""``, and behaviour is as before tenants existed.

    Authorization: Bearer K ─► the configured key K matches ─► Caller(tenant, admin, key_id)
                                no key matches             ─► None (401 unless the API is open)
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierserve.settings.secrets import key_id

if TYPE_CHECKING:
    from tierserve.core.sections import AuthSettings

OPEN_TENANT = ""  # the one tenant of a server without API keys
SHARED_TENANT = "shared"  # the tenant of [auth] shared_cache_keys
CALLER = "caller"  # ASGI scope state: the resolved Caller


@dataclass(frozen=True, slots=True)
class Caller:
    """The resolved identity of a request.

    Attributes:
        tenant: the cache namespace the request lives in (``""`` without API keys).
        admin: an admin key, or a server without API keys (sees every tenant's figures and keys).
        key_id: a stable, non-secret id of the key used (rate limits, logs); ``None`` without a key.
    """

    tenant: str
    admin: bool
    key_id: str | None = None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header: the scheme in any case, any spacing."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class TenantMap:
    """The configured keys, each with its tenant; matching is constant-time per key."""

    def __init__(self, auth: AuthSettings) -> None:
        self.entries: list[tuple[bytes, Caller]] = []  # each key, and who a request with it is
        named = {key: SHARED_TENANT for key in auth.shared_cache_keys}
        named.update({key: tenant for tenant, keys in auth.tenants.items() for key in keys})
        for key in dict.fromkeys([*auth.api_keys, *auth.admin_api_keys, *named]):
            caller = Caller(named.get(key, key_id(key)), key in auth.admin_api_keys, key_id(key))
            self.entries.append((key.encode("utf-8"), caller))

    @property
    def open(self) -> bool:
        """No API keys: every request is let in, as the one tenant."""
        return not self.entries

    def resolve(self, token: str | None) -> Caller | None:
        """The caller a bearer token identifies, or ``None`` (no token, or not a configured key).

        Without API keys every request is the open tenant's admin.
        """
        if self.open:
            return Caller(OPEN_TENANT, admin=True)
        if token is None:
            return None
        # a header is decoded as latin-1: encoding back gives its bytes, whatever they are
        given = token.encode("latin-1", errors="replace")
        found = None
        for key, caller in self.entries:  # every key is compared: the time says nothing of which matched
            if hmac.compare_digest(given, key) and found is None:
                found = caller
        return found


def caller_of(scope: Any) -> Caller:
    """The caller the auth guard resolved for this request (the open tenant if none was)."""
    state = scope.get("state", {}) if isinstance(scope, dict) else {}
    return state.get(CALLER) or Caller(OPEN_TENANT, admin=True)


def cache_scope(tenant: str, cache_salt: str | None) -> str | None:
    """The salt the cache sees: the request's ``cache_salt`` within its tenant.

    The open tenant keeps the bare salt, so caches persisted before tenants
    existed still hit; a tenant's salt is prefixed with its name and a NUL,
    which no tenant name contains, so no salt of one tenant equals another's.
    """
    if tenant == OPEN_TENANT:
        return cache_salt
    return f"{tenant}\x00{cache_salt or ''}"


def split_scope(namespace: str) -> tuple[str, str | None]:
    """``(tenant, cache_salt)`` of a cache scope made by ``cache_scope``."""
    tenant, sep, salt = namespace.partition("\x00")
    if not sep:
        return OPEN_TENANT, namespace or None
    return tenant, salt or None
