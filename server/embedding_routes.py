"""``POST /v1/embeddings`` (OpenAI-compatible): mean-pooled, L2-normalised final hidden states."""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

from litestar import Request, post
from litestar.params import JSONBody
from pydantic import field_validator

from tierserve.server.errors import APIError, NotImplementedFeature
from tierserve.server.generation_jobs import check_prompt_bytes
from tierserve.server.schemas import Body, check_prompts
from tierserve.server.state import state_of


class EmbeddingRequest(Body):
    """OpenAI's embeddings request; ``user`` and unknown fields are accepted and ignored."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def bounded_input(cls, value: Any) -> Any:
        return check_prompts(value, "inputs")


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One text, or one list of token ids, becomes a batch of one."""
    items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    if not items or any(len(item) == 0 for item in items):
        raise APIError(
            400,
            "input: must not be empty; send a string, a list of strings, a list of token ids, "
            "or a list of such lists, each with at least one character or token",
            param="input",
        )
    return items


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request, data: JSONBody[EmbeddingRequest]) -> dict[str, Any]:
    """Embed each input on its own; vectors come back in input order."""
    state = state_of(request)
    target = await state.target_loaded(data.model, admit=True)
    try:
        model = target.name
        inputs = _inputs(data.input)
        check_prompt_bytes(inputs, state.settings.server.max_prompt_bytes, "input")
        if target.lora_name is not None:
            raise NotImplementedFeature("model", data.model, f"embedding with a LoRA adapter ({target.lora_name!r})",
                                        f"a base model, such as {target.served.name!r}")  # fmt: skip
        vectors, prompt_tokens = await asyncio.to_thread(target.engine.embed, inputs)
    finally:
        target.release()
    hidden = vectors.shape[1]
    if data.dimensions is not None and data.dimensions != hidden:
        raise APIError(
            400,
            f"dimensions: this model's embeddings have {hidden} dimensions, not {data.dimensions}; "
            "omit dimensions or set it to the hidden size",
            param="dimensions",
        )
    if data.encoding_format == "base64":
        # OpenAI's encoding: the raw little-endian float32 bytes of the vector.
        encoded: list[Any] = [
            base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii") for row in vectors
        ]
    else:
        encoded = vectors.tolist()
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


ROUTES = [embeddings]
