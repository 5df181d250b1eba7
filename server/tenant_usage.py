"""What each tenant used: the figures a non-admin key reads at ``/v1/cache/stats``.

Counted in the server as responses complete (the engine's own statistics are
global). One record per tenant, and tenants come from the settings, so the
table is bounded by the configured keys.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class TenantUsage:
    """One tenant's completed generation requests and their prompt, cache and output tokens."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cache_hits: int = 0  # prompt blocks served from the cache
    cache_misses: int = 0  # prompt blocks a lookup could have served but did not


class UsageTable:
    """Per-tenant usage, safe to update from the event loop and read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage: dict[str, TenantUsage] = {}

    def add(self, tenant: str, *, prompt: int, cached: int, completion: int, hits: int, misses: int) -> None:
        with self._lock:
            usage = self._usage.setdefault(tenant, TenantUsage())
            usage.requests += 1
            usage.prompt_tokens += prompt
            usage.cached_tokens += cached
            usage.completion_tokens += completion
            usage.cache_hits += hits
            usage.cache_misses += misses

    def document(self, tenant: str) -> dict[str, Any]:
        """The tenant's ``/v1/cache/stats``: its own counts, with the spec's percent hit rates."""
        with self._lock:
            usage = asdict(self._usage.get(tenant, TenantUsage()))
        blocks = usage["cache_hits"] + usage["cache_misses"]
        return {
            "scope": "tenant",
            "tenant": tenant,
            **usage,
            "hit_rate": round(100 * usage["cache_hits"] / blocks, 2) if blocks else 0.0,
            "token_hit_rate": round(100 * usage["cached_tokens"] / usage["prompt_tokens"], 2)
            if usage["prompt_tokens"]
            else 0.0,
        }
