"""The engine: an ``EngineCore`` that steps (schedule → run → update) behind an ``EngineClient``.

    client.py            EngineClient: tokenize, validate, submit, stream, abort, cache admin, statistics
    output_processor.py  token ids → text deltas, stop strings, timings (client side)
    drivers.py           the core inline or on a background thread
    process.py           the core in a child process
    supervisor.py        starts that process again when it dies, with back-off, up to a bound
    loop.py              applies messages between steps, publishes outputs and snapshots
    core.py              EngineCore: requests, scheduler, runner; one step = three calls
    runner.py            ModelRunner: forward, sampling, draft verification, next drafts
    builder.py           settings → backend, pool, store, KV manager, scheduler, runner, core
    requests.py          EngineRequest, RequestError, the context-length rule
    messages.py          what crosses between client and core
    stats.py             typed statistics and the published snapshot
    profiling.py         per-phase step timings ([monitoring] detailed_profiling)

The server and the CLI import ``EngineClient`` (and the request/output types) only.
"""

from __future__ import annotations

from tierserve.engine.client import EngineClient
from tierserve.engine.messages import ModelInfo
from tierserve.engine.output_processor import RequestStream
from tierserve.engine.requests import RequestError, read_warm_prompts
from tierserve.engine.stats import EngineSnapshot
from tierserve.core.outputs import CompletedRequest, RequestOutput, RequestTimings, TokenLogprob

__all__ = [
    "CompletedRequest",
    "EngineClient",
    "EngineSnapshot",
    "ModelInfo",
    "RequestError",
    "RequestOutput",
    "RequestStream",
    "RequestTimings",
    "TokenLogprob",
    "read_warm_prompts",
]
