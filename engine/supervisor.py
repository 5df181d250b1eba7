"""Starting the engine core process again when it dies (``[server] engine_max_restarts``).

    core process dies ─► its requests and calls end: EngineProcessError, retry after N s (a 503)
        └► EngineSupervisor: wait 1 s, 2 s, 4 s ... (at most 60 s) ─► spawn a core ─► attach it
           past engine_max_restarts in a row: failed for good (the server says so until it is restarted)

The client, its tokenizer and every reference the server holds outlive a
restart; only the core process (model, KV pool, memory tiers) is new. Disk
tiers are files, which the new core opens as a restarted server would: their
prefixes are served again.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import structlog

from tierserve.engine.process import (
    EngineProcessError,
    ProcessDriver,
    await_model_info,
    exit_reason,
    start_core_process,
)

if TYPE_CHECKING:
    from tierserve.engine.client import EngineClient
    from tierserve.settings.config import Settings

log = structlog.get_logger(__name__)

BACKOFF_CAP_SECONDS = 60.0
STABLE_SECONDS = 300.0  # a core that ran this long was healthy: its death starts the count of restarts afresh


@dataclass(frozen=True, slots=True)
class SupervisorStatus:
    """How the engine core process fares (``/health`` reports it)."""

    state: str  # "running"; "restarting" (waiting, or loading the model); "failed" (given up: restart the server)
    pid: int | None  # the core process now running (None while there is none)
    restarts: int  # times a core was started again, in all
    max_restarts: int  # server.engine_max_restarts: restarts in a row allowed
    attempt: int  # restarts in a row, the one under way (or waited for) included
    last_exit_reason: str | None  # "it was killed by SIGKILL", "it exited with code 1"
    last_exit_code: int | None  # the exit code, or minus the signal's number
    last_exit_at: float | None  # seconds since the epoch
    failure: str | None  # why no restart is tried any more
    retry_after: int | None  # while restarting: seconds until a request may be served again, about

    def error(self) -> EngineProcessError:
        """Why a request cannot be served now, and whether (and when) to send it again."""
        if self.state == "failed":
            return EngineProcessError(f"{self.failure}; the server serves no request until it is restarted")
        if self.state == "restarting":
            return EngineProcessError(
                f"the engine core process died ({self.last_exit_reason}) and is being restarted (attempt "
                f"{self.attempt} of {self.max_restarts}); the request may be retried in about {self.retry_after} s",
                self.retry_after,
            )
        # its exit is being handled this very moment: the retry gets the verdict
        return EngineProcessError("the engine core process exited a moment ago; the request may be retried", 1)


class EngineSupervisor:
    """Drives an engine core process (as ``ProcessDriver`` does) and starts a new one when it dies.

    A death nobody asked for ends the requests in flight with a retryable ``EngineProcessError``; after a
    back-off (``server.engine_restart_backoff_seconds``, doubling for each restart in a row, at most 60 s or
    the first wait) a new core is spawned and attached to the same client. Once
    ``server.engine_max_restarts`` restarts in a row were used, the next death (or a start that fails) leaves
    it ``failed``: every request is answered with the reason until the server is restarted.

    Args:
        client: the client every core answers; it is kept across restarts.
        settings: what each core is built with, and the restart settings in ``[server]``.
        allowlist: the installed plugins each core may load (``core_process_main``'s).
        modules: plugins under development each core loads (``tierserve serve --plugin``).
        process: the first core, its model loaded.
        conn: this side of its pipe.
        load_seconds: how long the first core took to load (what a restart is expected to take).
    """

    threaded = True
    running = True

    def __init__(
        self,
        client: EngineClient,
        settings: Settings,
        allowlist: list[str] | None,
        modules: tuple[str, ...],
        process: BaseProcess,
        conn: Connection,
        load_seconds: float = 0.0,
    ) -> None:
        self._client = client
        self._settings = settings
        self._allowlist = allowlist
        self._modules = modules
        self._load_seconds = load_seconds
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._core = ProcessDriver(process, conn, client, on_death=self._died)
        self._started_at = time.monotonic()
        self._state = "running"
        self._restarts = 0
        self._attempt = 0
        self._last_exit: tuple[str, int | None, float] | None = None
        self._failure: str | None = None
        self._serving_again_at = 0.0  # monotonic: when a restarting core should be up (the wait, plus a load)
        self._launching: BaseProcess | None = None
        self._restarter: threading.Thread | None = None

    # ---- the driver's interface (what EngineClient calls) ----------------------------------------

    @property
    def process(self) -> BaseProcess:
        """The core process attached now (the dead one until a restart replaces it)."""
        return self._core.process

    @property
    def alive(self) -> bool:
        """True while a core process runs and takes requests (not while it restarts, or after giving up)."""
        return self._state == "running" and self._core.alive

    def send(self, message: Any) -> None:
        if self._state != "running":
            raise self.status().error()
        try:
            self._core.send(message)
        except OSError:  # it died; its reader thread has not told us yet
            raise self.status().error() from None

    def call(self, method: str, *args: Any) -> Any:
        """Run a core method; a core that dies meanwhile ends the call with its ``EngineProcessError``."""
        if self._state != "running":
            raise self.status().error()
        try:
            return self._core.call(method, *args)
        except OSError:  # it died; its reader thread has not told us yet
            raise self.status().error() from None

    def has_work(self) -> bool:
        return bool(self._client.in_flight())

    def step(self) -> None:
        raise RuntimeError("the engine core runs in its own process; step() is for an in-process core")

    def start(self) -> None:
        """The child runs from the moment it is spawned."""

    def shutdown(self) -> None:
        """Stop restarting, then ask the core to abort everything, flush its tiers and exit; wait for it."""
        self._closing.set()
        with self._lock:
            launching = self._launching
        if launching is not None:  # a core still loading is of no use now
            launching.kill()
        if self._restarter is not None:
            self._restarter.join(timeout=30)
        self._core.shutdown()

    def close(self) -> None:
        self.shutdown()

    # ---- restarts -----------------------------------------------------------------------------

    def status(self) -> SupervisorStatus:
        """The state, the running core's pid, the restarts and the last exit."""
        with self._lock:
            reason, code, at = self._last_exit or (None, None, None)
            retry = None
            if self._state == "restarting":
                retry = max(1, math.ceil(self._serving_again_at - time.monotonic()))
            return SupervisorStatus(
                state=self._state,
                pid=self._core.process.pid if self._state == "running" else None,
                restarts=self._restarts,
                max_restarts=self._settings.server.engine_max_restarts,
                attempt=self._attempt,
                last_exit_reason=reason,
                last_exit_code=code,
                last_exit_at=at,
                failure=self._failure,
                retry_after=retry,
            )

    def _backoff(self) -> float:
        """The wait before the next restart (the lock is held): the first wait, doubled for each restart in a
        row so far."""
        first = self._settings.server.engine_restart_backoff_seconds
        return min(first * 2.0**self._attempt, max(first, BACKOFF_CAP_SECONDS))

    def _died(self, core: ProcessDriver, exitcode: int | None) -> EngineProcessError:
        """A core died unasked (on its reader thread): restart it, or give up; the error its requests end with."""
        reason = exit_reason(exitcode)
        with self._lock:
            if core is not self._core or self._closing.is_set():
                return EngineProcessError(f"the engine core process is gone ({reason}); the server is stopping")
            self._last_exit = (reason, exitcode, time.time())
            if time.monotonic() - self._started_at >= STABLE_SECONDS:
                self._attempt = 0
            limit = self._settings.server.engine_max_restarts
            if self._attempt >= limit:
                self._give_up(self._exhausted(f"the engine core process died ({reason})", limit))
            else:
                wait = self._backoff()
                self._attempt += 1
                self._state = "restarting"
                self._serving_again_at = time.monotonic() + wait + self._load_seconds
                self._restarter = threading.Thread(
                    target=self._restart, args=(wait,), name="tierserve-engine-restart", daemon=True
                )
                self._restarter.start()
                log.warning("engine_process_restart_scheduled", reason=reason, in_seconds=wait,
                            attempt=self._attempt, max_restarts=limit)  # fmt: skip
        return self.status().error()

    def _restart(self, wait: float) -> None:
        """Wait, then spawn cores until one loads (attached to the client) or the restarts run out."""
        limit = self._settings.server.engine_max_restarts
        with self._lock:
            dead = self._core.process
        if dead.is_alive():  # its pipe closed but it still runs: never two cores on the same disk tier
            log.warning("engine_process_kill", pid=dead.pid, reason="its pipe closed while it still ran")
            dead.kill()
        dead.join(timeout=30)
        while not self._closing.wait(wait):
            with self._lock:
                attempt = self._attempt
            log.info("engine_process_restarting", attempt=attempt, max_restarts=limit)
            started = time.monotonic()
            try:
                process, conn = start_core_process(self._settings, self._allowlist, self._modules)
                with self._lock:
                    self._launching = process
                if self._closing.is_set():  # shutdown came between the spawn and the line above
                    process.kill()
                info = await_model_info(process, conn)
            except Exception as exc:  # noqa: BLE001 - whatever stops a core from loading counts as a failed attempt
                with self._lock:
                    self._launching = None
                    if self._closing.is_set():
                        return
                    log.error("engine_process_restart_failed", attempt=attempt, error=f"{type(exc).__name__}: {exc}")
                    if self._attempt >= limit:
                        reason = self._last_exit[0] if self._last_exit else "it exited"
                        self._give_up(self._exhausted(f"the engine core process died ({reason}) and could not be "
                                                      f"started again ({exc})", limit))  # fmt: skip
                        return
                    wait = self._backoff()
                    self._attempt += 1
                    self._serving_again_at = time.monotonic() + wait + self._load_seconds
                continue
            with self._lock:
                self._launching = None
                if not self._closing.is_set():
                    self._client.reattach(info)  # first: the new core's first outputs count from nothing
                    self._core = ProcessDriver(process, conn, self._client, on_death=self._died)
                    self._started_at = time.monotonic()
                    self._load_seconds = self._started_at - started
                    self._restarts += 1
                    self._state = "running"
                    log.info("engine_process_restarted", pid=process.pid, restarts=self._restarts, attempt=attempt,
                             load_seconds=round(self._load_seconds, 3))  # fmt: skip
                    restarted = True
                else:
                    restarted = False
            if restarted:
                self._warm_again()
                return
            ProcessDriver(process, conn, self._client).shutdown()  # loaded as the server stops: flush and end it
            return

    def _warm_again(self) -> None:
        """Compute the start-up prompts (``[kv_cache] warm_prompts``) into the new core, as the first one was."""
        from tierserve.engine.connect import warm_prompts

        prompts = warm_prompts(self._settings)
        if not prompts:
            return
        try:
            warmed = self._client.warm(prompts)
        except Exception as exc:  # noqa: BLE001 - a warm is an optimisation: the core serves without it
            log.warning("warm_prompts_failed_after_restart", error=f"{type(exc).__name__}: {exc}")
            return
        log.info("warm_prompts_cached", prompts=len(prompts), tokens=warmed.tokens, writes=warmed.writes, restart=True)

    def _exhausted(self, what: str, limit: int) -> str:
        if limit == 0:
            return f"{what}, and server.engine_max_restarts = 0 allows no restart"
        return f"{what} after server.engine_max_restarts ({limit}) restarts in a row"

    def _give_up(self, failure: str) -> None:
        """No more restarts (the lock is held): every request gets ``failure`` from now on."""
        self._state = "failed"
        self._failure = failure
        log.error("engine_process_given_up", reason=failure, restarts=self._restarts)
