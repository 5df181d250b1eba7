"""OpenAI-compatible generation: /v1/models, /v1/completions, /v1/chat/completions and their /v1/cached/* twins."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from litestar import Request, Response, get, post
from litestar.params import FromPath, JSONBody
from litestar.response import Stream

from tierserve.core.engine import Engine, RequestOutput, RequestTimings, TokenLogprob
from tierserve.core.sampling_params import SamplingParams
from tierserve.server.errors import APIError, param_of
from tierserve.server.schemas import (
    CachedChatRequest,
    CachedCompletionRequest,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
)
from tierserve.server.state import ServerState, ready_engine, state_of

NAMED_PREFIXES_MAX = 1024


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


@dataclass
class Job:
    """A validated request: its prompts as token ids and one SamplingParams per choice."""

    prompts: list[list[int]]
    params: list[SamplingParams]  # per choice, choice i uses prompts[i // n]
    n: int
    chat: bool
    cached: bool
    body: SamplingFields
    started: float = field(default_factory=time.perf_counter)
    id: str = ""


# ---- building a job ---------------------------------------------------------------------


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in (state.model_name, state.settings.model.path):
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def completion_prompts(engine: Engine, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items or any(len(item) == 0 for item in items):
        raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    return [engine.encode_prompt(item) for item in items]


def chat_prompt(engine: Engine, body: ChatRequest) -> list[int]:
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    return engine.encode_prompt(messages=messages)


def named_prefixes(state: ServerState) -> OrderedDict[str, list[int]]:
    """``cache_key`` -> prefix token ids, most recently used last (kept in memory, bounded)."""
    return state.extras.setdefault("named_prefixes", OrderedDict())


def remember_prefix(state: ServerState, key: str, token_ids: list[int]) -> None:
    table = named_prefixes(state)
    table[key] = list(token_ids)
    table.move_to_end(key)
    while len(table) > NAMED_PREFIXES_MAX:
        table.popitem(last=False)


def apply_cache_key(state: ServerState, key: str | None, prompts: list[list[int]]) -> list[list[int]]:
    """A known key prepends its prefix; an unknown one names this request's first prompt as the prefix."""
    if key is None:
        return prompts
    prefix = named_prefixes(state).get(key)
    if prefix is None:
        remember_prefix(state, key, prompts[0])
        return prompts
    named_prefixes(state).move_to_end(key)
    return [prefix + p for p in prompts]


def build_job(request: Request, body: SamplingFields, *, chat: bool, cached: bool) -> Job:
    state = state_of(request)
    check_model(state, body.model)
    engine = ready_engine(request)
    prompts = [chat_prompt(engine, body)] if chat else completion_prompts(engine, body.prompt)
    if cached:
        prompts = apply_cache_key(state, body.cache_key, prompts)
    limit = engine.backend.max_model_len
    requested = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
        if body.echo and logprobs is not None:
            raise APIError(400, "echo: prompt logprobs are not computed; use echo without logprobs",
                           param="echo", code="unsupported")
    params: list[SamplingParams] = []
    for ids in prompts:
        if len(ids) >= limit:
            raise APIError(
                400,
                f"prompt: {len(ids)} tokens; the model's context length is {limit} tokens "
                f"and at least one must be left for the output",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        room = limit - len(ids)
        if cached and body.enable_sliding_window:  # a window lets generation run past the context
            room = requested if requested is not None else room
        max_tokens = min(requested if requested is not None else (room if chat else 16), room)
        for i in range(body.n):
            try:
                params.append(
                    SamplingParams(
                        max_tokens=max_tokens,
                        temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=1.0 if body.top_p is None else body.top_p,
                        top_k=body.top_k or 0,
                        min_p=body.min_p or 0.0,
                        repetition_penalty=body.repetition_penalty,
                        presence_penalty=body.presence_penalty,
                        frequency_penalty=body.frequency_penalty,
                        seed=None if body.seed is None else body.seed + i,
                        stop=stop,
                        stop_token_ids=list(body.stop_token_ids or []),
                        ignore_eos=body.ignore_eos,
                        logprobs=logprobs,
                    )
                )
            except ValueError as exc:
                raise APIError(400, str(exc), param=param_of(str(exc)), code="invalid_value") from None
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = getattr(body, "request_id", None) if cached else None
    return Job(prompts, params, body.n, chat, cached, body, id=request_id or f"{prefix}-{uuid.uuid4().hex}")


# ---- running a job ------------------------------------------------------------------------


def submit_all(engine: Engine, job: Job, loop: asyncio.AbstractEventLoop) -> list[tuple[str, Any]]:
    """Submit every choice now (so queue-full and bad input become HTTP errors before any byte is sent)."""
    body = job.body
    use_cache = getattr(body, "enable_caching", True)
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
                    loop=loop,
                )
            )
    except Exception:
        for request_id, _ in submitted:
            engine.abort(request_id)
        raise
    return submitted


