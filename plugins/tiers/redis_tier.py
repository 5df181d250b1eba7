"""A shared remote tier: KV blocks in a Redis (or Valkey) server that several tierserve processes use; registers "redis".

Values are the L3 codec's bytes (checked header, blake2b checksum, zstd), so
an entry written by one process is verified by every reader: a damaged,
truncated or foreign value is deleted and reads as a miss. Keys are
``{key_prefix}:kv:{model id}:{block hash}``: the model id is a hash of the
model fingerprint, and the block hash chain is rooted in the fingerprint,
the block size and the tenant's ``cache_salt`` (``cache.hashing``), so no
entry is ever shared across models, block layouts or tenants.

    put ──► bounded queue (full: drop, count) ──► writer thread: EXISTS? refresh TTL : encode, SET PX ttl
    get ──► queued? ──► server reachable? ──► GET ──► decode (corrupt: DEL, miss)

The server owns eviction (``maxmemory`` with ``allkeys-lru`` is the setting
to use) and expiry (each key's TTL is what ``ttl_seconds`` leaves of it since the entry's ``created``, as
every tier counts it; an entry already older is not written); this tier
neither pins nor bounds what the server keeps. What this process wrote or
read is remembered (``max_index_entries`` at most, oldest forgotten first)
for the store's index and statistics; entries other processes wrote are
found because the store asks a ``shared`` tier on every lookup.

A server that is down, slow or refusing costs misses and counted errors
(``connection_errors``), never a failed request: after a failed command the
tier skips the server for ``retry_seconds`` (lookups miss, writes are
dropped and counted) and then tries again, logging the outage once and the
recovery once.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from tierserve.cache.codec import CorruptEntryError, KVCodec
from tierserve.cache.tier import CacheEntry, CacheTier, WriteTally
from tierserve.cache.write_queue import QueuedTier, TierWriter
from tierserve.core.errors import TierserveError
from tierserve.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from tierserve.cache.eviction import EvictionPolicy
    from tierserve.core.tier_settings import TierSettings

log = structlog.get_logger(__name__)

URL_SCHEMES = ("redis", "rediss", "unix")
SCAN_BATCH = 1000
FAILED = object()  # what ``_command`` returns when the server was skipped or the command failed


class RedisTierSettings(BaseModel):
    """A ``plugin = "redis"`` tier's own keys in its ``[[kv_cache.tiers]]`` entry."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="the server: redis://host:port/db, rediss:// (TLS) or unix:///path.sock; no password in it",
    )
    username: str | None = Field(None, description="ACL user name (Redis 6+), if the server asks for one")
    password: SecretStr | None = Field(None, description="the server's password (never logged or shown)")
    password_env: str | None = Field(
        None, description="name of an environment variable holding the password, instead of password"
    )
    key_prefix: str = Field("tierserve", pattern=r"^[A-Za-z0-9_.:-]+$", description="start of every key written")
    compression_level: int = Field(3, ge=1, le=22, description="zstd level")
    write_queue: int = Field(256, gt=0, description="pending writes before new ones are dropped")
    write_batch: int = Field(
        64, ge=1, le=1024, description="queued writes sent together: two pipelined round trips per batch"
    )
    writer_nice: int = Field(10, ge=0, le=19, description="added to the writer thread's niceness")
    max_connections: int = Field(8, ge=1, description="connections in the pool (the step thread and the writer)")
    timeout_seconds: float = Field(0.25, gt=0, description="for connecting and for each command")
    retry_seconds: float = Field(
        2.0, ge=0, description="after a failed command, the server is skipped (misses, dropped writes) this long"
    )
    max_index_entries: int = Field(1_000_000, gt=0, description="keys this process remembers for index and stats")

    @model_validator(mode="after")
    def _check(self) -> RedisTierSettings:
        parts = urlsplit(self.url)
        if parts.scheme not in URL_SCHEMES:
            raise ValueError(f"url: scheme {parts.scheme!r} is not one of {', '.join(URL_SCHEMES)}")
        if parts.password is not None or "password" in parse_qs(parts.query):
            raise ValueError(
                "url: holds a password; give it as password or password_env, so it never appears "
                "in logs or `tierserve config show`"
            )
        if self.password is not None and self.password_env:
            raise ValueError("password and password_env: set one of them, not both")
        return self

    def resolved_password(self) -> str | None:
        """The password to send: ``password``, or the variable ``password_env`` names (a ConfigError if unset)."""
        if self.password is not None:
            return self.password.get_secret_value()
        if not self.password_env:
            return None
        value = os.environ.get(self.password_env)
        if value is None:
            raise TierserveError(f"password_env: the environment variable {self.password_env!r} is not set")
        return value

    def secrets(self) -> list[str]:
        """Values that must never reach a log (the logging set-up scrubs them)."""
        try:
            password = self.resolved_password()
        except TierserveError:
            return []
        return [password] if password else []


