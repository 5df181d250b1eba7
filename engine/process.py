"""The engine core in a child process (``[server] engine_process = true``).

    server process                                   core process (spawned)
    EngineClient ── send: EngineRequest/Abort/Call ──► pipe ──► CoreLoop ─► EngineCore.step()
    reader thread ◄── StepOutputs/CallResult ──────── pipe ◄──┘
      └► output processor (detokenize) ─► request streams

The child owns the model and the KV cache; the server process only
tokenizes, detokenizes and speaks HTTP, so the step loop never waits for
the server's GIL. If the child dies, every request in flight ends with an
``EngineProcessError`` (a 503) and ``supervisor.py`` starts a new child; if
the server process dies, the child exits at once (as a crash of the whole
service would).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import structlog

from tierserve.engine.messages import (
    Abort,
    CallResult,
    LoadFailed,
    ModelInfo,
    PendingCalls,
    Shutdown,
    StepOutputs,
)
from tierserve.core.errors import ConfigError, TierserveError

if TYPE_CHECKING:
    from tierserve.settings.config import Settings
    from tierserve.engine.client import EngineClient
    from tierserve.core.plugins import PluginManager

log = structlog.get_logger(__name__)

IDLE_POLL_SECONDS = 0.5
PARENT_POLL_SECONDS = 0.2
DEFERRED_POLL_SECONDS = 0.005  # how soon an idle core looks again at a call waiting for tier writes
STARTUP_TIMEOUT_SECONDS = 600.0
PARENT_SHUTDOWN_SECONDS = 10.0  # after the grace period, the server's own shutdown before it sends Shutdown


class EngineProcessError(RuntimeError):
    """The engine core process failed to start or is gone (the server answers 503).

    ``retry_after``: seconds after which the request may be served (the core is being restarted), or ``None``:
    the core will not come back until the server is restarted.
    """

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def code(self) -> str:
        return "engine_restarting" if self.retry_after is not None else "engine_unavailable"


def exit_reason(exitcode: int | None) -> str:
    """How a process ended, in words: ``it was killed by SIGKILL``, ``it exited with code 1``."""
    if exitcode is not None and exitcode < 0:
        return f"it was killed by {signal.Signals(-exitcode).name}"
    return "it exited" if exitcode in (0, None) else f"it exited with code {exitcode}"


def core_process_main(
    conn: Connection, settings: Settings, allowlist: list[str] | None, modules: tuple[str, ...] = ()
) -> None:
    """The child's entry point: build the core, say so, then serve messages until ``Shutdown``.

    It loads the plugins the server's process loaded: the built-ins, the installed ones ``allowlist`` lets in,
    and the plugins under development in ``modules`` (``tierserve serve --plugin``)."""
    from tierserve.engine.builder import build_core, model_info
    from tierserve.engine.loop import CoreLoop
    from tierserve.settings.logs import configure_logging
    from tierserve.core.plugins import load_plugins
    from tierserve.settings.secrets import settings_secrets

    stop = StopSignals(settings.server.shutdown_grace_seconds)
    configure_logging(settings.logging, secrets=settings_secrets(settings))
    watch_parent(os.getppid())
    try:
        core = build_core(settings, load_plugins(allowlist=allowlist, modules=modules))
    except Exception as exc:
        if isinstance(exc, TierserveError):  # a message meant for the user: no traceback
            log.error("engine_core_load_failed", error=f"{type(exc).__name__}: {exc}")
        else:
            log.exception("engine_core_load_failed")
        conn.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        return
    conn.send(model_info(core))
    loop = CoreLoop(core, conn.send)
    while True:
        messages: list[Any] = []
        idle = not core.has_unfinished() and not loop.busy_calls  # a beam search's slices run as steps do
        if conn.poll((DEFERRED_POLL_SECONDS if loop.waiting_calls else IDLE_POLL_SECONDS) if idle else 0):
            try:
                messages.append(conn.recv())
                while conn.poll(0):
                    messages.append(conn.recv())
            except EOFError:  # the server process died without saying goodbye: end as it did
                log.error("engine_core_orphaned", reason="the server process closed its pipe")
                os._exit(1)
        asked = any(isinstance(message, Shutdown) for message in messages)
        if asked or stop.overdue():
            # abort what is left, then close: every tier's write queue drains before the process ends
            loop.run_once([m for m in messages if not isinstance(m, Shutdown)] + [Abort(list(core.requests))])
            core.close()
            if asked:
                conn.send(Shutdown())
            else:
                log.warning("engine_core_stopped", reason="a signal, and no word from the server process in time",
                            grace_seconds=stop.grace)  # fmt: skip
            return
        if not messages and idle:
            loop.publish_if_stale()
            continue
        try:
            loop.run_once(messages)
        except Exception:  # the loop keeps serving the other requests
            log.exception("engine_loop_failed")


class StopSignals:
    """SIGTERM and SIGINT in the core process. A signal sent to the server's whole process group (systemd's
    ``KillMode=control-group``, ``kill -TERM -PGID``, Ctrl-C in a terminal) reaches both processes: the server
    process stops taking requests, lets those in flight finish (``server.shutdown_grace_seconds``), then sends
    ``Shutdown``; the core keeps serving until then and drains its tiers' writes before it exits. A core that
    hears nothing from the server within the grace period (a signal sent to it alone) stops by itself the same
    way. A second signal ends the core at once."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.deadline: float | None = None
        signal.signal(signal.SIGTERM, self._received)
        signal.signal(signal.SIGINT, self._received)

    def _received(self, signum: int, frame: Any) -> None:
        if self.deadline is not None:
            os._exit(128 + signum)
        self.deadline = time.monotonic() + self.grace + PARENT_SHUTDOWN_SECONDS
        log.info("engine_core_stopping", signal=signal.Signals(signum).name, grace_seconds=self.grace)

    def overdue(self) -> bool:
        """A signal came and the grace period (plus the server's own shutdown time) is over."""
        return self.deadline is not None and time.monotonic() > self.deadline


