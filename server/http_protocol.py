"""uvicorn's h11 protocol with deadlines for reading a request: slow clients cannot hold connections for ever.

uvicorn times out an idle keep-alive connection, but not a client that sends its request slowly: one byte a
second (slowloris) kept a connection, and its buffers, for as long as it liked. Here each connection has a
deadline for its request's headers (``server.header_timeout_seconds``, from the connection's start or the end
of the previous response) and then for its body (``server.body_timeout_seconds``, from the end of the
headers); a client past either is logged and disconnected (a request whose body stops coming ends as one whose
client left). ``server.max_connections`` bounds the connections (uvicorn's ``limit_concurrency``: past it,
requests are answered 503).
"""

from __future__ import annotations

import asyncio

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger(__name__)


def timed_protocol(header_seconds: float, body_seconds: float) -> type[H11Protocol]:
    """An ``H11Protocol`` class with these deadlines, for ``uvicorn.Config(http=...)``."""

    class TimedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol, with a deadline for each phase of reading a request (module docstring)."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._phase: str | None = None
            self._deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            super().connection_lost(exc)

        def _watch(self) -> None:
            """Arm the deadline of the phase the client is in: its headers (h11's IDLE: nothing of the request
            parsed yet), its body (SEND_BODY); none once the request is read."""
            state = self.conn.their_state
            phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
            if phase == self._phase:
                return
            self._cancel()
            self._phase = phase
            if phase is not None:
                seconds = header_seconds if phase == "headers" else body_seconds
                self._deadline = self.loop.call_later(seconds, self._too_slow, phase, seconds)

        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self, phase: str, seconds: float) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            log.warning("http_client_too_slow", phase=phase, seconds=seconds,
                        client=f"{self.client[0]}:{self.client[1]}" if self.client else None)  # fmt: skip
            self.transport.close()

    return TimedH11Protocol