@dataclass(slots=True)
class Known:
    """An entry this process wrote or read: enough for the store's index and the statistics."""

    parent: bytes | None
    stored: int  # bytes of the encoded value
    raw: int  # bytes of its tensor
    accesses: int = 0
    expires: float | None = None  # time.time() by which the server's TTL has surely ended


def model_id(fingerprint: str) -> str:
    """A short, fixed-length id of the model fingerprint for key names."""
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def redacted_url(url: str) -> str:
    """``url`` without credentials, for logs (a user name is kept, a password never is)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


class RedisTier(QueuedTier, CacheTier):
    """KV blocks in a Redis server shared by every process configured with the same url and key prefix.

    ``put`` only enqueues; one writer thread checks whether the key is there
    (then only its TTL is refreshed: another process wrote the same bytes),
    encodes and writes. ``get`` of a queued key answers from the queue.
    Pins and holds are accepted and ignored: the server evicts by its own
    ``maxmemory-policy``, so the store keeps named prefixes pinned in the
    local tiers. ``clear`` deletes this model's keys on the server, for every
    process that shares it.
    """

    name = "redis"
    medium = "remote"
    shared = True

    def __init__(
        self, tier: TierSettings, policy_factory: Callable[[int], EvictionPolicy], fingerprint: str
    ) -> None:
        super().__init__()
        options = tier.options_as(RedisTierSettings)
        self.tier_name = tier.name
        self.url = redacted_url(options.url)
        self.ttl_ms = int(tier.ttl_seconds * 1000) if tier.ttl_seconds else None
        self.retry_seconds = options.retry_seconds
        self.max_known = options.max_index_entries
        self.codec = KVCodec(fingerprint, options.compression_level)
        self.namespace = f"{options.key_prefix}:kv:{model_id(fingerprint)}:"
        self.client = _connect(options, tier.name)
        self._known: OrderedDict[bytes, Known] = OrderedDict()  # oldest first
        self._down_until = 0.0  # monotonic time before which the server is skipped
        self._down = False
        self._closed = False
        self._writer = TierWriter(
            self.lock,
            options.write_queue,
            options.writer_nice,
            None,  # every write goes through write_many, one entry or a batch
            self._lose,
            lambda: None,
            thread_name="tierserve-redis-writer",
            event_prefix="kv_redis",
            write_many=self._write_many,
            batch=options.write_batch,
        )
        self._pending = self._writer.pending
        self._stored = self._known
        self._check_server()
        self._writer.start()

    # ---- CacheTier ---------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self.lock:
            return key in self._pending or self._live(key) is not None

    def remove(self, key: bytes) -> None:
        with self.lock:
            self._pending.pop(key, None)
            self._forget(key)
        self._command(lambda: self.client.delete(self._redis_key(key)))

    def clear(self) -> int:
        """Delete this model's entries on the server (for every process sharing it); returns how many."""
        with self.lock:
            known = len(set(self._known) | self._pending.keys())
            self._pending.clear()
            for key in list(self._known):
                self._forget(key)
        deleted = self._command(self._delete_namespace)
        return known if deleted is FAILED else deleted

    @property
    def bytes_used(self) -> int:
        return self.stats.stored_bytes

    def add_accesses(self, key: bytes, count: int) -> None:
        with self.lock:
            record = self._pending.get(key) or self._known.get(key)
            if record is not None:
                record.accesses = max(0, record.accesses + count)

    def pin(self, key: bytes) -> None:
        """Ignored: the server evicts by its own policy (named prefixes stay pinned in the local tiers)."""

    def unpin(self, key: bytes) -> None:
        """Ignored, as ``pin`` is."""

    def hold(self, key: bytes) -> None:
        """Ignored, as ``pin`` is."""

    def flush(self, timeout: float | None = None) -> None:
        """Wait until queued writes are on the server (or dropped)."""
        self._writer.wait(timeout)

    def close(self) -> None:
        """Write what is queued, stop the writer and close the connections; later puts are dropped."""
        if self._stop_writes():
            self.client.close()
            self.client.connection_pool.disconnect()  # a client given a pool leaves it open

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless the remembered entries and the byte counters agree."""
        with self.lock:
            stored = sum(known.stored for known in self._known.values())
            raw = sum(known.raw for known in self._known.values())
            if (stored, raw) != (self.stats.stored_bytes, self.stats.raw_bytes):
                raise AssertionError(f"{self.name} tier: byte counters differ from the remembered entries")

    # ---- the server ----------------------------------------------------------

    def _redis_key(self, key: bytes) -> str:
        return self.namespace + key.hex()

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _command(self, run: Callable[[], Any]) -> Any:
        """``run()`` against the server, or ``FAILED`` when it is skipped or fails (counted, logged once per outage)."""
        import redis

        if not self._available():
            return FAILED
        try:
            result = run()
        except redis.ResponseError as exc:  # the server answered: out of memory, wrong type, ...
            with self.lock:
                self.stats.write_errors += 1
            log.warning("kv_redis_command_refused", tier=self.tier_name, url=self.url, error=str(exc))
            return FAILED
        except (redis.RedisError, OSError) as exc:  # unreachable, timed out, or a reply that is not Redis's
            self._failed(exc)
            return FAILED
        self._recovered()
        return result

    def _failed(self, exc: BaseException) -> None:
        with self.lock:
            self.stats.connection_errors += 1
            self._down_until = time.monotonic() + self.retry_seconds
            first = not self._down
            self._down = True
        if first:
            log.warning(
                "kv_redis_unavailable",
                tier=self.tier_name,
                url=self.url,
                error=repr(exc),
                action=f"lookups miss and writes are dropped; retrying after {self.retry_seconds}s",
            )

    def _recovered(self) -> None:
        with self.lock:
            was_down, self._down = self._down, False
        if was_down:
            log.info("kv_redis_reconnected", tier=self.tier_name, url=self.url)

    def _check_server(self) -> None:
        """Reach the server once at start (a failure is logged; the tier starts skipping it), and say
        when its eviction policy would refuse writes when full rather than evict."""
        import redis

        try:
            config = self.client.config_get("maxmemory*")
        except redis.ResponseError:  # CONFIG disabled (managed services): PING says whether it is reachable
            self._command(self.client.ping)
            return
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return
        if config.get("maxmemory", "0") != "0" and config.get("maxmemory-policy") == "noeviction":
            log.warning(
                "kv_redis_noeviction",
                tier=self.tier_name,
                url=self.url,
                hint="with maxmemory set, writes fail once the server is full; use maxmemory-policy allkeys-lru",
            )

    def _delete_namespace(self) -> int:
        deleted = 0
        batch: list[bytes] = []
        for name in self.client.scan_iter(match=self.namespace + "*", count=SCAN_BATCH):
            batch.append(name)
            if len(batch) >= SCAN_BATCH:
                deleted += self.client.unlink(*batch)
                batch.clear()
        if batch:
            deleted += self.client.unlink(*batch)
        return deleted

    # ---- reading -------------------------------------------------------------

    def _lookup(self, key: bytes) -> CacheEntry | None:
        with self.lock:
            pending = self._pending.get(key)
            if pending is not None:
                pending.accesses += 1
                return replace(pending, accesses=0)  # a new record around the queued tensor
        data = self._command(lambda: self.client.get(self._redis_key(key)))
        return self._decoded(key, data)

    def _lookup_many(self, keys: list[bytes]) -> list[CacheEntry]:
        """The keys still queued here from memory, the others in one MGET round trip; decoded in order up to the
        first miss (nothing after it is decoded, counted or touched)."""
        with self.lock:
            pending = {key: self._pending[key] for key in keys if key in self._pending}
        asked = [key for key in keys if key not in pending]
        values: dict[bytes, object] = {}
        if asked:
            answer = self._command(lambda: self.client.mget([self._redis_key(key) for key in asked]))
            values = dict(zip(asked, [FAILED] * len(asked) if answer is FAILED else answer))
        found: list[CacheEntry] = []
        for key in keys:
            queued = pending.get(key)
            if queued is not None:
                with self.lock:
                    queued.accesses += 1
                found.append(replace(queued, accesses=0))  # a new record around the queued tensor
                continue
            entry = self._decoded(key, values[key])
            if entry is None:
                break
            found.append(entry)
        return found

    def _decoded(self, key: bytes, data: object) -> CacheEntry | None:
        """The entry a GET answered (``FAILED``: the server could not be reached; not bytes: gone)."""
        if data is FAILED:
            return None
        if not isinstance(data, bytes):  # the server answered: gone (evicted, expired or never written)
            with self.lock:
                self._forget(key, removed=True)
            return None
        try:
            entry = self.codec.decode(data, expected_key=key)
        except CorruptEntryError as exc:
            with self.lock:
                self.stats.corrupt += 1
                self._forget(key, removed=True)
            log.warning("kv_redis_corrupt_entry", tier=self.tier_name, key=key.hex(), reason=str(exc))
            self._command(lambda: self.client.delete(self._redis_key(key)))
            return None
        with self.lock:
            known = self._known.get(key)
            accesses = known.accesses if known is not None else 0
            expires = entry.created + self.ttl_ms / 1000 if self.ttl_ms is not None else None
            self._remember(key, Known(entry.parent, len(data), entry.nbytes, accesses + 1, expires))
        return entry

    # ---- writing -------------------------------------------------------------

    def _put(self, entry: CacheEntry, tally: WriteTally | None = None, deadline: float = 0.0) -> None:
        start = time.perf_counter()
        with self.lock:
            self.stats.puts += 1
            key = entry.key
            known = self._live(key)
            if known is not None and key not in self._pending:
                known.accesses += entry.accesses
                if tally is not None:
                    tally.written += 1
            elif self._remaining_ms(entry) == 0:  # older than ttl_seconds already: it would be expired on arrival
                self.stats.expirations += 1
                self.note_removed(key)
                if tally is not None:
                    tally.dropped += 1
            elif self._closed or not self._available():
                self.stats.dropped_writes += 1
                if tally is not None:
                    tally.dropped += 1
            else:
                if tally is not None:
                    self._writer.wait_for_room(deadline)  # releases the lock while it waits
                earlier = self._pending.get(key)
                if self._closed:  # closed while it waited: the writer has stopped
                    self.stats.dropped_writes += 1
                    if tally is not None:
                        tally.dropped += 1
                elif self._writer.submit(entry, tally):
                    entry.accesses += earlier.accesses if earlier else 0
                else:
                    self.stats.dropped_writes += 1
                    log.debug("kv_redis_write_dropped", key=key.hex(), reason="write queue full")
                    if tally is not None:
                        tally.dropped += 1
            self.stats.put_seconds += time.perf_counter() - start

    def _write_many(self, entries: list[CacheEntry]) -> list[bool]:
        """Store queued entries (the writer thread) in two pipelined round trips, whatever their number: which
        exist, then the new ones set (and the existing ones' expiry renewed); False for each one not stored."""
        with self.lock:
            current = [entry for entry in entries if self._pending.get(entry.key) is entry]
        stored = {id(entry): True for entry in entries}  # removed, cleared or put again while queued: done
        if not current:
            return [True] * len(entries)
        names = [self._redis_key(entry.key) for entry in current]
        exists = self._command(lambda: self._pipelined(lambda pipe: [pipe.exists(name) for name in names]))
        if exists is FAILED:
            return self._dropped(entries, current, stored)
        encoded: list[bytes | None] = []
        for entry, known in zip(current, exists):
            try:
                encoded.append(None if known else self.codec.encode(entry))
            except Exception:
                log.exception("kv_redis_encode_failed", key=entry.key.hex())
                with self.lock:
                    self.stats.write_errors += 1
                encoded.append(b"")  # not written

        def second_trip(pipe: Any) -> None:
            for name, data, entry in zip(names, encoded, current):
                if data is None:  # another process wrote the same bytes (keys are content hashes): keep it longer
                    if self.ttl_ms is not None:
                        pipe.pexpire(name, max(1, self._remaining_ms(entry)))
                    pipe.strlen(name)
                elif data:
                    pipe.set(name, data, px=None if self.ttl_ms is None else max(1, self._remaining_ms(entry)))

        answers = self._command(lambda: self._pipelined(second_trip))
        if answers is FAILED:
            return self._dropped(entries, current, stored)
        replies = iter(answers)
        for entry, data in zip(current, encoded):
            expires = entry.created + self.ttl_ms / 1000 if self.ttl_ms is not None else None
            if data == b"":
                stored[id(entry)] = False
                continue
            if data is None:
                if self.ttl_ms is not None:
                    next(replies)
                size = next(replies)
                data_size = size if isinstance(size, int) else 0
            else:
                next(replies)
                data_size = len(data)
            with self.lock:
                if self._pending.get(entry.key) is entry:
                    self._remember(entry.key, Known(entry.parent, data_size, entry.nbytes, entry.accesses, expires))
        return [stored[id(entry)] for entry in entries]

    def _remaining_ms(self, entry: CacheEntry) -> int | None:
        """Milliseconds ``entry`` has left before ``ttl_seconds`` from its ``created`` (0: none left); None: no TTL."""
        if self.ttl_ms is None:
            return None
        return max(0, int(self.ttl_ms - 1000 * (time.time() - entry.created)))

    def _pipelined(self, queue_commands: Callable[[Any], Any]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        queue_commands(pipe)
        return pipe.execute()

    def _dropped(self, entries: list[CacheEntry], current: list[CacheEntry], stored: dict[int, bool]) -> list[bool]:
        with self.lock:
            self.stats.dropped_writes += len(current)
        for entry in current:
            stored[id(entry)] = False
        return [stored[id(entry)] for entry in entries]

    def _lose(self, entry: CacheEntry) -> None:
        """A queued entry was not stored (the writer calls this under the lock)."""
        if entry.key not in self._known:
            self.note_removed(entry.key)

    # ---- what this process remembers (callers hold self.lock) ------------------

    def _live(self, key: bytes) -> Known | None:
        """What is remembered of ``key``, unless its TTL has ended on the server (then it is forgotten)."""
        known = self._known.get(key)
        if known is not None and known.expires is not None and time.time() > known.expires:
            self._forget(key, removed=True)
            self.stats.expirations += 1
            return None
        return known

    def _remember(self, key: bytes, known: Known) -> None:
        self._forget(key)
        self._known[key] = known
        self.stats.stored_bytes += known.stored
        self.stats.raw_bytes += known.raw
        while len(self._known) > self.max_known:
            oldest = next(iter(self._known))
            self._forget(oldest, removed=True)

    def _forget(self, key: bytes, removed: bool = False) -> None:
        known = self._known.pop(key, None)
        if known is None:
            return
        self.stats.stored_bytes -= known.stored
        self.stats.raw_bytes -= known.raw
        if removed:
            self.note_removed(key)


def _connect(options: RedisTierSettings, tier_name: str) -> Any:
    """A client with a bounded connection pool, short timeouts and no retries of its own (the tier
    decides when to try the server again)."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as exc:
        raise TierserveError(
            "the redis tier needs the redis client: pip install 'tierserve[redis]'"
        ) from exc
    pool = redis.BlockingConnectionPool.from_url(
        options.url,
        max_connections=options.max_connections,
        timeout=options.timeout_seconds,  # waiting for a free connection
        socket_timeout=options.timeout_seconds,
        socket_connect_timeout=options.timeout_seconds,
        username=options.username,
        password=options.resolved_password(),
        retry=Retry(NoBackoff(), 0),
        client_name=f"tierserve-{tier_name}",  # how operators find these connections (CLIENT LIST)
    )
    return redis.Redis(connection_pool=pool)


@hookimpl
def register_cache_tiers(register):
    description = "a Redis/Valkey server shared by processes and machines (zstd, checksummed, TTL)"
    register("redis", RedisTier, settings=RedisTierSettings, description=description, server_evicts=True)
