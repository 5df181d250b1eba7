"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request becomes a chat completion (``instructions`` a system message, the
input items chat messages, ``text.format`` a response format, function tools
as chat tools) and runs through the same job, engine and tool parser. With
``store: true`` the response and its whole conversation are kept
(``[server] responses_max_stored``, ``responses_ttl_seconds``): a follow-up that
names it in ``previous_response_id`` renders the earlier turns to the same
tokens, so their KV is a prefix-cache hit (``usage.input_tokens_details.cached_tokens``).
``stream: true`` sends OpenAI's typed events. What OpenAI's API has and tierserve
deliberately does not build (``reasoning``, ``background``, ``include``,
``truncation: "auto"``, built-in tools and their items) is a 501 naming it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from litestar import Request, Response, delete, get, post
from litestar.params import FromPath, JSONBody
from litestar.response import Stream
from pydantic import Field, ValidationError, field_validator, model_validator

from tierserve.core.errors import RequestTimeoutError
from tierserve.engine.process import EngineProcessError
from tierserve.server.connection import CLIENT_CLOSED, ClientDisconnected, unless_disconnected
from tierserve.server.errors import APIError, NotImplementedFeature
from tierserve.server.generation_jobs import Choice, Job, build_job, collect, fold, merged, submit_all
from tierserve.server.openai_responses import observe
from tierserve.server.response_store import ResponseStore, StoredResponse
from tierserve.server.schemas import MAX_MESSAGES, MAX_TOOLS, Body, ChatRequest
from tierserve.server.state import ServerState, state_of
from tierserve.server.tenants import caller_of
from tierserve.server.tool_streaming import ToolStream, finish_with_calls

TEXT_PARTS = ("input_text", "output_text", "text")
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds on metadata
INPUT_ITEMS = ("message", "function_call", "function_call_output")
# OpenAI's built-in tools and the input items only they (or reasoning) produce: recognised, not built (a 501)
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
                  "image_generation", "mcp", "local_shell", "custom")  # fmt: skip
UNBUILT_ITEMS = ("reasoning", "item_reference", "web_search_call", "file_search_call", "computer_call",
                 "computer_call_output", "code_interpreter_call", "image_generation_call", "local_shell_call",
                 "local_shell_call_output", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
                 "mcp_call", "custom_tool_call", "custom_tool_call_output")  # fmt: skip


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # not built: anything but their defaults is a 501, never silently ignored
    reasoning: dict[str, Any] | None = None
    background: bool = False
    include: list[str] | None = None

    @field_validator("metadata")
    @classmethod
    def bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        long_keys = [key[:20] for key in value if len(key) > METADATA_KEY_CHARS]
        long_values = [key[:20] for key, text in value.items() if len(text) > METADATA_VALUE_CHARS]
        if len(value) > METADATA_KEYS or long_keys or long_values:
            raise ValueError(
                f"at most {METADATA_KEYS} keys of at most {METADATA_KEY_CHARS} characters, each value a string of at "
                f"most {METADATA_VALUE_CHARS} characters (as OpenAI's); got {len(value)} keys"
                + (f", keys too long: {long_keys}" if long_keys else "")
                + (f", values too long for {long_values}" if long_values else "")
            )
        return value

    @model_validator(mode="after")
    def nothing_unbuilt(self) -> ResponsesRequest:
        if self.reasoning:
            raise NotImplementedFeature("reasoning", self.reasoning, "reasoning", "omitted or null")
        if self.background:
            raise NotImplementedFeature("background", True, "running a response in the background", "false or omitted")
        if self.include:
            raise NotImplementedFeature("include", self.include, "extra output data", "omitted or []")
        if self.truncation == "auto":
            raise NotImplementedFeature("truncation", "auto", "dropping early turns to fit the context",
                                        '"disabled" or omitted')  # fmt: skip
        return self


def persistent_folder(state: ServerState) -> Path | None:
    """``responses/`` in the first persistent disk tier's folder: stored responses outlive a restart there."""
    for tier in state.settings.kv_cache.tiers:
        path = getattr(tier.options, "path", None)
        if tier.plugin == "disk" and path and getattr(tier.options, "persistent", False):
            return Path(path).expanduser() / "responses"
    return None


def response_store(state: ServerState) -> ResponseStore:
    store = state.extras.get("responses")
    if store is None:
        server = state.settings.server
        store = ResponseStore(server.responses_max_stored, server.responses_ttl_seconds, persistent_folder(state),
                              max_bytes=server.responses_max_bytes)  # fmt: skip
        state.extras["responses"] = store
    return store  # type: ignore[return-value]


def setup(state: ServerState) -> None:
    response_store(state)  # a persistent store loads what the previous run kept before the first request


def teardown(state: ServerState) -> None:
    store = state.extras.pop("responses", None)
    if store is not None:
        store.close()


def bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def item_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{param}: a string or a list of input_text parts", param)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"{param}[{index}]: type {kind!r}; allowed: input_text, output_text (the models read text only)",
                      f"{param}[{index}]")  # fmt: skip
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as chat messages (function calls and their outputs included)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    unbuilt: tuple[str, str] | None = None  # the first such item: a 501 once every item is known to be valid
    for index, item in enumerate(value):
        kind = item.get("type", "message")
        where = f"input[{index}]"
        if kind in UNBUILT_ITEMS:
            unbuilt = unbuilt or (f"{where}.type", kind)
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{where}.role: {role!r}; allowed: user, system, developer, assistant", f"{where}.role")
            messages.append({"role": role, "content": item_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
            if not isinstance(call["id"], str) or not isinstance(item.get("name"), str):
                raise bad(f"{where}: a function_call needs call_id and name", where)
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}: a function_call_output needs call_id", where)
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else json.dumps(output)})  # fmt: skip
        else:
            raise bad(f"{where}.type: {kind!r}; allowed: {', '.join(INPUT_ITEMS)}", f"{where}.type")
    if unbuilt is not None:
        raise NotImplementedFeature(*unbuilt, "an input item of reasoning or of a built-in tool",
                                    ", ".join(INPUT_ITEMS))  # fmt: skip
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    out = []
    built_in: tuple[str, str] | None = None  # the first: a 501 once every tool is known to be valid
    for index, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind in BUILT_IN_TOOLS:
            built_in = built_in or (f"tools[{index}].type", kind)
            continue
        if kind != "function":
            raise bad(f"tools[{index}].type: {kind!r}; allowed: function", f"tools[{index}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    if built_in is not None:
        raise NotImplementedFeature(*built_in, "a built-in tool", "function")
    return out or None


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad(f"text.format: an object with a type (text, json_object, json_schema); got {type(fmt).__name__}",
                  "text.format")  # fmt: skip
    if fmt is None or fmt.get("type") in ("text", "json_object"):
        return fmt
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise bad(f"text.format.type: {fmt.get('type')!r}; allowed: text, json_object, json_schema", "text.format")


def conversation(state: ServerState, data: ResponsesRequest, tenant: str) -> list[dict[str, Any]]:
    """The earlier turns (``previous_response_id``) and the new input, as chat messages (no instructions)."""
    earlier: list[dict[str, Any]] = []
    if data.previous_response_id is not None:
        stored = response_store(state).get(data.previous_response_id, tenant)
        if stored is None:
            raise APIError(400, f"previous_response_id: no stored response {data.previous_response_id!r} (never "
                           "stored, expired, or another tenant's)", param="previous_response_id",
                           code="previous_response_not_found")  # fmt: skip
        earlier = [dict(m) for m in stored.messages]
    return earlier + input_messages(data.input)


def chat_request(data: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatRequest:
    with_instructions = ([{"role": "system", "content": data.instructions}] if data.instructions else []) + messages
    values = {
        "model": data.model, "messages": with_instructions, "max_tokens": data.max_output_tokens,
        "temperature": data.temperature, "top_p": data.top_p, "tools": chat_tools(data.tools),
        "tool_choice": chat_tool_choice(data.tool_choice), "parallel_tool_calls": data.parallel_tool_calls,
        "response_format": chat_format(data.text), "user": data.user,
    }  # fmt: skip
    try:
        return ChatRequest(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise bad(f"{where}: {error['msg']}", where) from None


def output_items(job: Job, choice: Choice) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The Response's output items, and the assistant message that joins the stored conversation."""
    text = "".join(choice.text)
    calls = []
    if job.tool_parser is not None:
        content, calls, _ = finish_with_calls(job.tool_parser, text, choice.finish_reason)
        text = content or "" if calls else text
    items: list[dict[str, Any]] = []
    if text or not calls:
        items.append(message_item(text, "completed"))
    openai_calls = [call.as_openai() for call in calls]
    items += [function_item(call, "completed") for call in openai_calls]
    message = {"role": "assistant", "content": text or None}
    if openai_calls:
        message["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")} for c in openai_calls]
    return items, message


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else [],
    }  # fmt: skip


def function_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"], "status": status}  # fmt: skip


def response_object(
    data: ResponsesRequest, job: Job, response_id: str, created: float, status: str,
    output: list[dict[str, Any]], choice: Choice | None,
) -> dict[str, Any]:  # fmt: skip
    body: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": int(created), "status": status, "model": job.model,
        "output": output, "error": None, "incomplete_details": None, "instructions": data.instructions,
        "previous_response_id": data.previous_response_id, "store": data.store,
        "max_output_tokens": data.max_output_tokens, "temperature": data.temperature if data.temperature is not None else 1.0,
        "top_p": data.top_p if data.top_p is not None else 1.0, "tools": data.tools or [],
        "tool_choice": data.tool_choice or "auto", "parallel_tool_calls": data.parallel_tool_calls,
        "text": data.text or {"format": {"type": "text"}}, "metadata": data.metadata or {}, "truncation": "disabled",
        "usage": None,
    }  # fmt: skip
    if choice is not None:
        prompt = len(job.prompts[0])
        generated = len(choice.token_ids)
        body["usage"] = {
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": choice.cached_tokens},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated,
        }  # fmt: skip
        if choice.finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


