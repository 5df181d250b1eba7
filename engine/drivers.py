"""Where the engine core runs for a client: inline on the caller's thread, or on a background thread.

Either way the client only sends messages (``send``, ``call``); the core is
touched by exactly one thread at a time: the caller's while nothing else
drives it (scripts and tests step it by hand), the background thread once
``start`` ran. The child-process driver is in ``process.py``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from tierserve.engine.core import EngineCore
from tierserve.engine.loop import CoreLoop
from tierserve.engine.messages import Abort, CallResult, Deferred, PendingCalls, StepOutputs

log = structlog.get_logger(__name__)

Sink = Callable[[StepOutputs], None]

IDLE_WAIT_SECONDS = 0.5
DEFERRED_POLL_SECONDS = 0.005  # how soon an idle loop looks again at a call waiting for tier writes


class InProcessDriver:
    """Runs an ``EngineCore`` in this process: stepped by hand until ``start`` moves it to its own thread.

    Args:
        core: the engine core.
        sink: receives every ``StepOutputs`` (on the thread that runs the core).
    """

    threaded = False

    def __init__(self, core: EngineCore, sink: Sink) -> None:
        self.core = core
        self._sink = sink
        self._inbox: deque[Any] = deque()
        self._calls = PendingCalls()
        self._loop = CoreLoop(core, self._emit)
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        """False once the background thread died (it never should: a failed step fails its requests only)."""
        return self._thread is None or self._thread.is_alive() or self._stop.is_set()

    def send(self, message: Any) -> None:
        """Queue a message for the core (from any thread)."""
        self._inbox.append(message)
        self._wakeup.set()

    def call(self, method: str, *args: Any) -> Any:
        """Run ``core.<method>(*args)`` between steps and return its result (or raise its error)."""
        if threading.current_thread() is self._thread:
            return _answered(getattr(self.core, method)(*args))
        if self._thread is None:  # nothing else drives the core: messages sent earlier apply first
            if self._inbox:
                self._loop.run_once(self._drain(), step=False)
            return _answered(getattr(self.core, method)(*args))
        call, future = self._calls.new(method, args)
        self.send(call)
        return future.result()

    def has_work(self) -> bool:
        return bool(self._inbox) or self.core.has_unfinished()

    def step(self) -> None:
        """Apply queued messages and run one step, on the caller's thread (only while not started)."""
        if self._thread is not None:
            raise RuntimeError("the engine core runs on its own thread; step() is for a core that was not started")
        self._loop.run_once(self._drain())

    def start(self) -> None:
        """Run the core on a background thread until ``shutdown``."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tierserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the background thread; queued messages are applied and every request is aborted."""
        if self._thread is not None:
            self._stop.set()
            self._wakeup.set()
            self._thread.join()
            self._thread = None
        self.send(Abort(list(self.core.requests)))
        while self._inbox:
            self._loop.run_once(self._drain())

    def close(self) -> None:
        """Shut down, then flush the tiers and release the model."""
        self.shutdown()
        self.core.close()

    def _drain(self) -> list[Any]:
        messages = []
        while self._inbox:
            messages.append(self._inbox.popleft())
        return messages

    def _run(self) -> None:
        while not self._stop.is_set():
            messages = self._drain()
            if not messages and not self.core.has_unfinished() and not self._loop.busy_calls:
                self._loop.publish_if_stale()
                self._wakeup.wait(timeout=DEFERRED_POLL_SECONDS if self._loop.waiting_calls else IDLE_WAIT_SECONDS)
                self._wakeup.clear()
                continue
            try:
                self._loop.run_once(messages)
            except Exception:  # the loop keeps serving the other requests
                log.exception("engine_loop_failed")

    def _emit(self, message: StepOutputs | CallResult) -> None:
        if isinstance(message, CallResult):
            self._calls.resolve(message)
        else:
            self._sink(message)


def _answered(value: Any) -> Any:
    """A core method's result for a caller on the core's own thread: a ``Deferred`` one waited for here."""
    return value.wait() if isinstance(value, Deferred) else value
