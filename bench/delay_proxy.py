"""A TCP proxy that delays what a client sends by a fixed time: a server ``delay`` further away.

Every chunk read from the client is forwarded ``delay`` seconds after it
arrived, in order, without waiting for earlier ones to be answered (so a
pipelined batch pays the delay once, as it would on a real link); replies
pass straight back. A request/response protocol such as Redis's then sees
``delay`` added to every round trip. It runs an asyncio loop on a thread of
its own::

    with DelayProxy("127.0.0.1", 6379, delay=0.001) as proxy:
        redis.Redis(port=proxy.port).ping()   # >= 1 ms
"""

from __future__ import annotations

import asyncio
import threading


class DelayProxy:
    """Listens on a free loopback port and forwards every connection to ``host:port`` with ``delay`` added."""

    def __init__(self, host: str, port: int, delay: float) -> None:
        self.target = (host, port)
        self.delay = delay
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)

    def start(self) -> DelayProxy:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        self.port = started.result(timeout=10)
        return self

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            self._pipe(client_reader, server_writer, self.delay),
            self._pipe(server_reader, client_writer, 0.0),
            return_exceptions=True,
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        delivering = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                queue.put_nowait((loop.time() + delay, data))
        finally:
            queue.put_nowait((0.0, b""))
            await delivering
