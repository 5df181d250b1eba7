"""What the store tells a request about its prompt's prefix lookup (``core.outputs`` carries it to the client)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestCacheInfo:
    """Where one request's prompt came from: the store's accounting of its latest prefix lookup.

    Attributes:
        lookup_blocks: full prompt blocks the lookup could have served (a hit
            never covers the prompt's last token).
        hits: blocks served, per tier name (``"l1"`` first); tiers without hits may be absent.
        cached_tokens: prompt tokens whose KV came from the cache.
        lookup_seconds: time spent finding and loading those blocks.
        windowed: a sliding window bounds the request's KV (streaming mode, or a trained window), so
            its hits are attention states reused across overlapping windows (``window_reuse``).
    """

    lookup_blocks: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0
    lookup_seconds: float = 0.0
    windowed: bool = False

    @property
    def hit_blocks(self) -> int:
        return sum(self.hits.values())
