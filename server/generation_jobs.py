"""A generation request turned into engine work: prompts as token ids, sampling parameters, submission, merged outputs."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from litestar import Request

from tierserve.engine import EngineClient, RequestOutput, RequestTimings, TokenLogprob
from tierserve.engine.requests import output_room
from tierserve.core.errors import RequestError
from tierserve.core.outputs import RequestCacheInfo
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.tool_calls import ToolParser, choose_tool_parser
from tierserve.server.errors import APIError, NotImplementedFeature
from tierserve.server.schemas import SamplingFields
from tierserve.server.model_registry import Target
from tierserve.server.state import BODY_REQUEST_ID, state_of
from tierserve.server.tenants import OPEN_TENANT, cache_scope, caller_of


@dataclass
class Choice:
    """One generated sequence, folded from its deltas."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (echo with logprobs, or prompt_logprobs)
    prompt_pieces: list[str] | None = None  # echo with logprobs: the text each prompt token adds to the echo
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
    tenant: str = OPEN_TENANT  # the caller's tenant: its cache scope and its own request ids
    target: Target | None = None  # the model version (and LoRA adapter) it runs on
    tool_parser: ToolParser | None = None  # set when the model may call the request's tools

    @property
    def engine(self) -> EngineClient:
        assert self.target is not None
        return self.target.served.engine  # type: ignore[return-value]


# ---- building a job ---------------------------------------------------------------------


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of the text in a prompt or in messages: every string at any depth (token ids count nothing)."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list) and item and not isinstance(item[0], int):  # a list of ids holds no text
            pending.extend(item)
    return total


def check_prompt_bytes(value: Any, limit: int, param: str) -> None:
    """Refuse more prompt text than ``server.max_prompt_bytes`` before anything is tokenized."""
    size = text_bytes(value)
    if size > limit:
        message = f"{param}: {size} bytes of text; at most {limit} per request (server.max_prompt_bytes)"
        raise APIError(400, message, param=param, code="invalid_value")


def check_max_tokens(requested: int | None, limit: int, param: str) -> None:
    """Refuse a ``max_tokens`` above ``server.max_tokens_limit``, sliding window or not."""
    if requested is not None and requested > limit:
        message = f"{param}: {requested}; at most {limit} tokens per choice here (server.max_tokens_limit)"
        raise APIError(400, message, param=param, code="invalid_value")


def prompt_logprobs_of(body: SamplingFields, chat: bool, logprobs: int | None) -> int | None:
    """Alternatives per prompt token the engine reports (None: the prompt is not scored): vLLM's
    ``prompt_logprobs``, and on completions ``echo`` with ``logprobs`` (OpenAI's legacy scoring: the
    echoed prompt's tokens carry their logprobs too); one list serves both."""
    counts = [count for count in (body.prompt_logprobs, None if chat or not body.echo else logprobs) if count is not None]
    return max(counts) if counts else None


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


