"""Stored responses of ``/v1/responses`` (``store: true``): bounded, expiring, each readable by its tenant only.

A stored response keeps the whole conversation that led to it (the messages
its prompt was rendered from, its own output last), so a follow-up with
``previous_response_id`` renders the same tokens again and its earlier turns
are a prefix-cache hit. With a ``directory`` (the persistent L3 folder's
``responses/``) they survive restarts, as the KV of their turns does in L3.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the Response object as returned
    messages: list[dict[str, Any]]  # chat messages up to and including this response's output
    tenant: str
    stored_at: float


class ResponseStore:
    """At most ``max_entries`` responses, each for ``ttl_seconds`` (the least recently stored go first)."""

    def __init__(self, max_entries: int, ttl_seconds: float | None, directory: Path | None = None) -> None:
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()
        self._disk = None
        if directory is not None:
            import diskcache

            self._disk = diskcache.Cache(str(directory))
            self._load()

    def _load(self) -> None:
        """Take the responses a previous run kept; an unreadable one is deleted and logged."""
        found = []
        for key in list(self._disk):
            try:
                found.append((key, StoredResponse(**json.loads(self._disk.get(key)))))
            except (TypeError, ValueError) as exc:
                log.warning("stored_response_unreadable", response_id=str(key), error=str(exc))
                self._disk.delete(key)
        for key, entry in sorted(found, key=lambda item: item[1].stored_at):
            self._entries[key] = entry
        with self._lock:
            self._expire()
            self._bound()
        if found:
            log.info("stored_responses_loaded", responses=len(self._entries))

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._expire()
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            if self._disk is not None:
                expire = self.ttl_seconds - (time.time() - entry.stored_at) if self.ttl_seconds else None
                self._disk.set(response_id, json.dumps(asdict(entry)), expire=expire)
            self._bound()

    def _bound(self) -> None:
        while len(self._entries) > self.max_entries:
            key, _ = self._entries.popitem(last=False)
            if self._disk is not None:
                self._disk.delete(key)

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()

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
            if self._disk is not None:
                self._disk.delete(response_id)
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
            key, _ = self._entries.popitem(last=False)
            if self._disk is not None:
                self._disk.delete(key)
