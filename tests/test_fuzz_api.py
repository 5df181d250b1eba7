"""Schemathesis against the server's own OpenAPI schema: no input makes a /v1 route fail or leak internals."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, Phase, given, settings

pytestmark = pytest.mark.integration

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

from tests.engine_helpers import build_checkpoint, make_engine  # noqa: E402
from tests.server_helpers import running_server  # noqa: E402
import httpx  # noqa: E402
from tierserve.settings.config import load_settings  # noqa: E402

V1_OPERATIONS = [
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/cached/completions",
    "POST /v1/cached/chat/completions",
    "POST /v1/embeddings",
    "GET /v1/cache/stats",
    "POST /v1/cache/clear",
    "POST /v1/cache/offload",
    "POST /v1/cache/flush",
    "POST /v1/cache/warm",
    "GET /v1/cache/prefixes",
    "GET /v1/cache/keys",
    "DELETE /v1/cache/keys/{key}",
    "GET /v1/plugins",
    "POST /v1/models",
    "DELETE /v1/models/{model_id}",
    "POST /v1/models/aliases",
    "POST /v1/load_lora_adapter",
    "POST /v1/unload_lora_adapter",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
]
NO_INPUT = {"POST /v1/cache/offload", "POST /v1/cache/flush"}  # nothing a negative case could break
# a valid body loads a model (the builtin one when it names no path): test_model_registry.py covers it
NOT_FUZZED = {"POST /v1/models"}
EXAMPLES_PER_MODE = 25
MAX_TOKENS = 4  # the tiny model answers at once; the schema sets no upper bound on these fields
BOUNDED_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens")
TRACEBACK_MARKS = ("Traceback", 'File "')
PATH_MARKS = ("/work/", "/tmp/")  # /v1/models names model.path by design; errors must not show paths
CASES_TRIED: dict[str, dict[int, int]] = {}  # "label [mode]" -> {status: cases}


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[tuple[str, object]]:
    path = build_checkpoint(tmp_path_factory.mktemp("fuzz"), "llama", "llama")
    engine = make_engine(path, kv_cache__l1_capacity=512)
    overrides = {
        ("model", "path"): str(path),
        ("kv_cache", "l1_capacity"): 512,
        ("server", "served_model_name"): "fuzz-llama",
    }
    loaded = load_settings(None, environ={}, overrides=overrides)
    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
        yield base, schemathesis.openapi.from_url(f"{base}/docs/openapi.json")
    engine.close()
    print("\ncases tried per operation:", json.dumps(CASES_TRIED, indent=2))


def bound_lengths(case) -> None:
    """Clamp generation lengths (valid ones stay valid; too-small or mistyped ones are left to fail)."""
    if isinstance(case.body, dict):
        for key in BOUNDED_FIELDS:
            if isinstance(case.body.get(key), int) and not isinstance(case.body[key], bool) and case.body[key] > MAX_TOKENS:
                case.body[key] = MAX_TOKENS


def check_response(label: str, case, response) -> None:
    text = response.content.decode("utf-8", "replace")
    where = f"{label} {response.status_code} for body={case.body!r} query={case.query!r} path={case.path_parameters!r}"
    # 501: a valid request for something tierserve does not build, refused like a 4xx
    assert response.status_code < 500 or response.status_code == 501, f"{where}: {text[:500]}"
    for mark in TRACEBACK_MARKS:
        assert mark not in text, f"{where}: body leaks {mark!r}: {text[:500]}"
    if response.status_code < 300:
        # "abort" ends a request only when the engine failed a step (or the client left): a bad input
        # must be refused up front, not crash the step that every running request shares
        assert '"finish_reason":"abort"' not in text.replace(" ", ""), f"{where}: {text[:500]}"
    if 400 <= response.status_code < 500 or response.status_code == 501:
        for mark in PATH_MARKS:
            assert mark not in text, f"{where}: error leaks a path: {text[:500]}"
        body = json.loads(text)
        assert set(body) == {"error"}, f"{where}: {text[:500]}"
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{where}: {text[:500]}"
        assert isinstance(error["message"], str) and error["message"], where
        assert isinstance(error["type"], str) and error["type"], where
        assert error["param"] is None or isinstance(error["param"], str), where
        assert error["code"] is None or isinstance(error["code"], str), where


def test_schema_lists_every_v1_operation(api) -> None:
    _, schema = api
    labels = sorted(op.ok().label for op in schema.get_all_operations() if op.ok().path.startswith("/v1"))
    assert labels == sorted(V1_OPERATIONS)


# Negative cases need something to break: the GET routes take no body and only a free-form string.
FUZZED = [label for label in V1_OPERATIONS if label not in NOT_FUZZED]
RUNS = [(label, GenerationMode.POSITIVE) for label in FUZZED] + [
    (label, GenerationMode.NEGATIVE) for label in FUZZED if label.startswith("POST") and label not in NO_INPUT
]


@pytest.mark.parametrize(("label", "mode"), RUNS, ids=[f"{label}-{mode.value}" for label, mode in RUNS])
def test_operation_never_fails_or_leaks(api, label: str, mode: GenerationMode) -> None:
    base, schema = api
    operation = schema.find_operation_by_label(label)
    assert operation is not None, label
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=EXAMPLES_PER_MODE,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # a failure prints its case; shrinking would re-run the server
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        bound_lengths(case)
        response = case.call(base_url=base, timeout=30)
        statuses[response.status_code] += 1
        check_response(label, case, response)

    run()
    CASES_TRIED[f"{label} [{mode.value}]"] = dict(sorted(statuses.items()))
    print(f"{label} [{mode.value}]: {statuses.total()} cases, by status {dict(sorted(statuses.items()))}")
    assert statuses.total() > 0


# Values a hostile user sent that once made a 500 (or were silently ignored): each must be a 4xx (or the 501 of
# something not built) in OpenAI's shape.
DEEP = "[" * 100_000 + "]" * 100_000
CHAT = [{"role": "user", "content": "Hi"}]
GENERATION_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/cached/completions", "/v1/cached/chat/completions"]
EDGE_BODIES: list[Any] = [
    {"seed": 2**64},
    {"seed": -(2**63) - 1},
    {"seed": 10**30},
    {"beam_width": 2, "length_penalty": 1e308},
    {"beam_width": 2, "length_penalty": -1e308},
    {"use_beam_search": True, "length_penalty": 1e308},
    {"stop_token_ids": [0] * 1025},
    {"stop": ["a"] * 17},
    {"logit_bias": {str(i): 1 for i in range(1025)}},
    {"logit_bias": {"1000000": 1}},
    {"logit_bias": {"1": 1e308}},
    {"min_tokens": 10**6},
    {"max_tokens": 10**6},
    {"best_of": 5},
    {"response_format": {"type": "json_schema", "json_schema": {"a": [[[[1]]]]}}},
    {"tools": [{"type": "function", "function": {"name": "f g"}}]},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    b'{"prompt": DEEP, "messages": [{"role": "user", "content": DEEP}], "max_tokens": 2}',
    b'{"prompt": [true, false], "messages": [{"role": "user", "content": [{"type": "text", "text": true}]}]}',
]


class Sent(NamedTuple):
    """What check_response reports about a request sent by hand."""

    body: Any
    query: Any = None
    path_parameters: Any = None


CHAT_ONLY = {"tools", "tool_choice"}  # chat fields: the completions routes ignore them, as any unknown field
EDGE_CASES = [
    (route, index)
    for route in GENERATION_ROUTES
    for index, body in enumerate(EDGE_BODIES)
    if "chat" in route or isinstance(body, bytes) or not CHAT_ONLY & set(body)
]


@pytest.mark.parametrize(("route", "edge"), EDGE_CASES)
def test_edge_values_are_refused_in_openai_shape(api, route, edge):
    base, _ = api
    body = EDGE_BODIES[edge]
    if isinstance(body, bytes):
        content = body.replace(b"DEEP", DEEP.encode())
    else:
        content = json.dumps({"prompt": "Hi", "messages": CHAT, "max_tokens": MAX_TOKENS, **body}).encode()
    response = httpx.post(base + route, content=content, headers={"content-type": "application/json"}, timeout=60)
    check_response(f"POST {route}", Sent(content[:200]), response)
    assert 400 <= response.status_code < 500 or response.status_code == 501, response.text[:500]


@pytest.mark.parametrize("route", [*GENERATION_ROUTES, "/v1/embeddings", "/v1/cache/warm", "/v1/cache/clear"])
def test_a_body_that_is_not_json_is_refused_in_openai_shape(api, route):
    base, _ = api
    form = {"content-type": "application/x-www-form-urlencoded"}
    response = httpx.post(base + route, content=b"prompt=Hi", headers=form, timeout=60)
    check_response(f"POST {route}", Sent(b"prompt=Hi"), response)
    assert response.status_code == 415
