"""Hypothesis on the request models: any JSON in any field is accepted, a validation error (a 400) or a feature not
built (a 501), and what is accepted stays inside the documented limits, so the engine never meets a value it would
refuse mid-step."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from tierserve.core.errors import RequestError
from tierserve.core.sampling_params import SamplingParams
from tierserve.server.embedding_routes import EmbeddingRequest
from tierserve.server.errors import NotImplementedFeature
from tierserve.server.schemas import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_SEED,
    MAX_TOKEN_IDS,
    CachedChatRequest,
    CachedCompletionRequest,
    ChatRequest,
    CompletionRequest,
)

pytestmark = pytest.mark.unit

EDGE_INTS = [0, 1, -1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30, -(10**30)]
EDGE_FLOATS = [0.0, -0.0, 1e-308, 1e308, -1e308, 100.0, 100.5, -100.5, 10.0, 10.5, 2.0, 1e-45]
BASES: dict[type[BaseModel], dict[str, Any]] = {
    CompletionRequest: {"prompt": "Hi"},
    CachedCompletionRequest: {"prompt": "Hi"},
    ChatRequest: {"messages": [{"role": "user", "content": "Hi"}]},
    CachedChatRequest: {"messages": [{"role": "user", "content": "Hi"}]},
    EmbeddingRequest: {"input": "Hi"},
}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(EDGE_INTS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(EDGE_FLOATS),
    st.text(max_size=8),
)
# JSON as a parser hands it over: scalars, lists and string-keyed objects, nested a few levels
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=12,
)


def near(limit: int, item: st.SearchStrategy) -> st.SearchStrategy:
    """A list of one repeated item, a few entries either side of ``limit``."""
    return st.builds(lambda n, x: [x] * n, st.integers(max(0, limit - 2), limit + 2), item)


token_ids = st.one_of(st.integers(-2, 5000), st.booleans())
long_lists = st.one_of(
    st.fixed_dictionaries({"stop_token_ids": near(SamplingParams.MAX_STOP_TOKEN_IDS, token_ids)}),
    st.fixed_dictionaries({"stop": near(SamplingParams.MAX_STOP, st.text(min_size=1, max_size=3))}),
    st.fixed_dictionaries({"stop": st.builds(lambda n: "x" * n, st.integers(250, 260))}),
    st.fixed_dictionaries(
        {"logit_bias": st.builds(lambda n, v: {str(i): v for i in range(n)}, st.integers(1020, 1030), scalars)}
    ),
    st.fixed_dictionaries({"logit_bias": st.dictionaries(st.text(max_size=6), scalars, max_size=3)}),
    st.fixed_dictionaries(
        {"prompt": near(MAX_PROMPTS, st.one_of(st.text(min_size=1, max_size=2), st.lists(token_ids, max_size=2)))}
    ),
    st.fixed_dictionaries({"messages": near(MAX_MESSAGES, st.just({"role": "user", "content": "a"}))}),
    st.fixed_dictionaries(
        {"messages": st.builds(lambda parts: [{"role": "user", "content": parts}],
                               near(MAX_CONTENT_PARTS, st.just({"type": "text", "text": "a"})))}
    ),
)
SAMPLING_FIELDS = [
    "seed", "n", "best_of", "min_tokens", "max_tokens", "length_penalty", "beam_width", "temperature", "top_p",
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop",
    "stop_token_ids", "response_format", "tools", "tool_choice", "functions", "priority", "logprobs",
]
sampling_bodies = st.dictionaries(st.sampled_from(SAMPLING_FIELDS), json_values, max_size=6)
SETTINGS = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def validate(model: type[BaseModel], body: dict[str, Any]) -> BaseModel | None:
    """The model, or None for a validation error (the route's 400) or a feature not built (its 501); anything
    else raised fails the test."""
    try:
        return model.model_validate(body)
    except (ValidationError, NotImplementedFeature):
        return None


@pytest.mark.parametrize("model", list(BASES), ids=lambda m: m.__name__)
@SETTINGS
@given(field=st.sampled_from(["prompt", "messages", "input", "content", *SAMPLING_FIELDS, "stream_options"]),
       value=json_values)
def test_any_json_in_any_field_is_accepted_or_a_validation_error(model, field, value):
    body = dict(BASES[model])
    if field == "content" and "messages" in body:
        body["messages"] = [{"role": "user", "content": value}]
    else:
        body[field] = value
    validate(model, body)


@SETTINGS
@given(extra=st.one_of(long_lists, sampling_bodies), chat=st.booleans())
def test_what_is_accepted_stays_inside_the_limits_and_the_engine_takes_it(extra, chat):
    model = CachedChatRequest if chat else CachedCompletionRequest
    base = BASES[ChatRequest] if chat else BASES[CompletionRequest]
    body = validate(model, {**base, **extra})
    if body is None:
        return
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list):
        assert len(prompt) <= MAX_TOKEN_IDS
        flat = [x for item in prompt for x in (item if isinstance(item, list) else [item])]
        assert not any(isinstance(x, bool) for x in flat)
        assert all(isinstance(x, int) for x in flat) or len(prompt) <= MAX_PROMPTS
    for message in getattr(body, "messages", None) or []:
        assert isinstance(message.content, (str, type(None))) or len(message.content) <= MAX_CONTENT_PARTS
    assert len(getattr(body, "messages", None) or []) <= MAX_MESSAGES
    assert body.seed is None or -(2**63) <= body.seed <= MAX_SEED
    assert -10 <= body.length_penalty <= 10
    assert body.best_of in (None, 1, body.n)
    assert body.response_format in (None,) or body.response_format.get("type") in ("text", "json_object", "json_schema")
    assert not getattr(body, "tools", None) and not getattr(body, "functions", None)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    max_tokens = body.max_tokens or 16
    try:
        SamplingParams(
            max_tokens=max_tokens,
            seed=None if body.seed is None else (body.seed + body.n - 1) % 2**64,
            stop=stop,
            stop_token_ids=body.stop_token_ids or (),
            min_tokens=body.min_tokens,
            logit_bias=body.logit_bias or {},
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            temperature=body.temperature if body.temperature is not None else 1.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            top_k=body.top_k if body.top_k is not None else 0,
            min_p=body.min_p or 0.0,
        )
    except RequestError as exc:
        # what only the engine can judge: min_tokens against max_tokens, and empty stop strings
        assert exc.param in ("min_tokens", "stop"), exc
        assert body.min_tokens > max_tokens or "" in stop, exc