def chat_prompt(engine: EngineClient, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[list[int]]:
    return [engine.encode_prompt(messages=messages, tools=tools or None)]


def tool_parser_for(state: Any, engine: EngineClient) -> ToolParser:
    """The tool-call format of the model: the first registered parser that matches its chat template."""
    parsers = [component.factory for component in state.plugins.registry("tool_parsers")]
    if not parsers:
        raise APIError(400, "tools: no tool parser plugin is loaded", param="tools", code="unsupported")
    return choose_tool_parser(parsers, engine.chat_template)


def messages_for_template(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], parser: ToolParser | None, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and the tools) as the chat template takes them. A template that renders tools gets
    them, and earlier calls with their arguments as objects; for one that does not, the parser writes
    the tools into the system message and earlier calls into the assistant's text."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            for call in calls:
                arguments = call["function"].get("arguments", "{}")
                if isinstance(arguments, str):
                    try:
                        call["function"]["arguments"] = json.loads(arguments)
                    except ValueError:
                        pass  # the template gets the text as it came
            message["tool_calls"] = calls
        out.append(message)
    if not tools and not any("tool_calls" in m for m in out):
        return out, None
    if template is not None and "tools" in template and "tool_calls" in template:
        return out, tools or None
    assert parser is not None  # the caller picks one whenever tools or earlier calls are present
    for index, message in enumerate(out):
        if message["role"] == "tool":  # templates without tools know no tool role: a user turn, as Hermes writes it
            out[index] = message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        calls = message.pop("tool_calls", None)
        if calls:
            written = "\n".join(parser.render_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            message["content"] = f"{message.get('content') or ''}{written}"
        if message.get("content") is None:
            message["content"] = ""
    if tools:
        prompt = parser.system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer") and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


async def build_job(request: Request, body: SamplingFields, *, chat: bool, cached: bool) -> Job:
    """Validate a request and resolve its model; the job holds its version until ``job.target.release()``."""
    state = state_of(request)
    target = await state.target_loaded(body.model, admit=True)
    try:
        return await _build_job(request, body, target, chat=chat, cached=cached)
    except BaseException:
        target.release()
        raise


async def _build_job(request: Request, body: SamplingFields, target: Target, *, chat: bool, cached: bool) -> Job:
    state = state_of(request)
    server = state.settings.server
    model = target.name
    engine = target.engine
    requested, sent_as = body.max_tokens, "max_tokens"
    if chat and body.max_completion_tokens is not None:
        requested, sent_as = body.max_completion_tokens, "max_completion_tokens"
    check_max_tokens(requested, server.max_tokens_limit, sent_as)
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    prompt_logprobs = prompt_logprobs_of(body, chat, logprobs)
    if requested == 0 and prompt_logprobs is None:
        scoring = "prompt_logprobs" if chat else "echo with logprobs, or prompt_logprobs"
        message = f"{sent_as}: 0 generates nothing; allowed: 1 or more, or 0 to score the prompt only ({scoring})"
        raise APIError(400, message, param=sent_as, code="invalid_value")
    if body.prompt_logprobs is not None and body.stream:
        supported = "omitted with stream: true" + ("" if chat else " (echo with logprobs streams the prompt's)")
        raise NotImplementedFeature("prompt_logprobs", body.prompt_logprobs, "prompt_logprobs in a stream", supported)
    text: Any = [m.model_dump(exclude_none=True) for m in body.messages] if chat else body.prompt
    check_prompt_bytes(text, server.max_prompt_bytes, "messages" if chat else "prompt")
    tools, tool_mode = body.tools_in_use() if chat else ([], None)
    earlier_calls = chat and any(m.get("tool_calls") for m in text)
    parser = tool_parser_for(state, engine) if tools or earlier_calls else None
    # off the event loop: a long prompt (or chat template) must not stall every other route meanwhile
    if chat:
        messages, template_tools = messages_for_template(text, tools, parser, engine.chat_template)
        prompts = await asyncio.to_thread(chat_prompt, engine, messages, template_tools)
    else:
        prompts = await asyncio.to_thread(completion_prompts, engine, text)
    limit = engine.info.max_model_len
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    # the cached routes take their sampling defaults from [speculative] (the spec's configuration)
    defaults = state.settings.speculative if cached else None
    temperature = body.temperature if body.temperature is not None else (defaults.temperature if defaults else 1.0)
    top_p = body.top_p if body.top_p is not None else (defaults.top_p if defaults else 1.0)
    top_k = body.top_k if body.top_k is not None else (defaults.top_k if defaults else 0)
    grammar = body.grammar()
    if tools and tool_mode != "auto":  # required, or a named function: only a valid call
        if grammar is not None:
            raise APIError(400, f"{grammar.param}: the output is a tool call (tool_choice {body.tool_choice!r}); "
                           "send one of them", param=grammar.param, code="invalid_value")  # fmt: skip
        grammar = parser.grammar(tools, parallel=body.parallel_tool_calls and tool_mode == "required")
    if grammar is not None:
        await asyncio.to_thread(engine.check_grammar, grammar)  # compiled off the loop; submit finds it checked
    params: list[SamplingParams] = []
    for ids in prompts:
        if requested == 0:  # the prompt is scored only: it may fill the whole context
            max_tokens = 0
        else:
            room = min(output_room(len(ids), limit, param="messages" if chat else "prompt"), server.max_tokens_limit)
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
                    prompt_logprobs=prompt_logprobs,
                    grammar=grammar,
                )
            )
    if getattr(body, "cache_key", None) is not None and len(prompts) > 1:
        message = f"cache_key: names one prefix; send one prompt with it (got {len(prompts)} prompts)"
        raise APIError(400, message, param="cache_key", code="invalid_value")
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = getattr(body, "request_id", None) if cached else None
    if request_id is not None and request_id.isascii() and request_id.isprintable():  # a header can carry it
        request.scope.setdefault("state", {})[BODY_REQUEST_ID] = request_id
    timeout = state.settings.server.timeout_seconds
    deadline = asyncio.get_running_loop().time() + timeout if timeout is not None else None
    for ids in prompts:
        target.served.remember_prompt(ids)
    return Job(
        prompts, params, body.n, chat, cached, body, model, deadline,
        id=request_id or f"{prefix}-{uuid.uuid4().hex}", tenant=caller_of(request.scope).tenant, target=target,
        tool_parser=parser if tools else None,
    )  # fmt: skip


