"""Stored responses of ``/v1/responses`` (``store: true``): bounded, expiring, each readable by its tenant only.

A stored response keeps the whole conversation that led to it (the messages
its prompt was rendered from, its own output last), so a follow-up with
``previous_response_id`` renders the same tokens again and its earlier turns
are a prefix-cache hit. With a ``directory`` (the persistent L3 folder's
``responses/``) they survive restarts, as the KV of their turns does in L3.

The store is bounded in count and in bytes (each response as stored, JSON). Over a bound the oldest response
of the tenant holding the most goes first, so a tenant that fills the store pushes out its own responses, not
another tenant's. A directory that cannot be read at start (a damaged database) is moved aside, logged, and
the store starts empty; a record of the wrong shape is deleted and logged.
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


def stored_response(record: Any) -> StoredResponse:
    """A record read back from disk, checked field by field.

    Raises:
        ValueError: it is not a StoredResponse as ``put`` writes it (another shape, another type)."""
    fields = json.loads(record) if isinstance(record, (str, bytes)) else record
    if not isinstance(fields, dict) or set(fields) != {"body", "messages", "tenant", "stored_at"}:
        raise ValueError("not a stored response's fields")
    body, messages, tenant, stored_at = fields["body"], fields["messages"], fields["tenant"], fields["stored_at"]
    if not isinstance(body, dict) or not isinstance(tenant, str):
        raise ValueError("body must be an object and tenant a string")
    if isinstance(stored_at, bool) or not isinstance(stored_at, (int, float)) or stored_at != stored_at:
        raise ValueError(f"stored_at must be a time in seconds; got {stored_at!r}")
    if not isinstance(messages, list) or not all(_is_message(m) for m in messages):
        raise ValueError("messages must be chat messages (objects with a string role)")
    return StoredResponse(body, messages, tenant, float(stored_at))


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), (str, list, type(None)))
    )


class ResponseStore:
    """At most ``max_entries`` responses and ``max_bytes`` of them, each for ``ttl_seconds`` (see the module
    docstring for which goes first)."""

    def __init__(
        self, max_entries: int, ttl_seconds: float | None, directory: Path | None = None, max_bytes: int | None = None
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_seconds = ttl_seconds
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._disk = None
        self.damaged_moved_to: Path | None = None
        if directory is not None:
            self._open(directory)

    def _open(self, directory: Path) -> None:
        import diskcache

        try:
            self._disk = diskcache.Cache(str(directory))
            self._load()
        except Exception as exc:  # noqa: BLE001 - sqlite3.DatabaseError and kin: the file is not a database
            if self._disk is not None:
                try:
                    self._disk.close()
                except Exception:  # noqa: BLE001 - already known to be unreadable
                    pass
            self._entries.clear()
            self._sizes.clear()
            self._bytes = 0
            self._disk = None
            aside = directory.with_name(f"{directory.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
            try:
                directory.rename(aside)
                self._disk = diskcache.Cache(str(directory))
            except Exception as error:  # noqa: BLE001 - a read-only folder: this run keeps them in memory
                log.error("stored_responses_unusable", directory=str(directory), error=repr(exc),
                          not_moved=repr(error), action="stored responses kept in memory only this run")  # fmt: skip
                return
            self.damaged_moved_to = aside
            log.warning("stored_responses_damaged", directory=str(directory), error=repr(exc), moved_to=str(aside),
                        action="starting with no stored responses")  # fmt: skip

    def _load(self) -> None:
        """Take the responses a previous run kept; an unreadable one is deleted and logged."""
        found = []
        for key in list(self._disk):
            try:
                record = self._disk.get(key)
                found.append((key, stored_response(record), len(record)))
            except (TypeError, ValueError) as exc:
                log.warning("stored_response_unreadable", response_id=str(key), error=str(exc))
                self._disk.delete(key)
        for key, entry, size in sorted(found, key=lambda item: item[1].stored_at):
            self._entries[key] = entry
            self._sizes[key] = size
            self._bytes += size
        with self._lock:
            self._expire()
            self._bound()
        if found:
            log.info("stored_responses_loaded", responses=len(self._entries))

    def put(self, response_id: str, entry: StoredResponse) -> None:
        record = json.dumps(asdict(entry))
        with self._lock:
            self._expire()
            self._remove(response_id)
            self._entries[response_id] = entry
            self._sizes[response_id] = len(record)
            self._bytes += len(record)
            if self._disk is not None:
                expire = self.ttl_seconds - (time.time() - entry.stored_at) if self.ttl_seconds else None
                self._disk.set(response_id, record, expire=expire)
            self._bound()

    def _bound(self) -> None:
        while self._entries and (
            len(self._entries) > self.max_entries
            or (self.max_bytes is not None and self._bytes > self.max_bytes)
        ):
            self._remove(self._oldest_of_largest_tenant())

    def _oldest_of_largest_tenant(self) -> str:
        held: dict[str, list[int]] = {}
        for key, entry in self._entries.items():
            share = held.setdefault(entry.tenant, [0, 0])
            share[0] += self._sizes[key]
            share[1] += 1
        over_count = len(self._entries) > self.max_entries
        largest = max(held, key=lambda tenant: held[tenant][1] if over_count else held[tenant][0])
        return next(key for key, entry in self._entries.items() if entry.tenant == largest)

    def _remove(self, response_id: str) -> None:
        if self._entries.pop(response_id, None) is None:
            return
        self._bytes -= self._sizes.pop(response_id, 0)
        if self._disk is not None:
            self._disk.delete(response_id)

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
            self._remove(response_id)
            return True

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    @property
    def stored_bytes(self) -> int:
        """The bytes the stored responses take as stored (JSON)."""
        with self._lock:
            return self._bytes

    def _expire(self) -> None:
        if not self.ttl_seconds:
            return
        cutoff = time.time() - self.ttl_seconds
        expired = [key for key, entry in self._entries.items() if entry.stored_at < cutoff]
        for key in expired:
            self._remove(key)