def watch_parent(parent: int) -> None:
    """Exit at once if the server process dies (killed, crashed): a core without its server serves no one,
    and must not keep writing cache files while a restarted server opens them."""

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_SECONDS)
            if os.getppid() != parent:
                log.error("engine_core_orphaned", reason="the server process is gone", parent=parent)
                os._exit(1)

    threading.Thread(target=watch, name="tierserve-parent-watch", daemon=True).start()


DeathHandler = Callable[["ProcessDriver", "int | None"], EngineProcessError]


class ProcessDriver:
    """The parent's handle on one core process: sends messages, and a reader thread hands back outputs.

    The client's driver is the ``EngineSupervisor`` (``supervisor.py``), which holds one of these for the core
    running now. ``on_death`` is told of an exit nobody asked for (the driver and the exit code) and returns the
    error the requests and calls in flight end with (whether to retry them).
    """

    def __init__(
        self, process: BaseProcess, conn: Connection, client: EngineClient, on_death: DeathHandler | None = None
    ) -> None:
        self.process = process
        self._conn = conn
        self._client = client
        self._on_death = on_death
        self._send_lock = threading.Lock()
        self._calls = PendingCalls()
        self._gone: EngineProcessError | None = None  # set once the process exited: what every later send raises
        self._stopping = False  # a shutdown this side asked for: the exit that follows is no death
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="tierserve-engine-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        """False once the core process exited (killed, crashed, or shut down)."""
        return self._gone is None and self.process.is_alive()

    def send(self, message: Any) -> None:
        if self._gone is not None:
            raise self._gone
        with self._send_lock:
            self._conn.send(message)

    def call(self, method: str, *args: Any) -> Any:
        call, future = self._calls.new(method, args)
        self.send(call)
        return future.result()

    def shutdown(self) -> None:
        """Ask the child to abort everything, flush its tiers and exit; wait for it."""
        self._stopping = True
        if self._gone is None and self.process.is_alive():
            try:
                self.send(Shutdown())
            except (OSError, EngineProcessError):
                pass
            self._closed.wait(timeout=60)
        self.process.join(timeout=30)
        if self.process.is_alive():
            log.warning("engine_process_kill", pid=self.process.pid)
            self.process.kill()
            self.process.join()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
                if isinstance(message, StepOutputs):
                    self._client.receive(message)
                elif isinstance(message, CallResult):
                    self._calls.resolve(message)
                elif isinstance(message, Shutdown):
                    self._stopping = True
                    break
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - a message this side cannot read: the core is out of reach
                # without this the reader died silently, the pipe filled and every client waited for good
                log.exception("engine_pipe_unreadable", pid=self.process.pid, action="the core is stopped")
                self.process.kill()
                break
        self._on_exit(expected=self._stopping)

    def _on_exit(self, expected: bool) -> None:
        if not expected:  # the pipe closes before the process is reaped: wait for its status, or a kill reads "exited"
            self.process.join(timeout=5)
        code = self.process.exitcode
        reason = exit_reason(code)
        error = EngineProcessError(f"the engine core process is gone ({reason})")
        if not expected:
            log.error("engine_process_died", pid=self.process.pid, exitcode=code, reason=reason,
                      signal=signal.Signals(-code).name if code is not None and code < 0 else None,
                      requests_failed=len(self._client.in_flight()))  # fmt: skip
            if self._on_death is not None:  # first: the requests below learn whether a retry will be served
                error = self._on_death(self, code)
        self._gone = error
        for request_id in self._client.in_flight():  # each its own exception: a raise adds to its traceback
            self._client.fail(request_id, None if expected else EngineProcessError(str(error), error.retry_after))
        self._calls.fail_all(error)
        self._closed.set()


def spawn_core(settings: Settings, plugins: PluginManager | None) -> EngineClient:
    """Start a core process for ``settings`` and return a client attached to it (after the model loaded)."""
    from tierserve.models.checkpoints import load_tokenizer, resolve_model_path
    from tierserve.engine.client import EngineClient
    from tierserve.engine.supervisor import EngineSupervisor

    if plugins is not None and not plugins.reproducible:
        raise ConfigError(
            "server.engine_process = true: the engine core process loads its plugins itself (the built-ins and "
            "the installed entry points the allowlist names), but these plugins were assembled in this process "
            "(a plugin added by hand); install the plugin as a package, or set server.engine_process = false"
        )
    path = resolve_model_path(settings.model.path, settings.model.gguf_file)  # a builtin checkpoint is written once, here, before the child reads it
    allowlist = None if plugins is None else plugins.allowlist
    modules = () if plugins is None else tuple(plugins.modules)
    started = time.monotonic()
    process, conn = start_core_process(settings, allowlist, modules)
    try:  # the server's tokenizer loads while the core loads the model (transformers brings torch: seconds)
        tokenizer = load_tokenizer(path)
    except Exception:
        process.kill()
        process.join()
        raise
    info = await_model_info(process, conn)
    client = EngineClient(settings, info, tokenizer)
    client.driver = EngineSupervisor(
        client, settings, allowlist, modules, process, conn, load_seconds=time.monotonic() - started
    )
    log.info("engine_process_started", pid=process.pid)
    return client


def start_core_process(
    settings: Settings, allowlist: list[str] | None, modules: tuple[str, ...]
) -> tuple[BaseProcess, Connection]:
    """Spawn a core process (it starts loading the model at once) and return it with this side of its pipe."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=core_process_main, args=(child, settings, allowlist, modules), name="tierserve-engine-core", daemon=True
    )
    process.start()
    child.close()
    return process, parent


def await_model_info(process: BaseProcess, conn: Connection) -> ModelInfo:
    """The ``ModelInfo`` a core process sends once its model is loaded; ``EngineProcessError`` if it fails,
    exits or takes longer than ``STARTUP_TIMEOUT_SECONDS``."""
    if not conn.poll(STARTUP_TIMEOUT_SECONDS):
        process.kill()
        raise EngineProcessError(f"the engine core process did not start within {STARTUP_TIMEOUT_SECONDS:.0f} s")
    try:
        first = conn.recv()
    except EOFError:
        process.join()
        raise EngineProcessError(f"the engine core process exited with code {process.exitcode} while loading") from None
    if isinstance(first, LoadFailed):
        process.join()
        raise EngineProcessError(f"the engine core failed to load: {first.error}")
    return first
