"""A handler's work raced against its client's connection, so work nobody waits for is cancelled.

Streams need none of this (Litestar cancels a stream when its client leaves);
a non-streaming response has no bytes to send until it is done, so only the
ASGI ``http.disconnect`` message tells the server its client is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from litestar import Request

T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection": what the access log shows


class ClientDisconnected(Exception):
    """The client closed its connection before the response was ready; its work was cancelled."""


async def disconnected(request: Request) -> None:
    """Return once the ASGI server reports the client gone (call it after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result; ``ClientDisconnected`` if the client leaves first, after ``work`` was cancelled
    (cancelling a request's output stream aborts it in the engine and frees its blocks)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()
