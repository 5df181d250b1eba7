"""Which replica should take a request: an approximate index of the prompt prefixes sent to each one.

The router cannot see the replicas' block hashes cheaply, so it keeps what
SGLang's router and Ray Serve's prefix-affinity router keep: a record of
what it sent where. A prompt is cut into chunks of ``CHUNK_CHARS``
characters (token-id prompts: ``CHUNK_TOKENS`` ids), each chunk's key is
chained to the previous one's, and the replica that last received the
longest chain of a new prompt's keys is the one most likely to hold its KV.
A request naming a ``cache_key`` goes where that key went before (its
pinned prefix lives there). Keys are rooted in a hash of the caller's
``Authorization`` header, as the replicas' block hashes are rooted in the
tenant's salt, so two tenants' prompts never attract each other.

    route_key(request) ─► RouteKey(cache_key, chunk keys)
    PrefixAffinity.prefer(key, live replicas) ─► (replica, "cache_key" | "prefix") or (None, "no_match")
    PrefixAffinity.record(key, replica)          after the request is routed
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CHUNK_CHARS = 64
CHUNK_TOKENS = 16
KEY_BYTES = 12

# Routing decisions of this process's routers, by reason (the ingress serves them at /v1/fleet/stats).
DECISIONS: Counter[str] = Counter()  # cache_key, prefix, overloaded, no_match, unparsed
REPLICA_DECISIONS: defaultdict[str, Counter[str]] = defaultdict(Counter)  # replica -> the same, of its requests
DECIDE_SECONDS: deque[float] = deque(maxlen=4096)  # what the latest routing decisions took in the router, each


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What routing looks at: the request's ``cache_key`` (with its tenant) and its prompt's chunk keys."""

    cache_key: str | None = None
    chunks: tuple[bytes, ...] = field(default=())


def prompt_text(body: Mapping[str, Any]) -> str | list[int] | None:
    """The prompt of an OpenAI-style request body as text (chat: each message's role and content),
    or token ids; None when the body carries none."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, Mapping):
                parts.append(f"{message.get('role', '')}\x1f{_content_text(message.get('content'))}\x1e")
        return "".join(parts)
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: the first prompt decides
    if isinstance(prompt, list) and prompt and all(isinstance(item, int) for item in prompt):
        return prompt
    return prompt if isinstance(prompt, str) else None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return ""


def route_key(headers: Mapping[str, str], body: bytes) -> RouteKey | None:
    """The routing key of one HTTP request (``headers`` with lower-case names); None when the body
    is not a JSON object with a prompt (the request then goes to the least loaded replica)."""
    try:
        parsed = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(parsed, dict):
        return None
    tenant = hashlib.blake2b(headers.get("authorization", "").encode(), digest_size=KEY_BYTES).digest()
    cache_key = parsed.get("cache_key")
    named = f"{tenant.hex()}:{parsed.get('cache_namespace', '')}:{cache_key}" if isinstance(cache_key, str) else None
    prompt = prompt_text(parsed)
    if prompt is None:
        return RouteKey(named) if named else None
    return RouteKey(named, chunk_keys(prompt, tenant))


def chunk_keys(prompt: str | list[int], root: bytes) -> tuple[bytes, ...]:
    """Chained keys of the prompt's full chunks (a partial last chunk is left out, as a partial block is)."""
    size = CHUNK_TOKENS if isinstance(prompt, list) else CHUNK_CHARS
    keys, parent = [], root
    for start in range(0, len(prompt) - size + 1, size):
        piece = prompt[start : start + size]
        data = piece.encode() if isinstance(piece, str) else b",".join(str(t).encode() for t in piece)
        parent = hashlib.blake2b(parent + data, digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return tuple(keys)


class PrefixAffinity:
    """What was sent where, bounded: at most ``max_chunks`` chunk keys and ``max_cache_keys`` named
    keys, least recently used forgotten first. Not thread-safe (one router, one event loop)."""

    def __init__(self, max_chunks: int = 200_000, max_cache_keys: int = 10_000) -> None:
        self.max_chunks = max_chunks
        self.max_cache_keys = max_cache_keys
        self._chunks: OrderedDict[bytes, str] = OrderedDict()  # chunk key -> the replica that last got it
        self._named: OrderedDict[str, str] = OrderedDict()  # cache_key -> replica

    def prefer(self, key: RouteKey | None, replicas: Iterable[str]) -> tuple[str | None, str, int]:
        """The replica to prefer among the live ``replicas``, the reason, and how many chunks it matched."""
        if key is None:
            return None, "unparsed", 0
        live = set(replicas)
        if key.cache_key is not None:
            owner = self._named.get(key.cache_key)
            if owner in live:
                return owner, "cache_key", 0
        best, matched = None, 0
        for chunk in key.chunks:
            owner = self._chunks.get(chunk)
            if owner not in live:
                break
            best, matched = owner, matched + 1
        return (best, "prefix", matched) if best is not None else (None, "no_match", 0)

    def record(self, key: RouteKey | None, replica: str) -> None:
        """``key``'s request went to ``replica``: its prefix (and cache_key) now point there."""
        if key is None:
            return
        if key.cache_key is not None:
            self._named[key.cache_key] = replica
            self._named.move_to_end(key.cache_key)
            while len(self._named) > self.max_cache_keys:
                self._named.popitem(last=False)
        for chunk in key.chunks:
            self._chunks[chunk] = replica
            self._chunks.move_to_end(chunk)
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)

    def forget_replica(self, replica: str) -> None:
        """A replica died or was removed: nothing of its prefixes is left to route to."""
        for table in (self._chunks, self._named):
            for name in [name for name, owner in table.items() if owner == replica]:
                del table[name]

    def __len__(self) -> int:
        return len(self._chunks)


def choose(
    preferred: str | None, ongoing: Mapping[str, int], max_imbalance: int, pick: Callable[[list[str]], str]
) -> tuple[str, bool]:
    """The replica to send to, and whether it is the preferred one.

    The preferred replica keeps the request while it has at most ``max_imbalance`` more ongoing
    requests than the least loaded replica (as SGLang's router balances); otherwise the least loaded
    replica takes it (``pick`` breaks ties).
    """
    shortest = min(ongoing.values())
    if preferred is not None and preferred in ongoing and ongoing[preferred] - shortest <= max_imbalance:
        return preferred, True
    return pick([name for name, count in ongoing.items() if count == shortest]), False
