"""OpenAI-compatible generation: /v1/models, /v1/completions, /v1/chat/completions and their /v1/cached/* twins."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, get, post
from litestar.params import FromPath, JSONBody
from litestar.response import Stream

from tierserve.engine import EngineClient, RequestTimings
from tierserve.core.errors import EngineFault, RequestError, RequestTimeoutError
from tierserve.engine.process import EngineProcessError
from tierserve.server.connection import CLIENT_CLOSED, ClientDisconnected, unless_disconnected
from tierserve.server.errors import NotImplementedFeature, engine_gone_body, error_body, timeout_body
from tierserve.server.generation_jobs import Choice, Job, build_job, collect, echo_prompts, fold, merged, submit_all
from tierserve.server.openai_responses import (
    cache_report,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    full_response,
    observe,
    sse,
    usage_of,
)
from tierserve.server.schemas import (
    CachedChatRequest,
    CachedCompletionRequest,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
)
from tierserve.server.state import ServerState, state_of
from tierserve.server.tenants import cache_scope
from tierserve.server.tool_streaming import ToolStream


async def respond(request: Request, body: SamplingFields, *, chat: bool, cached: bool) -> Response | Stream:
    state = state_of(request)
    job = await build_job(request, body, chat=chat, cached=cached)
    engine = job.engine
    try:
        if cached and body.use_beam_search and body.beam_width is None:
            body.beam_width = state.settings.speculative.beam_width
        if body.beam_width is not None and body.beam_width > 1:
            return await respond_with_beams(request, engine, state, job)
        submitted = submit_all(engine, job, asyncio.get_running_loop())
    finally:
        job.target.release()  # submitted: the engine tracks them now (an unload waits for them there)
    choices = [Choice(index=i, prompt_index=i // job.n) for i in range(len(submitted))]
    scored = job.params[0].prompt_logprobs is not None
    if not chat and body.echo:  # the prompt's text comes first, as OpenAI's echo does
        await asyncio.to_thread(echo_prompts, engine, job, choices)
    if not body.stream:
        try:
            first_token_at = await unless_disconnected(request, collect(engine, job, submitted, choices))
        except RequestTimeoutError:
            return Response(timeout_body(state.settings.server.timeout_seconds), status_code=504)
        except ClientDisconnected:  # its requests are aborted; nobody reads this, the access log and metrics do
            return Response(None, status_code=CLIENT_CLOSED)
        observe(state, job, choices, first_token_at)
        if scored:  # a text per prompt token and alternative: off the event loop for a long prompt
            return Response(await asyncio.to_thread(full_response, engine, state, job, choices))
        return Response(full_response(engine, state, job, choices))
    return Stream(stream_events(engine, state, job, submitted, choices), media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def respond_with_beams(request: Request, engine: EngineClient, state: ServerState, job: Job) -> Response:
    """Beam search: the ``n`` best beams of each prompt become its choices (no streaming)."""
    from tierserve.engine.beam_search import BeamSearchParams

    body = job.body
    params = BeamSearchParams(  # its values are checked first: an invalid one is the 400, before any 501
        beam_width=body.beam_width,
        max_tokens=job.params[0].max_tokens,
        length_penalty=body.length_penalty,
        early_stopping=body.early_stopping,
        num_return_sequences=job.n,
        min_tokens=body.min_tokens,
    )
    if body.stream:
        raise NotImplementedFeature("stream", True, "streaming beam search", "false with beam_width > 1")
    if body.logit_bias:
        raise NotImplementedFeature("logit_bias", body.logit_bias, "beam search with a logit bias",
                                    "omitted with beam_width > 1")  # fmt: skip
    if getattr(body, "cache_key", None) is not None:
        raise NotImplementedFeature("cache_key", body.cache_key, "beam search on a named prefix",
                                    "omitted with beam_width > 1")  # fmt: skip
    if job.params[0].grammar is not None:
        param = job.params[0].grammar.param
        raise NotImplementedFeature(param, getattr(body, param, None), "beam search with an output constraint",
                                    "omitted with beam_width > 1")  # fmt: skip
    if job.params[0].prompt_logprobs is not None:
        param = "prompt_logprobs" if body.prompt_logprobs is not None else "echo"
        supported = "omitted" if param == "prompt_logprobs" else "false, or logprobs omitted,"
        raise NotImplementedFeature(param, getattr(body, param), "prompt log-probabilities with beam search",
                                    f"{supported} with beam_width > 1")  # fmt: skip
    if job.target is not None and job.target.lora_name is not None:
        raise NotImplementedFeature("model", job.model, f"beam search on a LoRA adapter ({job.target.lora_name!r})",
                                    f"a base model with beam_width > 1, such as {job.target.served.name!r}")  # fmt: skip
    choices: list[Choice] = []
    # the prompt reuses and publishes cached prefixes as a request's does: in the caller's cache scope
    scope, use_cache = cache_scope(job.tenant, body.cache_salt), getattr(body, "enable_caching", True)
    for prompt_index, prompt in enumerate(job.prompts):
        search_id = f"{job.id}-{prompt_index}"
        try:  # the search runs between the engine's steps; a client that leaves stops it
            search = asyncio.to_thread(
                engine.beam_search, prompt, params, search_id, cache_salt=scope, use_prefix_cache=use_cache
            )
            searched = await unless_disconnected(request, search)
        except ClientDisconnected:
            await asyncio.to_thread(engine.cancel_beam_search, search_id)
            return Response(None, status_code=CLIENT_CLOSED)
        for rank, beam in enumerate(searched.hypotheses):
            choice = Choice(index=prompt_index * job.n + rank, prompt_index=prompt_index)
            # the search's time and peak KV, once per prompt (the report sums memory over choices)
            peak = searched.peak_blocks * engine.info.kv_block_bytes if rank == 0 else 0
            lookup = searched.cache.lookup_seconds if searched.cache is not None and rank == 0 else 0.0
            choice.timings = RequestTimings(0.0, lookup, searched.seconds, None, peak)
            # the prompt's lookup: usage and cache_stats count it once per prompt (its first choice)
            choice.cache = searched.cache
            choice.cached_tokens = searched.cache.cached_tokens if searched.cache is not None else 0
            choice.prompt_tokens = len(prompt)
            choice.token_ids = list(beam.token_ids)
            text = engine.decode(
                [t for t in beam.token_ids if t not in engine.info.eos_token_ids], skip_special_tokens=True
            )
            choice.text = [text]
            choice.finish_reason = beam.finish_reason
            choices.append(choice)
    observe(state, job, choices, None)  # usage and metrics count a beam request as any other
    return Response(full_response(engine, state, job, choices))


async def stream_events(engine, state, job: Job, submitted, choices: list[Choice]) -> AsyncIterator[bytes]:
    created = int(time.time())
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    first_token_at = None
    started_roles: set[int] = set()
    tool_streams: dict[int, ToolStream] = {}
    offsets = [0] * len(choices)
    completed = failed = False

    def echoed(choice: Choice) -> bytes:
        logprobs = None
        if choice.prompt_pieces is not None:
            ids = job.prompts[choice.prompt_index]
            logprobs = echoed_prompt_logprobs(engine, ids, choice.prompt_logprobs, choice.prompt_pieces, job.body.logprobs)
        echo = {"index": choice.index, "text": choice.text[0], "logprobs": logprobs, "finish_reason": None}
        return sse({"id": job.id, "object": kind, "created": created, "model": job.model, "choices": [echo]})

    try:
        unechoed = set()  # echoes whose prompt logprobs come with the choice's first output
        for choice in choices:
            if choice.text:  # echo: the prompt's text goes out first
                offsets[choice.index] = len(choice.text[0])
                if choice.prompt_pieces is not None:
                    unechoed.add(choice.index)
                else:
                    yield echoed(choice)
        async for index, output in merged(engine, submitted, job.deadline):
            if first_token_at is None and output.token_ids:
                first_token_at = time.perf_counter()
            fold(choices[index], output)
            if index in unechoed:  # a text per prompt token and alternative: off the event loop
                unechoed.discard(index)
                yield await asyncio.to_thread(echoed, choices[index])
            logprobs = None
            wants = job.params[index].logprobs is not None
            if job.chat:
                delta: dict[str, Any] = {}
                if index not in started_roles:
                    delta["role"] = "assistant"
                    started_roles.add(index)
                text, finish_reason = output.text, output.finish_reason
                if job.tool_parser is not None:  # calls leave as tool-call deltas, not as text
                    tools = tool_streams.setdefault(index, ToolStream(job.tool_parser))
                    text, calls, finish_reason = tools.feed(output.text, output.finish_reason)
                    if calls:
                        delta["tool_calls"] = calls
                if text or (not output.finished and "tool_calls" not in delta):
                    delta["content"] = text
                if wants and output.logprobs:
                    logprobs = chat_logprobs(engine, output.logprobs)
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            else:
                if wants and output.logprobs:
                    logprobs = completion_logprobs(engine, output.logprobs, offsets[index])
                offsets[index] += len(output.text)
                choice = {"index": index, "text": output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}
            yield sse({"id": job.id, "object": kind, "created": created, "model": job.model, "choices": [choice]})
        tail: dict[str, Any] = {"id": job.id, "object": kind, "created": created, "model": job.model, "choices": []}
        options = job.body.stream_options
        if options is not None and options.include_usage:
            tail["usage"] = usage_of(job, choices)
        if job.cached:
            tail.update(cache_report(job, choices), request_id=job.id)
        if len(tail) > 5:
            yield sse(tail)
        yield sse("[DONE]")
        completed = True
    except RequestTimeoutError:  # the status line is long gone: the error travels as the last event
        failed = True
        yield sse(timeout_body(state.settings.server.timeout_seconds))
        yield sse("[DONE]")
    except EngineFault as fault:  # a plugin raised in the engine: the same, as a 500's body
        failed = True
        yield sse(error_body(500, str(fault), None, "engine_fault"))
        yield sse("[DONE]")
    except RequestError as refused:  # the request could not be followed (its schema): as a 400's body
        failed = True
        yield sse(error_body(400, refused.message, refused.param, refused.code))
        yield sse("[DONE]")
    except EngineProcessError as gone:  # the core process died under it: the 503's body (retryable or not)
        failed = True
        yield sse(engine_gone_body(gone))
        yield sse("[DONE]")
    finally:
        if completed:
            observe(state, job, choices, first_token_at)
        else:
            metrics = state.extras.get("metrics")
            if metrics is not None:
                metrics.count_outcome("error" if failed else "abort")


def model_entry(state: ServerState, name: str) -> dict[str, Any]:
    """OpenAI's model object for a served name (a version, an alias or a LoRA adapter), with its status."""
    registry = state.registry
    target = registry.lookup(name)
    served = target.served
    engine = served.engine
    ready = served.status == "ready" and engine is not None
    # the backend that runs ("auto" becomes its choice once the engine is built)
    backend = engine.info.backend if ready else served.settings.model.backend
    entry = {
        "id": name,
        "object": "model",
        "created": int(served.created),
        "owned_by": "tierserve",
        "name": name,
        "description": f"{served.settings.model.path} on the {backend} backend",
        "backend": backend,
        "status": served.status,
        "max_model_len": engine.info.max_model_len if ready else None,
        "root": served.id,  # the version it runs on (vLLM's field)
        "parent": None,
    }
    if served.version is not None:
        entry.update(registry.describe(served))
    if target.lora_name is not None:
        adapter = engine.loras.get(target.lora_name, {}) if engine is not None else {}
        entry.update(parent=served.id, root=str(adapter.get("path")), lora_rank=adapter.get("rank"),
                     description=f"LoRA adapter {target.lora_name!r} on {served.id}")  # fmt: skip
    return entry


