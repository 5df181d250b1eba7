"""Hostile input over HTTP: bounded lists, edge values that once were 500s, fields refused rather than ignored."""

from __future__ import annotations

import httpx
import pytest

from tests.engine_helpers import PROMPTS, build_checkpoint, make_engine
from tests.server_helpers import running_server
from tierserve.settings.config import load_settings
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")
    overrides = {("model", "path"): str(path), ("kv_cache", "l1_capacity"): 1024}
    loaded = load_settings(None, environ={}, overrides=overrides)
    engine = make_engine(path, kv_cache__l1_capacity=1024)
    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
        yield base, engine
    engine.close()


def post(server, route: str, body: dict, **options) -> httpx.Response:
    return httpx.post(f"{server[0]}{route}", json=body, timeout=120, **options)


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


# ---- every list is bounded ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "param", "limit"),
    [
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [0] * 1025}, "stop_token_ids", "1024"),
        ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, "stop", "16"),
        ("/v1/completions", {"prompt": "x", "stop": "a" * 257}, "stop", "256"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
        ("/v1/completions", {"prompt": ["a"] * 2049}, "prompt", "2048"),
        ("/v1/completions", {"prompt": [[1]] * 2049}, "prompt", "2048"),
        ("/v1/completions", {"prompt": [1] * (2**20 + 1)}, "prompt", "1048576"),
        ("/v1/chat/completions", {"messages": CHAT * 4097}, "messages", "4096"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1025}]},
         "messages.0.content", "1024"),
        ("/v1/cached/chat/completions", {"messages": CHAT, "stop_token_ids": [0] * 1025}, "stop_token_ids", "1024"),
        ("/v1/embeddings", {"input": ["a"] * 2049}, "input", "2048"),
        ("/v1/cache/warm", {"prompts": ["a"] * 2049}, "prompts", "2048"),
    ],
    ids=lambda value: value if isinstance(value, str) and len(value) < 40 else None,
)
def test_every_list_field_is_bounded_with_a_400_naming_the_field_and_the_limit(server, route, body, param, limit):
    assert_error(post(server, route, {"max_tokens": 2, **body}), 400, param, limit)


def test_the_longest_allowed_stop_token_list_still_stops_at_its_token(server):
    _, engine = server
    [full] = engine.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop = full.token_ids[3]
    unused = [t for t in range(engine.info.vocab_size) if t not in full.token_ids][:1023]
    body = {"prompt": PROMPTS[4], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": unused + [stop]}
    stopped = post(server, "/v1/completions", body).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == full.token_ids.index(stop) + 1


# ---- edge values that were 500s -----------------------------------------------------------------


def deep(levels: int, leaf: str = "1") -> str:
    return "[" * levels + leaf + "]" * levels


@pytest.mark.parametrize(
    ("route", "raw"),
    [
        ("/v1/completions", '{"max_tokens": 2, "prompt": %s}' % deep(100_000)),
        ("/v1/cached/completions", '{"max_tokens": 2, "prompt": %s}' % deep(100_000)),
        ("/v1/chat/completions", '{"max_tokens": 2, "messages": [{"role": "user", "content": %s}]}' % deep(100_000)),
        ("/v1/chat/completions",
         '{"max_tokens": 2, "messages": [{"role": "user", "content": [%s]}]}' % ('{"a": ' * 100_000 + "1" + "}" * 100_000)
         ),
        ("/v1/embeddings", '{"input": %s}' % deep(100_000)),
    ],
    ids=["prompt", "cached-prompt", "chat-content", "chat-content-objects", "embeddings-input"],
)
def test_json_nested_100000_deep_is_a_400(server, route, raw):
    response = httpx.post(f"{server[0]}{route}", content=raw.encode(), headers={"content-type": "application/json"},
                          timeout=120)
    assert_error(response, 400, None, "nested too deeply", "100 levels")
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_json_nested_within_the_safe_depth_is_parsed(server):
    raw = '{"max_tokens": 2, "prompt": "Hi", "metadata": %s}' % deep(100)
    response = httpx.post(f"{server[0]}/v1/completions", content=raw.encode(),
                          headers={"content-type": "application/json"}, timeout=120)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"seed": 2**64}, "seed", ["18446744073709551615"]),
        ({"seed": -(2**63) - 1}, "seed", ["-9223372036854775808"]),
        ({"seed": 10**30}, "seed", []),
        ({"beam_width": 2, "length_penalty": 1e308}, "length_penalty", ["10"]),
        ({"beam_width": 2, "length_penalty": -1e308}, "length_penalty", ["10"]),
    ],
)
def test_out_of_range_seed_and_length_penalty_are_400s(server, body, param, words):
    for route, base in (("/v1/completions", {"prompt": "Hi"}), ("/v1/cached/chat/completions", {"messages": CHAT})):
        assert_error(post(server, route, {**base, "max_tokens": 4, **body}), 400, param, *words)


