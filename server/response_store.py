"""Stored responses of ``/v1/responses`` (``store: true``): bounded, expiring, each readable by its tenant only.

A stored response keeps the whole conversation that led to it (the messages
its prompt was rendered from, its own output last), so a follow-up with
``previous_response_id`` renders the same tokens again and its earlier turns
are a prefix-cache hit.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the Response object as returned
    messages: list[dict[str, Any]]  # chat messages up to and including this response's output
    tenant: str
    stored_at: float


class ResponseStore:
    """At most ``max_entries`` responses, each for ``ttl_seconds`` (the least recently stored go first)."""

    def __init__(self, max_entries: int, ttl_seconds: float | None) -> None:
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._expire()
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The response, if it is stored, not expired and the caller's tenant's."""
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
            return entry if entry is not None and entry.tenant == tenant else None

    def delete(self, response_id: str, tenant: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                return False
            del self._entries[response_id]
            return True

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _expire(self) -> None:
        if not self.ttl_seconds:
            return
        cutoff = time.time() - self.ttl_seconds
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at >= cutoff:
                break
            self._entries.popitem(last=False)
