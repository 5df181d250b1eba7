"""What comes out of the engine: the core's per-step records, and the deltas a client streams.

    EngineCore.step() ─► CoreOutput (token ids, finish, per-request counters)
                                │   (same process, or pickled across the process boundary)
                                ▼
    EngineClient's output processor ─► RequestOutput (text delta, usage, timings) ─► a request's stream

The core never decodes text; the client never touches KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierserve.cache.lookup_info import RequestCacheInfo

__all__ = ["CompletedRequest", "CoreOutput", "RequestCacheInfo", "RequestOutput", "RequestTimings", "TokenLogprob"]


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability and the top alternatives (``(token id, logprob)``, best first).

    ``rank``: the token's 1-based place in the distribution (1 + how many others are at least as likely,
    vLLM's rank), set for prompt tokens (``SamplingParams.prompt_logprobs``), ``None`` for generated ones.
    """

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    rank: int | None = None


@dataclass(slots=True)
class CoreOutput:
    """What one core step did for one request.

    ``new_token_ids`` are appended to the sequence (several with accepted
    speculative drafts); ``finish_reason`` (``"stop"``, ``"length"``,
    ``"abort"``) applies after the last of them. A ``"stop"`` whose last token
    is an eos or stop token id means that token's text is not part of the
    output. The counters are the request's running totals, so a client that
    ends a request early (a stop string) still has them.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cache: RequestCacheInfo | None = None  # set when a prefix lookup ran since the last output
    first_scheduled_time: float | None = None
    accepted_drafts: int = 0
    windows_slid: int = 0
    peak_blocks: int = 0
    error: str | None = None  # with "abort": the engine failed the request (a plugin raised), and why
    error_param: str | None = None  # the request field at fault, when the request itself could not be followed
    # with a request's first output (its prompt is in): prompt tokens 1.. (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestTimings:
    """Measured per request (seconds, monotonic clock) for the server's performance report."""

    queued: float  # arrival -> first scheduled
    cache_lookup: float  # time spent finding and loading cached prefix blocks
    inference: float  # first scheduled -> finished
    time_to_first_token: float | None
    peak_kv_bytes: int
    accepted_drafts: int = 0  # speculative draft tokens this request accepted
    windows_slid: int = 0  # times a sliding window released this request's old KV


@dataclass(slots=True)
class RequestOutput:
    """What one step added to a request (a streaming delta), plus running totals.

    ``timings`` and ``cache`` are set on the final output only;
    ``speculation_method`` names the speculator that drafted for it (None: none).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    timings: RequestTimings | None = None
    cache: RequestCacheInfo | None = None
    speculation_method: str | None = None
    error: str | None = None  # the engine failed the request (``CoreOutput.error``): the client raises EngineFault
    error_param: str | None = None  # ...or, with the field at fault, RequestError (a 400)
    failure: Exception | None = None  # raised as it is by the client (the engine core process died under it: a 503)
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first delta: ``CoreOutput.prompt_logprobs``


@dataclass(slots=True)
class CompletedRequest:
    """The whole result of ``generate``: deltas folded together."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (SamplingParams.prompt_logprobs)