def test_a_suffix_is_refused_not_ignored(server):
    """Fill-in-the-middle is not built: a completion with a suffix is a 501 naming it (it used to be dropped)."""
    assert_error(post(server, "/v1/completions", {"prompt": "def f(", "suffix": "    return x", "max_tokens": 4}),
                 501, "suffix", "fill-in-the-middle")  # fmt: skip
    assert post(server, "/v1/completions", {"prompt": "Hi", "suffix": "", "max_tokens": 2}).status_code == 200


def test_the_largest_seed_works_with_several_choices(server):
    for seed in (2**64 - 1, -(2**63)):
        body = {"prompt": "Hi", "max_tokens": 4, "seed": seed, "n": 3, "temperature": 1.0}
        first, again = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
        assert first.status_code == 200, first.text
        assert [c["text"] for c in first.json()["choices"]] == [c["text"] for c in again.json()["choices"]]


# ---- fields that were silently ignored ----------------------------------------------------------


def forced_token(engine) -> int:
    [greedy] = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return next(t for t in range(300, engine.info.vocab_size) if t not in greedy.token_ids)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_large_logit_bias_forces_its_token_on_both_routes(server, temperature):
    _, engine = server
    forced = forced_token(engine)
    expected = engine.decode([forced] * 6, skip_special_tokens=True)
    body = {"max_tokens": 6, "temperature": temperature, "seed": 1, "ignore_eos": True,
            "logit_bias": {str(forced): 100}}
    completion = post(server, "/v1/completions", {"prompt": PROMPTS[1], **body})
    assert completion.json()["choices"][0]["text"] == expected, completion.text
    chat = post(server, "/v1/cached/chat/completions", {"messages": CHAT, **body})
    assert chat.json()["choices"][0]["message"]["content"] == expected, chat.text
    unbiased = post(server, "/v1/completions", {"prompt": PROMPTS[1], **body, "logit_bias": {}}).json()
    assert unbiased["choices"][0]["text"] != expected


def test_min_tokens_delays_eos(server):
    _, engine = server
    eos = min(engine.info.eos_token_ids)
    body = {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "logit_bias": {str(eos): 100}}
    early = post(server, "/v1/completions", body).json()
    held = post(server, "/v1/completions", {**body, "min_tokens": 5}).json()
    assert early["choices"][0]["finish_reason"] == held["choices"][0]["finish_reason"] == "stop"
    assert held["usage"]["completion_tokens"] == early["usage"]["completion_tokens"] + 5
    assert early["choices"][0]["text"] == "" and held["choices"][0]["text"]


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        ("/v1/completions", {"prompt": "x", "logit_bias": {"2048": 5}}, "logit_bias",
         ["outside the vocabulary", "2047"]),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", ["-100 to 100"]),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias", ["not a token id"]),
        ("/v1/completions", {"prompt": "x", "min_tokens": 20}, "min_tokens", ["max_tokens (16)"]),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format",
         ['"json_object"']),
        ("/v1/cached/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": []}},
         "response_format", ['"schema"']),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]},
         "tools", ["function.name"]),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice", ["sends none"]),
        ("/v1/completions", {"prompt": [True, False]}, "prompt", ["token ids", "true and false"]),
        ("/v1/embeddings", {"input": [True]}, "input", ["true and false"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages.0.content", ["text"]),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, "max_tokens", ["context length (512)"]),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 600}, "max_tokens", ["context length"]),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "beam_width": 2, "n": 1, "min_tokens": 5}, "min_tokens",
         ["max_tokens (4)"]),
    ],
)
def test_invalid_or_impossible_fields_are_refused(server, route, body, param, words):
    """Wrong values are 400s; what tierserve does not build is a 501 (``test_not_implemented.py``)."""
    assert_error(post(server, route, body), 400, param, *words)


def test_implemented_forms_of_those_fields_are_accepted(server):
    for route, body in (
        ("/v1/completions", {"prompt": "x", "best_of": 2, "n": 2}),
        ("/v1/completions", {"prompt": "x", "best_of": 1}),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "text"}}),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "none", "tools": []}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        ("/v1/completions", {"prompt": "x", "min_tokens": 3, "ignore_eos": True}),
    ):
        response = post(server, route, {"max_tokens": 4, **body})
        assert response.status_code == 200, (body, response.text)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_json_is_a_415(server, content_type):
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/cache/warm"):
        response = httpx.post(f"{server[0]}{route}", content=b'{"prompt": "Hi", "max_tokens": 2}',
                               headers={"content-type": content_type}, timeout=60)
        assert_error(response, 415, "content-type", content_type, "application/json")


def test_json_content_types_with_parameters_are_accepted(server):
    for content_type in ("application/json; charset=utf-8", "Application/JSON"):
        response = httpx.post(f"{server[0]}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}',
                              headers={"content-type": content_type}, timeout=60)
        assert response.status_code == 200, response.text
    assert httpx.post(f"{server[0]}/v1/cache/offload", timeout=60).status_code == 200  # no body at all
