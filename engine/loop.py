"""The core loop: apply the client's messages between steps, step while there is work, report what happened.

Transport-free: a driver feeds it messages (from an in-process queue or a
pipe) and gives it an ``emit`` callback for ``StepOutputs`` and
``CallResult`` records. Statistics are published with the outputs: after a
command, after a round that admitted or finished a request (so a reader
never sees a request count older than the requests it has seen answered),
before the answers of deferred calls (a beam search's counts), when going
idle, and at least every ``snapshot_interval`` seconds while busy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from tierserve.engine.core import EngineCore
from tierserve.engine.messages import Abort, Call, CallResult, Deferred, StepOutputs
from tierserve.engine.requests import EngineRequest
from tierserve.core.outputs import CoreOutput
from tierserve.core.sequence import FinishReason

log = structlog.get_logger(__name__)

Emit = Callable[[StepOutputs | CallResult], None]


class CoreLoop:
    """Drives one ``EngineCore`` for one driver.

    Args:
        core: the engine core (touched only from the thread that calls this loop).
        emit: where outputs and call results go, in order.
        snapshot_interval: the most seconds between two statistics snapshots while busy.
    """

    def __init__(self, core: EngineCore, emit: Emit, snapshot_interval: float = 0.1) -> None:
        self.core = core
        self.emit = emit
        self.snapshot_interval = snapshot_interval
        self._last_snapshot = 0.0
        self._deferred: list[tuple[int, Deferred]] = []  # calls answered once what they wait for is done

    def run_once(self, messages: Iterable[Any], *, step: bool = True) -> None:
        """Apply ``messages`` in order, then (if ``step``) run one step if any request is unfinished, then report."""
        core = self.core
        outputs = []
        results: list[CallResult] = []
        added = 0
        for message in messages:
            if isinstance(message, EngineRequest):
                outputs += self._add(message)
                added += 1
            elif isinstance(message, Abort):
                outputs += core.abort(message.request_ids, FinishReason(message.reason))
            elif isinstance(message, Call):
                result = self._call(message)
                if result is not None:
                    results.append(result)
            else:
                raise TypeError(f"the engine core got an unknown message: {type(message).__name__}")
        if step and core.has_unfinished():
            try:
                outputs += core.step()
            except Exception as exc:
                log.exception("engine_step_failed", part=core.phase)
                outputs += core.fail_all(exc)
        finished = any(output.finish_reason is not None for output in outputs)
        snapshot = None
        now = time.monotonic()
        if results or finished or added or now - self._last_snapshot >= self.snapshot_interval:
            snapshot = core.snapshot()
            self._last_snapshot = now
        if outputs or snapshot is not None or added:
            self.emit(StepOutputs(outputs, snapshot, added, core.scheduler.num_waiting))
        for result in results:
            self.emit(result)
        self.answer_deferred()

    @property
    def busy_calls(self) -> bool:
        """A deferred call does work each time it is asked (a beam search): the loop should not sleep."""
        return any(deferred.busy for _, deferred in self._deferred)

    @property
    def waiting_calls(self) -> bool:
        """Calls answered later (``Deferred``) are outstanding: the loop should come back soon."""
        return bool(self._deferred)

    def answer_deferred(self) -> None:
        """Answer the deferred calls whose wait is over."""
        if not self._deferred:
            return
        still, answered = [], []
        for call_id, deferred in self._deferred:
            try:
                if not deferred.ready():
                    still.append((call_id, deferred))
                    continue
                answered.append(CallResult(call_id, deferred.result()))
            except Exception as exc:
                answered.append(CallResult(call_id, error=exc))
        self._deferred = still
        if answered:  # what the calls counted (a beam search's statistics) is published before their answers
            self._last_snapshot = time.monotonic()
            self.emit(StepOutputs([], self.core.snapshot(), 0, self.core.scheduler.num_waiting))
        for result in answered:
            self.emit(result)

    def _add(self, request: EngineRequest) -> list[CoreOutput]:
        """Admit a request; one the core cannot take ends at once instead of taking the loop down."""
        try:
            return self.core.add_request(request)
        except Exception:
            log.exception("engine_request_refused", request_id=request.request_id)
            return [CoreOutput(request.request_id, [], FinishReason.ABORT.value)]

    def publish_if_stale(self) -> None:
        """Publish statistics while idle, if the last snapshot is older than the interval."""
        now = time.monotonic()
        if now - self._last_snapshot >= self.snapshot_interval:
            self._last_snapshot = now
            self.emit(StepOutputs([], self.core.snapshot(), 0, self.core.scheduler.num_waiting))
        self.answer_deferred()

    def _call(self, message: Call) -> CallResult | None:
        """The call's result, or None when it is deferred (answered by ``answer_deferred``)."""
        try:
            value = getattr(self.core, message.method)(*message.args)
            if isinstance(value, Deferred):
                self._deferred.append((message.call_id, value))
                return None
            return CallResult(message.call_id, value)
        except Exception as exc:  # the caller gets it; the loop goes on
            return CallResult(message.call_id, error=exc)
