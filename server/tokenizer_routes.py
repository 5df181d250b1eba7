"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Clients that count or score tokens themselves use them instead of loading the model's tokenizer:
lm-evaluation-harness's ``local-completions`` model (``tokenizer_backend=remote``) reads
``/tokenizer_info`` and tokenizes each context and continuation through ``/tokenize``, which is how it
evaluates a GGUF file served here without a Hugging Face tokenizer folder of its own. The ids are
exactly those the completion routes compute from the same text.
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, get, post
from litestar.params import FromQuery, JSONBody
from pydantic import Field, field_validator, model_validator

from tierserve.engine.requests import RequestError
from tierserve.server.errors import APIError
from tierserve.server.schemas import MAX_MESSAGES, Body, ChatMessage, TokenId
from tierserve.server.state import state_of

MAX_TOKENIZE_BYTES = 4 * 1024 * 1024  # a prompt past the server's prompt bound is refused by the body limit first


class TokenizeRequest(Body):
    """vLLM's ``/tokenize`` body: a ``prompt``, or chat ``messages`` rendered by the model's chat template."""

    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_TOKENIZE_BYTES)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True  # the tokenizer's BOS and the like, as the completion routes add them
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opening, as chat requests do
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (a string) and messages (a chat)")
        return self


class DetokenizeRequest(Body):
    """vLLM's ``/detokenize`` body."""

    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)

    @field_validator("tokens", mode="before")
    @classmethod
    def _integers(cls, value: Any) -> Any:
        if isinstance(value, list) and any(isinstance(token, bool) for token in value):
            raise ValueError("token ids are integers, not true or false")
        return value


@post("/tokenize", status_code=200)
async def tokenize(request: Request, data: JSONBody[TokenizeRequest]) -> dict[str, Any]:
    """The token ids of a prompt or a chat, as the completion and chat routes compute them (``count``, ``tokens``,
    ``max_model_len``, and ``token_strs`` with ``return_token_strs``)."""
    engine = await _engine(request, data.model)
    try:
        if data.messages is not None:
            if not data.add_generation_prompt:
                raise APIError(400, "add_generation_prompt: only true is built for messages (the chat routes' "
                               "rendering); allowed: true", param="add_generation_prompt")  # fmt: skip
            messages = [m.model_dump(exclude_none=True) for m in data.messages]
            ids = await asyncio.to_thread(engine.encode_prompt, None, messages)
        else:
            ids = await asyncio.to_thread(engine.tokenize, data.prompt, data.add_special_tokens)
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except ValueError as exc:  # the chat template refused the conversation
        raise APIError(400, f"messages: the model's chat template refused them: {exc}", param="messages") from None
    strs = await asyncio.to_thread(lambda: [engine.token_text(token) for token in ids]) if data.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}


@post("/detokenize", status_code=200)
async def detokenize(request: Request, data: JSONBody[DetokenizeRequest]) -> dict[str, Any]:
    """The text of token ids (special tokens included, as they are)."""
    engine = await _engine(request, data.model)
    vocab = engine.info.vocab_size
    outside = [token for token in data.tokens if not 0 <= token < vocab]
    if outside:
        raise APIError(400, f"tokens: {outside[0]} is not a token id of this model; allowed: 0 to {vocab - 1}",
                       param="tokens")  # fmt: skip
    return {"prompt": await asyncio.to_thread(engine.decode, data.tokens)}


@get("/tokenizer_info")
async def tokenizer_info(request: Request, model: FromQuery[str | None] = None) -> dict[str, Any]:
    """The tokenizer's special tokens, chat template and limits (the keys vLLM's ``/tokenizer_info`` has that a
    client needs: ``eos_token``, ``bos_token``, ``pad_token``, ``unk_token``, ``chat_template``,
    ``model_max_length``, ``tokenizer_class``, ``vocab_size``)."""
    engine = await _engine(request, model)
    return engine.tokenizer_info()


async def _engine(request: Request, model: str | None):
    target = await state_of(request).target_loaded(model)
    return target.engine


ROUTES = [tokenize, detokenize, tokenizer_info]
