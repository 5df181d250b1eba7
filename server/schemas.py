"""Request bodies of the OpenAI-compatible routes (unknown fields are ignored, as OpenAI does)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    """Fields shared by completions and chat completions (plus tierserve extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # >= 0.01: dividing logits by a near-zero penalty overflows float32 and the draw returns no valid token
    repetition_penalty: float = Field(1.0, ge=0.01, le=10)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # tierserve extensions
    beam_width: int | None = Field(None, ge=1, le=16)  # > 1: beam search (no streaming, no sampling)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    min_tokens: int = Field(0, ge=0)
    cache_salt: str | None = Field(None, max_length=256)
    priority: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CachedFields(Body):
    """The knobs of the /v1/cached/* routes."""

    enable_caching: bool = True
    enable_speculation: bool | None = None  # None: as [speculative] method says
    enable_sliding_window: bool | None = None  # None: as [sliding_window] enabled says
    cache_key: str | None = Field(None, min_length=1, max_length=256)
    request_id: str | None = Field(None, min_length=1, max_length=128)
    # beam search without naming a width: [speculative] beam_width beams
    use_beam_search: bool = False


class CachedCompletionRequest(CompletionRequest, CachedFields):
    pass


class CachedChatRequest(ChatRequest, CachedFields):
    pass
