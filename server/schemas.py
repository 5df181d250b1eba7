"""Request bodies of the OpenAI-compatible routes (unknown fields are ignored, as OpenAI does).

Every list is bounded, with a 400 naming the field and the limit: the engine
walks some of them for every token, on the step that all requests share.
Fields and values tierserve deliberately does not build (``best_of`` other than
``n``, ``suffix``, the legacy ``functions``) are refused with a 501, never ignored;
they are checked once every field is valid, so an invalid value is still the 400.
``response_format`` and vLLM's ``guided_*`` fields constrain the output with a
grammar (``core.grammar``).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tierserve.core.errors import RequestError
from tierserve.core.grammar import GrammarSpec, spec_from_schema
from tierserve.core.sampling_params import SamplingParams
from tierserve.server.errors import NotImplementedFeature

MAX_PROMPTS = 2048  # prompts, embedding inputs or warmed conversations per request (OpenAI's embeddings limit)
MAX_TOKEN_IDS = 1 << 20  # token ids in one prompt: more than any context
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
MAX_TIERS = 16
MAX_GRAMMAR_CHARS = 65536  # a regex or grammar compiled per request
MAX_CHOICES = 1024
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_SEED = 2**64 - 1  # what a torch generator takes; negative seeds down to -2**63 are taken as their unsigned twin
PROMPT_FORMS = "a string, a list of strings, a list of token ids (integers) or a list of token id lists"

TokenId = Annotated[StrictInt, Field(ge=0)]
TokenKey = Annotated[int, Field(ge=0)]  # JSON object keys are strings: "50256" is token 50256
Bias = Annotated[float, Field(ge=-SamplingParams.MAX_BIAS, le=SamplingParams.MAX_BIAS)]


def invalid(message: str) -> PydanticCustomError:
    """A validation error whose message is exactly ``message`` (the route adds the field's name)."""
    return PydanticCustomError("invalid_value", message)


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_logprobs(value: Any) -> Any:
    """A logprobs count, bounded as vLLM's ``max_logprobs`` bounds it (``SamplingParams.MAX_LOGPROBS``)."""
    limit = SamplingParams.MAX_LOGPROBS
    if is_token_id(value) and not 0 <= value <= limit:
        raise invalid(f"{value}, allowed: 0 to {limit} (the most likely tokens reported per position)")
    return value


def check_prompts(value: Any, noun: str) -> Any:
    """``value`` as the prompt forms allow it, bounded: at most ``MAX_PROMPTS`` items of at most ``MAX_TOKEN_IDS`` ids.

    Empty prompts pass: the route refuses them with its own message.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"allowed: {PROMPT_FORMS}")
    if len(value) > MAX_TOKEN_IDS:
        raise invalid(f"{len(value)} items, allowed: at most {MAX_PROMPTS} {noun} or {MAX_TOKEN_IDS} token ids")
    if value and all(map(is_token_id, value)):
        return value
    if len(value) > MAX_PROMPTS:
        raise invalid(f"{len(value)} {noun}, allowed: at most {MAX_PROMPTS} per request")
    if all(isinstance(item, str) for item in value):
        return value
    if all(isinstance(item, list) and all(map(is_token_id, item)) for item in value):
        longest = max(map(len, value), default=0)
        if longest > MAX_TOKEN_IDS:
            raise invalid(f"a list of {longest} token ids, allowed: at most {MAX_TOKEN_IDS}")
        return value
    booleans = any(isinstance(x, bool) for item in value for x in (item if isinstance(item, list) else [item]))
    raise invalid(f"allowed: {PROMPT_FORMS}" + (" (true and false are not token ids)" if booleans else ""))


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    """Fields shared by completions and chat completions (plus tierserve extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0 only with prompt logprobs (generation_jobs checks)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    best_of: int | None = Field(None, ge=1)  # accepted when it asks for nothing more than n, else a 501
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # >= 0.01: dividing logits by a near-zero penalty overflows float32 and the draw returns no valid token
    repetition_penalty: float = Field(1.0, ge=0.01, le=10)
    logit_bias: dict[TokenKey, Bias] | None = Field(None, max_length=SamplingParams.MAX_LOGIT_BIAS)
    response_format: dict[str, Any] | None = None
    # vLLM's structured-output fields (one constraint per request, response_format included)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # tierserve extensions
    beam_width: int | None = Field(None, ge=1, le=16)  # > 1: beam search (no streaming, no sampling)
    length_penalty: float = Field(1.0, ge=-10, le=10)  # BeamSearchParams.MAX_LENGTH_PENALTY (its module needs torch)
    early_stopping: bool | Literal["never"] = False
    min_tokens: int = Field(0, ge=0)
    cache_salt: str | None = Field(None, max_length=256)
    priority: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=SamplingParams.MAX_STOP_TOKEN_IDS)
    prompt_logprobs: int | None = Field(
        None, ge=0, le=SamplingParams.MAX_LOGPROBS,
        description="vLLM's: per prompt token after the first, its log-probability, rank and the top N "
        "alternatives, in choices[].prompt_logprobs (completions) or prompt_logprobs (chat); not streamed",
    )  # fmt: skip

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def bounded_prompt_logprobs(cls, value: Any) -> Any:
        return check_logprobs(value)

    @field_validator("stop", mode="before")
    @classmethod
    def bounded_stop(cls, value: Any) -> Any:
        strings = value if isinstance(value, list) else [value]
        if len(strings) > SamplingParams.MAX_STOP:
            raise invalid(f"{len(strings)} strings, allowed: at most {SamplingParams.MAX_STOP}")
        longest = max((len(s) for s in strings if isinstance(s, str)), default=0)
        if longest > SamplingParams.MAX_STOP_CHARS:
            raise invalid(f"a string of {longest} characters, allowed: at most {SamplingParams.MAX_STOP_CHARS}")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def bounded_bias(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        if len(value) > SamplingParams.MAX_LOGIT_BIAS:
            raise invalid(f"{len(value)} entries, allowed: at most {SamplingParams.MAX_LOGIT_BIAS}")
        limit = SamplingParams.MAX_BIAS
        for key, bias in value.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()) and not is_token_id(key):
                raise invalid(f"key {str(key)[:40]!r} is not a token id; allowed: non-negative integers as keys")
            if not is_number(bias) or not -limit <= bias <= limit:
                raise invalid(f"{str(bias)[:40]} for token {key}, allowed: -{limit:g} to {limit:g}")
        return value

    @model_validator(mode="after")
    def best_of_is_n(self) -> SamplingFields:
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise NotImplementedFeature("best_of", self.best_of, "generating extra choices to keep the best",
                                        f"1 or n ({self.n})")  # fmt: skip
        return self

    @field_validator("response_format")
    @classmethod
    def known_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        kind = value.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise invalid(f'type {kind!r}; allowed: "text", "json_object", "json_schema"')
        if kind == "json_schema":
            spec = value.get("json_schema")
            if (
                not isinstance(spec, dict)
                or not isinstance(spec.get("name"), str)
                or not isinstance(spec.get("schema", {}), dict)
            ):
                raise invalid('json_schema: allowed: {"name": "...", "schema": {a JSON schema object}, "strict": true}')
        return value

    def grammar(self) -> GrammarSpec | None:
        """The constraint the request asks for (at most one), as a grammar; None for free text."""
        asked: list[GrammarSpec] = []
        fmt = self.response_format
        if fmt is not None and fmt["type"] == "json_object":
            asked.append(GrammarSpec("json_object", "", "response_format"))
        elif fmt is not None and fmt["type"] == "json_schema":
            asked.append(spec_from_schema(fmt["json_schema"].get("schema", {}), "response_format"))
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise RequestError(f"guided_json: not JSON: {exc}", param="guided_json") from None
            asked.append(spec_from_schema(schema, "guided_json"))
        if self.guided_regex is not None:
            asked.append(GrammarSpec("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            asked.append(GrammarSpec("choice", json.dumps(self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            asked.append(GrammarSpec("grammar", self.guided_grammar, "guided_grammar"))
        if len(asked) > 1:
            names = ", ".join(spec.param for spec in asked)
            raise RequestError(f"{asked[1].param}: one output constraint per request, got {names}", param=asked[1].param)
        return asked[0] if asked else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(
        None, ge=0, le=SamplingParams.MAX_LOGPROBS,
        description="per token, its log-probability and the N most likely tokens; with echo, the prompt's "
        "tokens come first (the first one's logprob null)",
    )  # fmt: skip
    echo: bool = False

    @field_validator("logprobs", mode="before")
    @classmethod
    def bounded_logprobs(cls, value: Any) -> Any:
        return check_logprobs(value)
    suffix: str | None = None  # fill-in-the-middle: not built, so anything but empty is a 501

    @model_validator(mode="after")
    def no_suffix(self) -> CompletionRequest:
        if self.suffix:
            raise NotImplementedFeature("suffix", self.suffix, "text after the completion (fill-in-the-middle)",
                                        'omitted, null or ""')  # fmt: skip
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def bounded_prompt(cls, value: Any) -> Any:
        return check_prompts(value, "prompts")


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallItem(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, max_length=MAX_TOOLS)  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            if len(value) > MAX_CONTENT_PARTS:
                raise invalid(f"{len(value)} parts, allowed: at most {MAX_CONTENT_PARTS}")
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid('parts must be {"type": "text", "text": "..."}; this model reads text only')
        return value


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # the legacy function-calling fields: a 501 pointing at tools, never silently plain text
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # OpenAI's features beyond text generation: a 501 when asked for, never silently a plain answer
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def bounded_top_logprobs(cls, value: Any) -> Any:
        return check_logprobs(value)

    @field_validator("tools")
    @classmethod
    def function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for index, tool in enumerate(value or []):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
                raise invalid(f'tool {index}: allowed: {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}')
            if not isinstance(function.get("name"), str) or not TOOL_NAME.fullmatch(function["name"]):
                raise invalid(f"tool {index}: function.name must be 1-64 letters, digits, _ or -")
            if not isinstance(function.get("parameters", {}), dict):
                raise invalid(f"tool {index}: function.parameters must be a JSON schema object")
        return value

    @field_validator("function_call")
    @classmethod
    def named_function_call(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value is None or value in ("none", "auto") or (isinstance(value, dict) and isinstance(value.get("name"), str)):
            return value
        raise invalid('allowed: "none", "auto" or {"name": "..."}; send tools and tool_choice instead')

    @model_validator(mode="after")
    def no_legacy_functions(self) -> ChatRequest:
        legacy = "the legacy function-calling API"
        if self.functions:
            raise NotImplementedFeature("functions", self.functions, legacy,
                                        "omitted or []; send tools (and tool_choice) instead")  # fmt: skip
        if isinstance(self.function_call, dict):
            raise NotImplementedFeature("function_call", self.function_call, legacy,
                                        '"none" or "auto"; send tools and tool_choice instead')  # fmt: skip
        return self

    @model_validator(mode="after")
    def text_only(self) -> ChatRequest:
        if self.audio is not None:
            raise NotImplementedFeature("audio", self.audio, "audio output", "omitted or null (text only)")
        if self.modalities is not None and self.modalities != ["text"]:
            raise NotImplementedFeature("modalities", self.modalities, "output other than text", '["text"] or omitted')
        if self.prediction is not None:
            raise NotImplementedFeature("prediction", self.prediction, "predicted outputs", "omitted or null")
        if self.web_search_options is not None:
            raise NotImplementedFeature("web_search_options", self.web_search_options, "web search", "omitted or null")
        if self.store:
            raise NotImplementedFeature("store", self.store, "stored chat completions (GET /v1/chat/completions)",
                                        "false or omitted; /v1/responses stores responses (store: true)")  # fmt: skip
        return self

    @field_validator("tool_choice")
    @classmethod
    def known_tool_choice(cls, value: str | dict[str, Any] | None, info: ValidationInfo) -> str | dict[str, Any] | None:
        names = [t["function"]["name"] for t in info.data.get("tools") or []]
        if value is None or value in ("none", "auto"):
            return value
        if value == "required":
            if not names:
                raise invalid('"required" makes the model call one of the tools; the request sends none')
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if not isinstance(function, dict) or value.get("type") != "function":
            raise invalid('allowed: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
        if function.get("name") not in names:
            raise invalid(f"names function {function.get('name')!r}; the request's tools are: {', '.join(names) or 'none'}")
        return value

    def tools_in_use(self) -> tuple[list[dict[str, Any]], str | None]:
        """The tools the model may call and how: ``("auto" | "required" | a function name)``; ``([], None)``
        when it calls none (no tools, or ``tool_choice: "none"``)."""
        if not self.tools or self.tool_choice == "none":
            return [], None
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            return [t for t in self.tools if t["function"]["name"] == name], name
        return self.tools, self.tool_choice or "auto"


class CachedFields(Body):
    """The knobs of the /v1/cached/* routes."""

    enable_caching: bool = True
    enable_speculation: bool | None = None  # None: as [speculative] method says
    enable_sliding_window: bool | None = None  # None: as [sliding_window] enabled says
    # this request's window in streaming mode (None: [sliding_window] window_size); the engine checks 64-1024
    window_size: int | None = None
    cache_key: str | None = Field(None, min_length=1, max_length=256)
    request_id: str | None = Field(None, min_length=1, max_length=128)
    # beam search without naming a width: [speculative] beam_width beams
    use_beam_search: bool = False


class CachedCompletionRequest(CompletionRequest, CachedFields):
    pass


class CachedChatRequest(ChatRequest, CachedFields):
    pass