# ---- running a job ------------------------------------------------------------------------


def submit_all(engine: EngineClient, job: Job, loop: asyncio.AbstractEventLoop) -> list[tuple[str, Any]]:
    """Submit every choice now (so queue-full and bad input become HTTP errors before any byte is sent)."""
    body = job.body
    use_cache = getattr(body, "enable_caching", True)
    cache_key = getattr(body, "cache_key", None)
    scope = cache_scope(job.tenant, body.cache_salt)
    # ids are unique per tenant: another tenant's id neither blocks nor reveals this one
    engine_id = f"{job.tenant}/{job.id}" if job.tenant else job.id
    submitted: list[tuple[str, Any]] = []
    try:
        for index, params in enumerate(job.params):
            submitted.append(
                engine.submit(
                    job.prompts[index // job.n],
                    params,
                    request_id=f"{engine_id}-{index}",
                    priority=body.priority,
                    cache_salt=scope,
                    use_prefix_cache=use_cache,
                    speculate=getattr(body, "enable_speculation", None),
                    sliding_window=getattr(body, "enable_sliding_window", None),
                    window_size=getattr(body, "window_size", None),
                    # the first choice names the prefix: one request is one use of its key
                    cache_key=cache_key if index == 0 else None,
                    cache_namespace=scope or "",
                    lora_name=job.target.lora_name if job.target is not None else None,
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


async def collect(
    engine: EngineClient, job: Job, submitted: list[tuple[str, Any]], choices: list[Choice]
) -> float | None:
    """Fold every choice's outputs into ``choices``; returns when the first token came (``perf_counter``)."""
    first_token_at = None
    async for index, output in merged(engine, submitted, job.deadline):
        if first_token_at is None and output.token_ids:
            first_token_at = time.perf_counter()
        fold(choices[index], output)
    return first_token_at


async def merged(
    engine: EngineClient, submitted: list[tuple[str, Any]], deadline: float | None = None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all choices as they come, tagged with the choice index (``RequestTimeoutError`` past ``deadline``)."""
    if len(submitted) == 1:  # the common case needs no fan-in task per choice
        request_id, stream = submitted[0]
        async for output in engine.outputs(request_id, stream, deadline=deadline):
            yield 0, output
        return
    # bounded: a consumer that stops reading stops the pumps, so the backlog stays in the request
    # streams, where [server] max_stream_backlog sees it
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(submitted))

    async def pump(index: int, request_id: str, stream: Any) -> None:
        try:
            async for output in engine.outputs(request_id, stream, deadline=deadline):
                await queue.put((index, output))
        except Exception as exc:  # RequestTimeoutError: the consumer raises it
            await queue.put((index, exc))
        else:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, rid, s)) for i, (rid, s) in enumerate(submitted)]
    try:
        remaining = len(tasks)
        while remaining:
            index, output = await queue.get()
            if isinstance(output, Exception):
                raise output
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def echo_prompts(engine: EngineClient, job: Job, choices: list[Choice]) -> None:
    """Completions with ``echo``: each choice's text starts with its prompt's. Where the prompt's tokens carry
    logprobs (``logprobs`` sent), that text is the join of their pieces (``EngineClient.text_pieces``), so each
    token's ``text_offset`` indexes into it."""
    pieces_of: dict[int, list[str]] = {}
    for choice in choices:
        ids = job.prompts[choice.prompt_index]
        if job.body.logprobs is None:
            choice.text.append(engine.decode(ids))
            continue
        if choice.prompt_index not in pieces_of:
            pieces_of[choice.prompt_index] = engine.text_pieces(ids)
        choice.prompt_pieces = pieces_of[choice.prompt_index]
        choice.text.append("".join(choice.prompt_pieces))


def fold(choice: Choice, output: RequestOutput) -> None:
    choice.text.append(output.text)
    choice.token_ids.extend(output.token_ids)
    choice.logprobs.extend(output.logprobs or [])
    if output.prompt_logprobs is not None:
        choice.prompt_logprobs = output.prompt_logprobs
    choice.prompt_tokens = output.prompt_tokens
    choice.cached_tokens = output.cached_tokens
    if output.finished:
        choice.finish_reason = output.finish_reason
        choice.timings = output.timings
        choice.cache = output.cache
        choice.speculation_method = output.speculation_method
