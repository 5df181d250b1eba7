"""Response shapes of the OpenAI-compatible routes: usage, logprobs, the cached routes' report, SSE, metrics."""

from __future__ import annotations

import json
import time
from typing import Any

from tierserve.engine import EngineClient, TokenLogprob
from tierserve.server.generation_jobs import Choice, Job
from tierserve.server.recent import latency_window
from tierserve.server.state import ServerState
from tierserve.server.tenant_usage import UsageTable
from tierserve.server.tool_streaming import finish_with_calls


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


def completion_logprobs(engine: EngineClient, items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for item in items:
        text = engine.token_text(item.token_id)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_logprobs.append(item.logprob)
        top.append({engine.token_text(t): lp for t, lp in item.top_logprobs})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echoed_prompt_logprobs(
    engine: EngineClient, ids: list[int], scored: list[TokenLogprob] | None, pieces: list[str], top_n: int
) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` of an echoed prompt: each token with the logprob the model gives it after
    the ones before and the ``top_n`` most likely there; the first token has none (``null``, as OpenAI's).
    ``text_offset`` indexes the echoed text, the join of ``pieces`` (``EngineClient.text_pieces``)."""
    scored = scored or []
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for index, (token_id, piece) in enumerate(zip(ids, pieces)):
        item = scored[index - 1] if 0 < index <= len(scored) else None
        tokens.append(engine.token_text(token_id))
        token_logprobs.append(item.logprob if item is not None else None)
        top.append({engine.token_text(t): lp for t, lp in item.top_logprobs[:top_n]} if item is not None else None)
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def choice_logprobs(engine: EngineClient, job: Job, choice: Choice) -> dict[str, Any]:
    """A completion choice's ``logprobs``: with ``echo``, the prompt's tokens, then the generated ones'."""
    if choice.prompt_pieces is None:
        return completion_logprobs(engine, choice.logprobs)
    ids = job.prompts[choice.prompt_index]
    head = echoed_prompt_logprobs(engine, ids, choice.prompt_logprobs, choice.prompt_pieces, job.body.logprobs)
    tail = completion_logprobs(engine, choice.logprobs, len(choice.text[0]))
    return {key: head[key] + tail[key] for key in head}


def vllm_prompt_logprobs(engine: EngineClient, scored: list[TokenLogprob] | None, top_n: int) -> list[Any]:
    """vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then per token ``{token id: {"logprob",
    "rank", "decoded_token"}}`` for the prompt's own token (its rank in the distribution) and the ``top_n``
    most likely (ranks 1..``top_n``)."""

    def entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": engine.token_text(token_id)}

    out: list[Any] = [None]
    for item in scored or []:
        position = {str(item.token_id): entry(item.token_id, item.logprob, item.rank)}
        for rank, (token_id, logprob) in enumerate(item.top_logprobs[:top_n], 1):
            position.setdefault(str(token_id), entry(token_id, logprob, rank))
        out.append(position)
    return out


def chat_logprobs(engine: EngineClient, items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = engine.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(i.token_id, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top_logprobs]}
            for i in items
        ]
    }


def cache_report(job: Job, choices: list[Choice]) -> dict[str, Any]:
    """The measured ``cache_stats`` and ``performance`` of a /v1/cached/* response (the store's own accounting)."""
    firsts = [c for c in choices if c.index % job.n == 0 and c.cache is not None]
    hits = sum(c.cache.hit_blocks for c in firsts)
    misses = sum(c.cache.lookup_blocks for c in firsts) - hits
    timings = [c.timings for c in choices if c.timings is not None]
    total = time.perf_counter() - job.started
    completion = sum(len(c.token_ids) for c in choices)
    methods = sorted({c.speculation_method for c in choices if c.speculation_method})
    tier_hits: dict[str, int] = {}
    for choice in firsts:
        for tier, count in choice.cache.hits.items():
            tier_hits[tier] = tier_hits.get(tier, 0) + count
    return {
        "cache_stats": {
            "cache_used": hits > 0,
            "hit_rate": round(100 * hits / (hits + misses), 2) if hits + misses else 0.0,  # percent, as the spec
            "cache_hits": hits,
            "cache_misses": max(misses, 0),
            "speculation_hits": sum(c.timings.accepted_drafts for c in choices if c.timings is not None),
            "prefix_matches": sum(1 for c in firsts if c.cached_tokens > 0),
            # attention states (KV blocks) a windowed request took from the cache instead of computing them
            "window_reuse": sum(c.cache.hit_blocks for c in firsts if c.cache.windowed),
            "windows_slid": sum(c.timings.windows_slid for c in choices if c.timings is not None),
            "speculation_method": methods[0] if methods else None,  # which speculator drafted, if any
            "tier_hits": tier_hits,  # blocks served per tier ("l1" = the live pool)
        },
        "performance": {
            "total_time_ms": round(total * 1000, 3),
            "cache_time_ms": round(sum(t.cache_lookup for t in timings) * 1000, 3),
            "inference_time_ms": round(max((t.inference for t in timings), default=0.0) * 1000, 3),
            "tokens_per_second": round(completion / total, 3) if total > 0 else 0.0,
            "memory_usage_bytes": sum(t.peak_kv_bytes for t in timings),
        },
    }


def full_response(engine: EngineClient, state: ServerState, job: Job, choices: list[Choice]) -> dict[str, Any]:
    created = int(time.time())
    if job.chat:
        body_choices = []
        for c in choices:
            message: dict[str, Any] = {"role": "assistant", "content": "".join(c.text)}
            finish_reason = c.finish_reason
            if job.tool_parser is not None:
                content, calls, finish_reason = finish_with_calls(job.tool_parser, message["content"], finish_reason)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": [call.as_openai() for call in calls]}
            body_choices.append({
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(engine, c.logprobs) if job.params[c.index].logprobs is not None else None,
                "finish_reason": finish_reason,
            })  # fmt: skip
        kind = "chat.completion"
    else:
        body_choices = [
            {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": choice_logprobs(engine, job, c) if job.params[c.index].logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        if job.body.prompt_logprobs is not None:  # vLLM's, per choice
            for entry, c in zip(body_choices, choices):
                entry["prompt_logprobs"] = vllm_prompt_logprobs(engine, c.prompt_logprobs, job.body.prompt_logprobs)
        kind = "text_completion"
    response = {
        "id": job.id,
        "object": kind,
        "created": created,
        "model": job.model,
        "choices": body_choices,
        "usage": usage_of(job, choices),
    }
    if job.chat and job.body.prompt_logprobs is not None:  # vLLM's, once for the conversation
        response["prompt_logprobs"] = vllm_prompt_logprobs(engine, choices[0].prompt_logprobs, job.body.prompt_logprobs)
    if job.cached:
        response.update(cached_extras(job, choices))
    return response


def cached_extras(job: Job, choices: list[Choice]) -> dict[str, Any]:
    """What /v1/cached/* responses add: the spec's top-level ``text`` and ``finish_reason`` (first
    choice), its ``request_id``, and the measured ``cache_stats`` and ``performance``."""
    first = choices[0] if choices else None
    return {
        "text": "".join(first.text) if first is not None else "",
        "finish_reason": first.finish_reason if first is not None else None,
        "request_id": job.id,
        **cache_report(job, choices),
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage_table(state: ServerState) -> UsageTable:
    """Per-tenant usage (``/v1/cache/stats`` for a non-admin key)."""
    table = state.extras.get("tenant_usage")
    if table is None:
        table = state.extras["tenant_usage"] = UsageTable()
    return table  # type: ignore[return-value]


def observe(state: ServerState, job: Job, choices: list[Choice], first_token_at: float | None) -> None:
    usage = usage_of(job, choices)
    firsts = [c.cache for c in choices if c.index % job.n == 0 and c.cache is not None]
    hits = sum(info.hit_blocks for info in firsts)
    usage_table(state).add(
        job.tenant,
        prompt=usage["prompt_tokens"],
        cached=usage["prompt_tokens_details"]["cached_tokens"],
        completion=usage["completion_tokens"],
        hits=hits,
        misses=sum(info.lookup_blocks for info in firsts) - hits,
    )
    now = time.perf_counter()
    ttft = tpot = None
    if first_token_at is not None:
        ttft = first_token_at - job.started
        generated = usage["completion_tokens"]
        if generated > len(choices):
            tpot = (now - first_token_at) / (generated - len(choices))
    latency_window(state).observe(ttft, tpot)
    metrics = state.extras.get("metrics")
    if metrics is None:
        return
    metrics.count_tokens(usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
    metrics.observe_e2e(now - job.started)
    if ttft is not None:
        metrics.observe_ttft(ttft)
    if tpot is not None:
        metrics.observe_tpot(tpot)
    aborted = any(c.finish_reason == "abort" for c in choices)
    metrics.count_outcome("abort" if aborted else "success")
