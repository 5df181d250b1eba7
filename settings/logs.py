"""structlog set-up: readable console lines in development, JSON in production.

Standard-library loggers (uvicorn, litestar) go through the same renderer, and
values bound with ``request_context`` (e.g. the request id) appear on every
line logged while a request is handled.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO

import structlog

from tierserve.settings.config import LoggingSettings
from tierserve.settings.secrets import SecretScrubber


def configure_logging(
    settings: LoggingSettings | None = None, stream: TextIO | None = None, secrets: Iterable[str] = ()
) -> None:
    """Route structlog and standard logging to one handler in the chosen format.

    Tracebacks never show local variables (a request's headers or the settings
    could be among them), and every string in ``secrets`` (the API keys) is
    replaced by ``[redacted]`` in each rendered line.
    """
    settings = settings or LoggingSettings()
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if settings.format == "json":
        renderer: structlog.types.Processor = structlog.processors.JSONRenderer()
        no_locals = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        shared.append(structlog.processors.ExceptionRenderer(no_locals))
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer, SecretScrubber(secrets)],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(settings.level.upper())
    # uvicorn may have given its loggers their own handlers; send them through ours instead
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "litestar"):
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.propagate = True


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


@contextmanager
def request_context(request_id: str | None = None, **values: object) -> Iterator[str]:
    """Bind a request id (generated if not given) to every log line inside the block."""
    request_id = request_id or new_request_id()
    with structlog.contextvars.bound_contextvars(request_id=request_id, **values):
        yield request_id
