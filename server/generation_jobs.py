"""A generation request turned into engine work: prompts as token ids, sampling parameters, submission, merged outputs."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from litestar import Request

from tierserve.core.engine import EngineClient, RequestOutput, RequestTimings, TokenLogprob
from tierserve.core.engine.requests import output_room
from tierserve.core.errors import RequestError, RequestTimeoutError
from tierserve.core.outputs import RequestCacheInfo
from tierserve.core.sampling_params import SamplingParams
from tierserve.server.errors import APIError
from tierserve.server.schemas import ChatRequest, SamplingFields
from tierserve.server.state import BODY_REQUEST_ID, ready_engine, state_of


@dataclass
class Choice:
    """One generated sequence, folded from its deltas."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    timings: RequestTimings | None = None
    cache: RequestCacheInfo | None = None
    speculation_method: str | None = None


@dataclass
class Job:
    """A validated request: its prompts as token ids and one SamplingParams per choice."""

    prompts: list[list[int]]
    params: list[SamplingParams]  # per choice, choice i uses prompts[i // n]
    n: int
    chat: bool
    cached: bool
    body: SamplingFields
    model: str = ""  # the served name the request asked for (responses carry it back)
    deadline: float | None = None  # the event loop's clock: past it the request is aborted (server.timeout_seconds)
    started: float = field(default_factory=time.perf_counter)
    id: str = ""


# ---- building a job ---------------------------------------------------------------------


def cache_namespace(cache_salt: str | None) -> str:
    """The namespace a request's ``cache_key`` lives in: its tenant, which is its ``cache_salt`` (or none)."""
    return cache_salt or ""


def completion_prompts(engine: EngineClient, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items or any(len(item) == 0 for item in items):
        raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    return [engine.encode_prompt(item) for item in items]


def chat_prompt(engine: EngineClient, body: ChatRequest) -> list[int]:
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    return engine.encode_prompt(messages=messages)


def build_job(request: Request, body: SamplingFields, *, chat: bool, cached: bool) -> Job:
    state = state_of(request)
    model = state.resolve_model(body.model)
    engine = ready_engine(request)
    prompts = [chat_prompt(engine, body)] if chat else completion_prompts(engine, body.prompt)
    limit = engine.info.max_model_len
    requested = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
        if body.echo and logprobs is not None:
            raise APIError(400, "echo: prompt logprobs are not computed; use echo without logprobs",
                           param="echo", code="unsupported")
    # the cached routes take their sampling defaults from [speculative] (the spec's configuration)
    defaults = state.settings.speculative if cached else None
    temperature = body.temperature if body.temperature is not None else (defaults.temperature if defaults else 1.0)
    top_p = body.top_p if body.top_p is not None else (defaults.top_p if defaults else 1.0)
    top_k = body.top_k if body.top_k is not None else (defaults.top_k if defaults else 0)
    params: list[SamplingParams] = []
    for ids in prompts:
        room = output_room(len(ids), limit, param="messages" if chat else "prompt")
        if cached and body.enable_sliding_window:  # a window lets generation run past the context
            room = requested if requested is not None else room
        # beyond the context is the engine's 400 (context_length_exceeded), not a silent clamp
        max_tokens = requested if requested is not None else (room if chat else min(16, room))
        for i in range(body.n):
            params.append(
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    min_p=body.min_p or 0.0,
                    repetition_penalty=body.repetition_penalty,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    seed=None if body.seed is None else (body.seed + i) % 2**64,  # 2**64 - 1 with n > 1 wraps
                    stop=stop,
                    stop_token_ids=body.stop_token_ids or (),
                    ignore_eos=body.ignore_eos,
                    min_tokens=body.min_tokens,
                    logit_bias=body.logit_bias or {},
                    logprobs=logprobs,
                )
            )
    if getattr(body, "cache_key", None) is not None and len(prompts) > 1:
        message = f"cache_key: names one prefix; send one prompt with it (got {len(prompts)} prompts)"
        raise APIError(400, message, param="cache_key", code="invalid_value")
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = getattr(body, "request_id", None) if cached else None
    if request_id is not None:
        request.scope.setdefault("state", {})[BODY_REQUEST_ID] = request_id
    timeout = state.settings.server.timeout_seconds
    deadline = asyncio.get_running_loop().time() + timeout if timeout is not None else None
    return Job(
        prompts, params, body.n, chat, cached, body, model, deadline, id=request_id or f"{prefix}-{uuid.uuid4().hex}"
    )


# ---- running a job ------------------------------------------------------------------------


def submit_all(engine: EngineClient, job: Job, loop: asyncio.AbstractEventLoop) -> list[tuple[str, Any]]:
    """Submit every choice now (so queue-full and bad input become HTTP errors before any byte is sent)."""
    body = job.body
    use_cache = getattr(body, "enable_caching", True)
    cache_key = getattr(body, "cache_key", None)
    submitted: list[tuple[str, Any]] = []
    try:
        for index, params in enumerate(job.params):
            submitted.append(
                engine.submit(
                    job.prompts[index // job.n],
                    params,
                    request_id=f"{job.id}-{index}",
                    priority=body.priority,
                    cache_salt=body.cache_salt,
                    use_prefix_cache=use_cache,
                    speculate=getattr(body, "enable_speculation", None),
                    sliding_window=getattr(body, "enable_sliding_window", None),
                    # the first choice names the prefix: one request is one use of its key
                    cache_key=cache_key if index == 0 else None,
                    cache_namespace=cache_namespace(body.cache_salt),
                    loop=loop,
                )
            )
    except Exception as exc:
        for request_id, _ in submitted:
            engine.abort(request_id)
        if isinstance(exc, RequestError) and exc.param == "request_id":  # name the id the client sent
            raise RequestError(f"request_id: {job.id!r} is already in flight", param="request_id") from None
        raise
    return submitted


async def merged(
    engine: EngineClient, submitted: list[tuple[str, Any]], deadline: float | None = None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all choices as they come, tagged with the choice index (``RequestTimeoutError`` past ``deadline``)."""
    if len(submitted) == 1:  # the common case needs no fan-in task per choice
        request_id, stream = submitted[0]
        async for output in engine.outputs(request_id, stream, deadline=deadline):
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, request_id: str, stream: Any) -> None:
        ended: Any = None
        try:
            async for output in engine.outputs(request_id, stream, deadline=deadline):
                await queue.put((index, output))
        except RequestTimeoutError as exc:
            ended = exc
        finally:
            await queue.put((index, ended))

    tasks = [asyncio.create_task(pump(i, rid, s)) for i, (rid, s) in enumerate(submitted)]
    try:
        remaining = len(tasks)
        while remaining:
            index, output = await queue.get()
            if isinstance(output, RequestTimeoutError):
                raise output
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def fold(choice: Choice, output: RequestOutput) -> None:
    choice.text.append(output.text)
    choice.token_ids.extend(output.token_ids)
    choice.logprobs.extend(output.logprobs or [])
    choice.prompt_tokens = output.prompt_tokens
    choice.cached_tokens = output.cached_tokens
    if output.finished:
        choice.finish_reason = output.finish_reason
        choice.timings = output.timings
        choice.cache = output.cache
        choice.speculation_method = output.speculation_method