@get("/v1/models", sync_to_thread=False)
def list_models(request: Request) -> dict[str, Any]:
    """The models served: every loaded version and alias, with its context length and state."""
    state = state_of(request)
    return {"object": "list", "data": [model_entry(state, name) for name in state.model_names]}


@get("/v1/models/{model_id:str}", sync_to_thread=False)
def get_model(request: Request, model_id: FromPath[str]) -> dict[str, Any]:
    """One served model by id or alias; 404 naming the models there are."""
    state = state_of(request)
    return model_entry(state, model_id)


@post("/v1/completions", status_code=200)
async def completions(request: Request, data: JSONBody[CompletionRequest]) -> Response | Stream:
    """OpenAI completions: ``prompt`` (text or token ids), sampling, ``stream: true`` for SSE; ``echo`` with ``logprobs`` scores the prompt's tokens too (``max_tokens: 0``: only them); ``usage`` counts cached prompt tokens."""
    return await respond(request, data, chat=False, cached=False)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, data: JSONBody[ChatRequest]) -> Response | Stream:
    """OpenAI chat completions: ``messages`` through the model's chat template, ``tools``, ``response_format``, ``stream: true`` for SSE."""
    return await respond(request, data, chat=True, cached=False)


@post("/v1/cached/completions", status_code=200)
async def cached_completions(request: Request, data: JSONBody[CachedCompletionRequest]) -> Response | Stream:
    """Completions that also report what the cache did for this request (``cache_stats``: tokens per tier, timings) and take the cache fields of the serving spec."""
    return await respond(request, data, chat=False, cached=True)


@post("/v1/cached/chat/completions", status_code=200)
async def cached_chat_completions(request: Request, data: JSONBody[CachedChatRequest]) -> Response | Stream:
    """Chat completions with the per-request cache report and cache fields of ``/v1/cached/completions``."""
    return await respond(request, data, chat=True, cached=True)


ROUTES = [list_models, get_model, completions, chat_completions, cached_completions, cached_chat_completions]
