"""A request on its way into the engine core, the rules it must pass first, and their errors.

The context-length rule lives here and nowhere else: the server, the client,
beam search and embeddings all ask ``output_room`` and ``check_fits``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tierserve.cache.kv_manager import StreamingWindow
from tierserve.core.errors import RequestError
from tierserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tierserve.settings.config import SlidingWindowSettings
    from tierserve.engine.messages import ModelInfo

__all__ = [
    "EngineRequest",
    "RequestError",
    "batch_by_tokens",
    "check_fits",
    "check_request",
    "output_room",
    "read_warm_prompts",
    "window_mode",
]

WINDOW_SIZE_RANGE = (64, 1024)  # a request's own window_size, in tokens (the serving spec's range)


@dataclass(slots=True)
class EngineRequest:
    """A tokenised request as the engine core receives it (through the client's queue)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    use_prefix_cache: bool = True
    spec_method: str | None = None  # the speculator drafting for it; None: plain decoding
    streaming: bool = False  # sliding-window streaming mode
    window_size: int | None = None  # its own window in streaming mode (None: [sliding_window] window_size)
    cache_key: str | None = None  # names the prompt's cached prefix: pinned once the request ends normally
    cache_namespace: str = ""  # the tenant the key belongs to (a key is (namespace, name))
    warm: str | None = None  # the prompt warm it is part of: its writes wait for room (EngineCore.finish_warm)
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    arrival_time: float = field(default_factory=time.monotonic)


def output_room(num_prompt_tokens: int, max_model_len: int, *, param: str = "prompt") -> int:
    """Tokens the context leaves for the output after a prompt (at least one, else ``RequestError``)."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise RequestError(
            f"{param}: {num_prompt_tokens} tokens; the model's context length is {max_model_len} tokens "
            "and at least one must be left for the output",
            param=param,
            code="context_length_exceeded",
        )
    return room


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, kv_capacity_tokens: int | None) -> None:
    """Raise ``RequestError`` (param ``max_tokens``) unless prompt + output fit the context and the KV cache."""
    total = num_prompt_tokens + max_tokens
    where = f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens})"
    if total > max_model_len:
        raise RequestError(
            f"max_tokens: {where} exceeds the model's context length ({max_model_len})",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if kv_capacity_tokens is not None and total > kv_capacity_tokens:
        raise RequestError(
            f"max_tokens: {where} exceeds the KV cache capacity ({kv_capacity_tokens} tokens)", param="max_tokens"
        )


def window_mode(window: SlidingWindowSettings, requested: bool | None, window_size: int | None = None) -> bool:
    """Whether a request runs in streaming (sliding-window) mode: as it asks (``enable_sliding_window``),
    else as ``[sliding_window] enabled`` says.

    Streaming lets generation run past the context, so turning it on is the
    operator's call: ``RequestError`` for a request asking for it unless
    ``enabled`` or ``allow_per_request`` (the default) is set. Asking for it off is always allowed.
    A request's own ``window_size`` must lie in ``WINDOW_SIZE_RANGE`` (the serving spec's 64-1024 tokens)
    and needs streaming mode.
    """
    streaming = window.enabled if requested is None else requested
    if requested and not (window.enabled or window.allow_per_request):
        raise RequestError(
            "enable_sliding_window: this server does not let requests turn streaming mode on "
            "([sliding_window] enabled and allow_per_request are both false); allowed: false or omitted",
            param="enable_sliding_window",
        )
    if window_size is not None:
        low, high = WINDOW_SIZE_RANGE
        if not low <= window_size <= high:
            raise RequestError(f"window_size: {window_size} tokens; allowed: {low} to {high}", param="window_size")
        if not streaming:
            raise RequestError(
                "window_size: sizes a sliding window, and this request runs without one; "
                "send enable_sliding_window: true with it, or leave window_size out",
                param="window_size",
            )
    return streaming


def check_request(
    info: ModelInfo,
    window: SlidingWindowSettings,
    prompt_token_ids: list[int],
    params: SamplingParams,
    speculate: bool | None,
    streaming: bool,
    window_size: int | None = None,
) -> str | None:
    """Raise ``RequestError`` unless the model can serve this request; returns the speculator it uses.

    ``speculate``: ``None`` follows the settings (the configured speculator,
    if any); ``True`` uses the configured one, else the fallback (prompt
    lookup, which needs no extra model); requests with penalties or logprobs
    (of the output or the prompt) decode without drafts.
    """
    num_prompt = len(prompt_token_ids)
    if not num_prompt:
        raise RequestError("prompt: must contain at least one token", param="prompt")
    if streaming and not info.supports_streaming_window:
        raise RequestError(
            "enable_sliding_window: needs the native backend (paged KV); allowed: false", param="enable_sliding_window"
        )
    if streaming:
        own = StreamingWindow.of(window).sized(window_size)
        needed = own.sink_tokens + own.window_size + own.window_overlap + 2 * info.block_size
        if window_size is not None and num_prompt <= info.max_model_len and needed + num_prompt > info.kv_capacity_tokens:
            # a smaller window would fit beside this prompt: the request's own size is at fault, so say which fits
            room = info.kv_capacity_tokens - own.sink_tokens - 2 * info.block_size - num_prompt
            largest = room - window.window_overlap
            if largest // 2 < window.window_overlap:  # the overlap is then half the window: w + w // 2 tokens
                largest = room * 2 // 3
            low, high = WINDOW_SIZE_RANGE
            if largest >= low:
                raise RequestError(
                    f"window_size: {window_size} tokens (with sinks and overlap) and the prompt's {num_prompt} do "
                    f"not fit this server's KV cache ({info.kv_capacity_tokens} tokens); allowed: {low} to "
                    f"{min(high, largest)} here",
                    param="window_size",
                )
        if num_prompt > info.max_model_len or needed + num_prompt > info.kv_capacity_tokens:
            raise RequestError(
                f"prompt: {num_prompt} tokens; with sliding_window the prompt must fit the context "
                f"({info.max_model_len}) and the KV cache with room for the window",
                param="prompt",
            )
    else:
        check_fits(num_prompt, params.max_tokens, info.max_model_len, info.kv_capacity_tokens)
    outside = [token for token in params.logit_bias if token >= info.vocab_size]
    if outside:
        raise RequestError(
            f"logit_bias: token id {outside[0]} is outside the vocabulary; allowed: 0 to {info.vocab_size - 1}",
            param="logit_bias",
        )
    method = info.speculator if speculate is None else (info.speculator or info.fallback_speculator) if speculate else None
    if speculate and method is None:
        raise RequestError(
            f"enable_speculation: speculative decoding needs a paged KV arena, which the {info.backend!r} backend "
            "does not keep; allowed: false",
            param="enable_speculation",
        )
    if params.has_penalties or params.logprobs is not None or params.prompt_logprobs is not None:
        return None
    return method


def batch_by_tokens(items: list[list[int]], budget: int) -> list[list[list[int]]]:
    """Split token id lists into consecutive batches of at most ``budget`` tokens (a longer item goes alone)."""
    batches: list[list[list[int]]] = []
    room = 0
    for ids in items:
        if len(ids) > room:
            batches.append([])
            room = budget
        batches[-1].append(ids)
        room -= len(ids)
    return batches


def read_warm_prompts(path: str) -> list[str]:
    """Prompts to warm at start-up: a JSON list of strings, or one prompt per non-empty line."""
    text = Path(path).expanduser().read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        prompts = json.loads(text)
        if not all(isinstance(p, str) for p in prompts):
            raise RequestError(
                f"kv_cache.warm_prompts_file: {path} must hold a JSON list of strings", param="warm_prompts_file"
            )
        return prompts
    return [line for line in text.splitlines() if line.strip()]