async def merged(engine: Engine, submitted: list[tuple[str, Any]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all choices as they come, tagged with the choice index."""
    if len(submitted) == 1:  # the common case needs no fan-in task per choice
        request_id, stream = submitted[0]
        async for output in engine.outputs(request_id, stream):
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, request_id: str, stream: Any) -> None:
        try:
            async for output in engine.outputs(request_id, stream):
                await queue.put((index, output))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, rid, s)) for i, (rid, s) in enumerate(submitted)]
    try:
        remaining = len(tasks)
        while remaining:
            index, output = await queue.get()
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


# ---- response shapes -------------------------------------------------------------------------


def usage_of(job: Job, choices: list[Choice]) -> dict[str, Any]:
    firsts = [c for c in choices if c.index % job.n == 0]  # a prompt counts once, whatever n
    prompt = sum(len(p) for p in job.prompts)
    cached = sum(c.cached_tokens for c in firsts)
    completion = sum(len(c.token_ids) for c in choices)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if job.cached:
        usage["cached_tokens"] = cached
    return usage


def token_text(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def completion_logprobs(engine: Engine, items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for item in items:
        text = token_text(engine, item.token_id)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_logprobs.append(item.logprob)
        top.append({token_text(engine, t): lp for t, lp in item.top_logprobs})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(engine: Engine, items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(engine, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(i.token_id, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top_logprobs]}
            for i in items
        ]
    }


def cache_report(engine: Engine, job: Job, choices: list[Choice]) -> dict[str, Any]:
    """The measured ``cache_stats`` and ``performance`` of a /v1/cached/* response."""
    bs = engine.pool.block_size
    firsts = [c for c in choices if c.index % job.n == 0]
    hits = sum(c.cached_tokens // bs for c in firsts)
    misses = sum(max(0, (len(p) - 1) // bs) for p in job.prompts) - hits
    timings = [c.timings for c in choices if c.timings is not None]
    total = time.perf_counter() - job.started
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "cache_stats": {
            "cache_used": hits > 0,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
            "cache_hits": hits,
            "cache_misses": max(misses, 0),
            "speculation_hits": sum(c.timings.accepted_drafts for c in choices if c.timings is not None),
            "prefix_matches": sum(1 for c in firsts if c.cached_tokens > 0),
            "window_reuse": sum(1 for c in choices if c.timings is not None and c.timings.windows_slid),
        },
        "performance": {
            "total_time_ms": round(total * 1000, 3),
            "cache_time_ms": round(sum(t.cache_lookup for t in timings) * 1000, 3),
            "inference_time_ms": round(max((t.inference for t in timings), default=0.0) * 1000, 3),
            "tokens_per_second": round(completion / total, 3) if total > 0 else 0.0,
            "memory_usage_bytes": sum(t.peak_kv_bytes for t in timings),
        },
    }


def full_response(engine: Engine, state: ServerState, job: Job, choices: list[Choice]) -> dict[str, Any]:
    created = int(time.time())
    if job.chat:
        body_choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": chat_logprobs(engine, c.logprobs) if job.params[c.index].logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        kind = "chat.completion"
    else:
        body_choices = [
            {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": completion_logprobs(engine, c.logprobs) if job.params[c.index].logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        kind = "text_completion"
    response = {
        "id": job.id,
        "object": kind,
        "created": created,
        "model": state.model_name,
        "choices": body_choices,
        "usage": usage_of(job, choices),
    }
    if job.cached:
        response.update(cache_report(engine, job, choices))
    return response


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def observe(state: ServerState, job: Job, choices: list[Choice], first_token_at: float | None) -> None:
    metrics = state.extras.get("metrics")
    if metrics is None:
        return
    now = time.perf_counter()
    usage = usage_of(job, choices)
    metrics.count_tokens(usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
    metrics.observe_e2e(now - job.started)
    if first_token_at is not None:
        metrics.observe_ttft(first_token_at - job.started)
        generated = usage["completion_tokens"]
        if generated > len(choices):
            metrics.observe_tpot((now - first_token_at) / (generated - len(choices)))
    aborted = any(c.finish_reason == "abort" for c in choices)
    metrics.count_outcome("abort" if aborted else "success")


# ---- handlers ----------------------------------------------------------------------------------


async def respond(request: Request, body: SamplingFields, *, chat: bool, cached: bool) -> Response | Stream:
    state = state_of(request)
    job = build_job(request, body, chat=chat, cached=cached)
    engine = state.engine
    if body.beam_width is not None and body.beam_width > 1:
        return await respond_with_beams(engine, state, job)
    submitted = submit_all(engine, job, asyncio.get_running_loop())
    choices = [Choice(index=i, prompt_index=i // job.n) for i in range(len(submitted))]
    if not chat and body.echo:  # the prompt's text comes first, as OpenAI's echo does
        for choice in choices:
            choice.text.append(engine.tokenizer.decode(job.prompts[choice.prompt_index]))
    if not body.stream:
        first_token_at = None
        async for index, output in merged(engine, submitted):
            if first_token_at is None and output.token_ids:
                first_token_at = time.perf_counter()
            fold(choices[index], output)
        observe(state, job, choices, first_token_at)
        return Response(full_response(engine, state, job, choices))
    return Stream(stream_events(engine, state, job, submitted, choices), media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def respond_with_beams(engine: Engine, state: ServerState, job: Job) -> Response:
    """Beam search: the ``n`` best beams of each prompt become its choices (no streaming)."""
    from tierserve.core.beam_search import BeamSearchParams

    body = job.body
    if body.stream:
        raise APIError(400, "stream: beam search returns whole beams; allowed: false with beam_width > 1",
                       param="stream", code="unsupported")
    try:
        params = BeamSearchParams(
            beam_width=body.beam_width,
            max_tokens=job.params[0].max_tokens,
            length_penalty=body.length_penalty,
            early_stopping=body.early_stopping,
            num_return_sequences=job.n,
            min_tokens=body.min_tokens,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param=param_of(str(exc)), code="invalid_value") from None
    choices: list[Choice] = []
    for prompt_index, prompt in enumerate(job.prompts):
        beams = await asyncio.to_thread(engine.beam_search, prompt, params)
        for rank, beam in enumerate(beams):
            choice = Choice(index=prompt_index * job.n + rank, prompt_index=prompt_index)
            choice.token_ids = list(beam.token_ids)
            text = engine.tokenizer.decode(
                [t for t in beam.token_ids if t not in engine.backend.eos_token_ids], skip_special_tokens=True
            )
            choice.text = [text]
            choice.finish_reason = beam.finish_reason
            choices.append(choice)
    return Response(full_response(engine, state, job, choices))


async def stream_events(engine, state, job: Job, submitted, choices: list[Choice]) -> AsyncIterator[bytes]:
    created = int(time.time())
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    first_token_at = None
    started_roles: set[int] = set()
    offsets = [0] * len(choices)
    completed = False
    try:
        for choice in choices:
            if choice.text:  # echo: the prompt's text goes out first
                offsets[choice.index] = len(choice.text[0])
                echoed = {"index": choice.index, "text": choice.text[0], "logprobs": None, "finish_reason": None}
                yield sse({"id": job.id, "object": kind, "created": created, "model": state.model_name,
                           "choices": [echoed]})
        async for index, output in merged(engine, submitted):
            if first_token_at is None and output.token_ids:
                first_token_at = time.perf_counter()
            fold(choices[index], output)
            logprobs = None
            wants = job.params[index].logprobs is not None
            if job.chat:
                delta: dict[str, Any] = {}
                if index not in started_roles:
                    delta["role"] = "assistant"
                    started_roles.add(index)
                if output.text or not output.finished:
                    delta["content"] = output.text
                if wants and output.logprobs:
                    logprobs = chat_logprobs(engine, output.logprobs)
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": output.finish_reason}
            else:
                if wants and output.logprobs:
                    logprobs = completion_logprobs(engine, output.logprobs, offsets[index])
                offsets[index] += len(output.text)
                choice = {"index": index, "text": output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}
            yield sse({"id": job.id, "object": kind, "created": created, "model": state.model_name, "choices": [choice]})
        tail: dict[str, Any] = {"id": job.id, "object": kind, "created": created, "model": state.model_name, "choices": []}
        options = job.body.stream_options
        if options is not None and options.include_usage:
            tail["usage"] = usage_of(job, choices)
        if job.cached:
            tail.update(cache_report(engine, job, choices))
        if len(tail) > 5:
            yield sse(tail)
        yield sse("[DONE]")
        completed = True
    finally:
        if completed:
            observe(state, job, choices, first_token_at)
        else:
            metrics = state.extras.get("metrics")
            if metrics is not None:
                metrics.count_outcome("abort")


@get("/v1/models", sync_to_thread=False)
def list_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    engine = state.engine
    entry = {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "tierserve",
        "name": state.model_name,
        "description": f"{state.settings.model.path} on the {state.settings.model.backend} backend",
        "status": "ready" if state.ready else ("failed" if state.load_error else "loading"),
        "max_model_len": engine.backend.max_model_len if state.ready and engine else None,
    }
    return {"object": "list", "data": [entry]}


@get("/v1/models/{model_id:str}", sync_to_thread=False)
def get_model(request: Request, model_id: FromPath[str]) -> dict[str, Any]:
    check_model(state_of(request), model_id)
    return list_models.fn(request)["data"][0]


@post("/v1/completions", status_code=200)
async def completions(request: Request, data: JSONBody[CompletionRequest]) -> Response | Stream:
    return await respond(request, data, chat=False, cached=False)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, data: JSONBody[ChatRequest]) -> Response | Stream:
    return await respond(request, data, chat=True, cached=False)


@post("/v1/cached/completions", status_code=200)
async def cached_completions(request: Request, data: JSONBody[CachedCompletionRequest]) -> Response | Stream:
    return await respond(request, data, chat=False, cached=True)


@post("/v1/cached/chat/completions", status_code=200)
async def cached_chat_completions(request: Request, data: JSONBody[CachedChatRequest]) -> Response | Stream:
    return await respond(request, data, chat=True, cached=True)


ROUTES = [list_models, get_model, completions, chat_completions, cached_completions, cached_chat_completions]