@post("/v1/responses", status_code=200)
async def create_response(request: Request, data: JSONBody[ResponsesRequest]) -> Response | Stream:
    """Generate a response; ``stream: true`` sends typed events ending with ``response.completed``."""
    state = state_of(request)
    tenant = caller_of(request.scope).tenant
    messages = conversation(state, data, tenant)
    body = chat_request(data, messages)
    job = await build_job(request, body, chat=True, cached=False)
    engine = job.engine
    try:
        submitted = submit_all(engine, job, asyncio.get_running_loop())
    finally:
        job.target.release()
    response_id = f"resp_{uuid.uuid4().hex}"
    created = time.time()
    choice = Choice(index=0, prompt_index=0)

    def finish(streamed: tuple[list[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The final Response, stored when ``store`` asks; ``streamed``: its items and assistant message as
        they were streamed (their ids, which a follow-up's function_call_output names)."""
        output, message = streamed or output_items(job, choice)
        final = response_object(data, job, response_id, created, "completed", output, choice)
        if data.store:
            response_store(state).put(response_id, StoredResponse(final, [*messages, message], tenant, time.time()))
        return final

    if not data.stream:
        try:
            first_token_at = await unless_disconnected(request, collect(engine, job, submitted, [choice]))
        except RequestTimeoutError:
            raise APIError(504, "the response ran past server.timeout_seconds", code="timeout") from None
        except ClientDisconnected:
            return Response(None, status_code=CLIENT_CLOSED)
        observe(state, job, [choice], first_token_at)
        return Response(finish())
    events = stream_response(data, job, submitted, choice, response_id, created, finish, state)
    return Stream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_response(data, job, submitted, choice, response_id, created, finish, state) -> AsyncIterator[bytes]:
    """OpenAI's event sequence: created, in_progress, the items (text deltas, function calls), completed."""
    sequence = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    started = response_object(data, job, response_id, created, "in_progress", [], None)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    message_id = f"msg_{uuid.uuid4().hex}"
    opened = False
    sent: list[str] = []
    tools = ToolStream(job.tool_parser) if job.tool_parser is not None else None
    calls: list[dict[str, Any]] = []
    first_token_at = None
    try:
        async for _, output in merged(job.engine, submitted, job.deadline):
            if first_token_at is None and output.token_ids:
                first_token_at = time.perf_counter()
            fold(choice, output)
            text, found = output.text, []
            if tools is not None:
                text, found, _ = tools.feed(output.text, output.finish_reason)
            calls += found
            if text:
                if not opened:
                    opened = True
                    yield event("response.output_item.added", output_index=0, item=message_item("", "in_progress", message_id))
                    yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})  # fmt: skip
                sent.append(text)
                yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                            delta=text, logprobs=[])  # fmt: skip
    except RequestTimeoutError:
        yield event("error", code="timeout", message="the response ran past server.timeout_seconds", param=None)
        return
    except EngineProcessError as gone:  # the core process died under it: as the 503 says (retryable or not)
        yield event("error", code=gone.code, message=str(gone), param=None, retryable=gone.retry_after is not None)
        return
    index = 0
    if opened:
        full = "".join(sent)
        part = {"type": "output_text", "text": full, "annotations": [], "logprobs": []}
        yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=full, logprobs=[])
        yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0, part=part)
        done = message_item(full, "completed", message_id)
        yield event("response.output_item.done", output_index=0, item=done)
        index = 1
    output: list[dict[str, Any]] = [done] if opened else []
    for call in calls:
        item = function_item(call, "completed")
        yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    arguments=item["arguments"], name=item["name"])  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item)
        output.append(item)
        index += 1
    message: dict[str, Any] = {"role": "assistant", "content": "".join(sent) or None}
    if calls:
        message["tool_calls"] = [{k: call[k] for k in ("id", "type", "function")} for call in calls]
    final = finish((output, message))
    observe(state, job, [choice], first_token_at)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)


@get("/v1/responses/{response_id:str}", sync_to_thread=False)
def get_response(request: Request, response_id: FromPath[str]) -> dict[str, Any]:
    """A stored response (the caller's tenant's only)."""
    stored = response_store(state_of(request)).get(response_id, caller_of(request.scope).tenant)
    if stored is None:
        raise APIError(404, f"response {response_id!r} is not stored (store: false, expired, or another tenant's)",
                       param="response_id", code="not_found")  # fmt: skip
    return stored.body


@delete("/v1/responses/{response_id:str}", status_code=200, sync_to_thread=False)
def delete_response(request: Request, response_id: FromPath[str]) -> dict[str, Any]:
    """Delete a stored response (the caller's tenant's only); 404 if there is none."""
    if not response_store(state_of(request)).delete(response_id, caller_of(request.scope).tenant):
        raise APIError(404, f"response {response_id!r} is not stored", param="response_id", code="not_found")
    return {"id": response_id, "object": "response", "deleted": True}


ROUTES = [create_response, get_response, delete_response]
