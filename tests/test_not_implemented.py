"""501 for what tierserve deliberately does not build, 400 for what is wrong: each 501 beside its 400 neighbours.

A 501 names the field, the value sent and what is supported, in OpenAI's error shape, with
``x-should-retry: false`` so that OpenAI's clients do not send it again.
"""

from __future__ import annotations

import openai
import pytest

from tests.engine_helpers import build_checkpoint
from tests.lora_helpers import make_adapter
from tierserve.testing import http_client

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Hi"}]
BASE = "base-model"

# (route, body, param, words the message holds: the value sent and what is supported)
NOT_BUILT = [
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of", ["got 3", "1 or n (1)"]),
    ("/v1/completions", {"prompt": "x", "best_of": 4, "n": 2}, "best_of", ["got 4", "1 or n (2)"]),
    ("/v1/cached/completions", {"prompt": "x", "best_of": 2}, "best_of", ["got 2", "1 or n (1)"]),
    ("/v1/completions", {"prompt": "def f(", "suffix": "    return x"}, "suffix",
     ['got "    return x"', "fill-in-the-middle", 'omitted, null or ""']),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions",
     ['got [{"name": "f"}]', "send tools"]),
    ("/v1/chat/completions", {"messages": CHAT, "function_call": {"name": "f"}}, "function_call",
     ['got {"name": "f"}', '"none" or "auto"']),
    ("/v1/completions", {"prompt": "x", "beam_width": 2, "stream": True}, "stream",
     ["got true", "streaming beam search", "false with beam_width > 1"]),
    ("/v1/completions", {"prompt": "x", "beam_width": 2, "logit_bias": {"5": 1}}, "logit_bias",
     ['got {"5": 1.0}', "omitted with beam_width > 1"]),
    ("/v1/cached/completions", {"prompt": "x", "beam_width": 2, "cache_key": "k"}, "cache_key",
     ['got "k"', "omitted with beam_width > 1"]),
    ("/v1/completions", {"prompt": "x", "beam_width": 2, "guided_regex": "a+"}, "guided_regex",
     ['got "a+"', "output constraint", "omitted with beam_width > 1"]),
    ("/v1/chat/completions", {"messages": CHAT, "beam_width": 2, "response_format": {"type": "json_object"}},
     "response_format", ['got {"type": "json_object"}', "omitted with beam_width > 1"]),
    ("/v1/completions", {"prompt": "x", "model": "ad", "beam_width": 2}, "model",
     ['got "ad"', "LoRA adapter", f"a base model with beam_width > 1, such as '{BASE}'"]),
    ("/v1/embeddings", {"input": "x", "model": "ad"}, "model", ['got "ad"', "LoRA adapter", f"'{BASE}'"]),
    ("/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio",
     ['got {"voice": "alloy", "format": "wav"}', "audio output", "text only"]),
    ("/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities",
     ['got ["text", "audio"]', '["text"] or omitted']),
    ("/v1/chat/completions", {"messages": CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction",
     ["predicted outputs", "omitted or null"]),
    ("/v1/chat/completions", {"messages": CHAT, "web_search_options": {}}, "web_search_options",
     ["got {}", "web search"]),
    ("/v1/chat/completions", {"messages": CHAT, "store": True}, "store", ["got true", "false or omitted"]),
    ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning",
     ['got {"effort": "high"}', "omitted or null"]),
    ("/v1/responses", {"input": "Hi", "background": True}, "background", ["got true", "false or omitted"]),
    ("/v1/responses", {"input": "Hi", "include": ["message.output_text.logprobs"]}, "include",
     ['got ["message.output_text.logprobs"]', "omitted or []"]),
    ("/v1/responses", {"input": "Hi", "truncation": "auto"}, "truncation", ['got "auto"', '"disabled" or omitted']),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type",
     ['got "web_search"', "supported: function"]),
    ("/v1/responses", {"input": [{"role": "user", "content": "Hi"}, {"type": "reasoning", "summary": []}]},
     "input[1].type", ['got "reasoning"', "message, function_call, function_call_output"]),
]  # fmt: skip

# the neighbours: a wrong value of the same fields (or a wrong value beside a 501 feature) stays a 400
STILL_400 = [
    ("/v1/completions", {"prompt": "x", "best_of": 0}, "best_of", ["greater than or equal to 1"]),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "temperature": 9}, "temperature", ["2"]),
    ("/v1/completions", {"prompt": "x", "suffix": 5}, "suffix", ["string"]),
    ("/v1/completions", {"prompt": "x", "suffix": "y", "n": 99}, "n", ["16"]),
    ("/v1/chat/completions", {"messages": CHAT, "functions": "f"}, "functions", ["list"]),
    ("/v1/chat/completions", {"messages": CHAT, "function_call": "sometimes"}, "function_call", ['"none", "auto"']),
    ("/v1/completions", {"prompt": "x", "beam_width": 17, "stream": True}, "beam_width", ["16"]),
    ("/v1/completions", {"prompt": "x", "beam_width": 2, "stream": True, "max_tokens": 4, "min_tokens": 50},
     "min_tokens", ["max_tokens (4)"]),
    ("/v1/completions", {"prompt": "x", "beam_width": 2, "logit_bias": {"5": 101}}, "logit_bias", ["-100 to 100"]),
    ("/v1/cached/completions", {"prompt": ["x", "y"], "beam_width": 2, "cache_key": "k"}, "cache_key",
     ["one prompt"]),
    ("/v1/completions", {"prompt": "x", "beam_width": 2, "guided_regex": "a(b"}, "guided_regex", ["unclosed group"]),
    ("/v1/embeddings", {"input": "", "model": "ad"}, "input", ["must not be empty"]),
    ("/v1/embeddings", {"input": "x", "dimensions": 3}, "dimensions", ["not 3"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", ["text"]),
    ("/v1/responses", {"input": "Hi", "reasoning": "high"}, "reasoning", ["dictionary"]),
    ("/v1/responses", {"input": "Hi", "background": True, "max_output_tokens": 0}, "max_output_tokens", ["1"]),
    ("/v1/responses", {"input": "Hi", "truncation": "sometimes"}, "truncation", ["'disabled'"]),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "web_search"}, {"type": "nonsense"}]}, "tools[1].type",
     ["'nonsense'", "allowed: function"]),
    ("/v1/responses", {"input": [{"type": "reasoning"}, {"type": "nonsense"}]}, "input[1].type", ["'nonsense'"]),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", ["text only"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The app on a small Llama checkpoint served as ``base-model``, with the LoRA adapter ``ad`` loaded."""
    root = tmp_path_factory.mktemp("not-built")
    checkpoint = build_checkpoint(root, "base", "llama")
    adapter = make_adapter(checkpoint, root / "ad", 1, ["q_proj", "v_proj"], rank=4, alpha=8)
    settings = {"model.path": str(checkpoint), "model.served_model_name": BASE, "model.max_loras": 1,
                "model.lora_adapters": {"ad": str(adapter)}}  # fmt: skip
    with http_client(settings) as client:
        yield client


def body_for(route: str, body: dict) -> dict:
    if route == "/v1/embeddings":
        return body
    return {"max_output_tokens": 4, **body} if route == "/v1/responses" else {"max_tokens": 4, **body}


def error_of(response, status: int, param: str, words: list[str]) -> dict:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error
    for word in words:
        assert word in error["message"], error
    return error


@pytest.mark.parametrize(("route", "body", "param", "words"), NOT_BUILT)
def test_what_is_not_built_is_a_501_naming_field_value_and_what_is_supported(client, route, body, param, words):
    response = client.post(route, json=body_for(route, body))
    error = error_of(response, 501, param, [*words, "is not implemented here; supported: "])
    assert error["type"] == "not_implemented_error" and error["code"] == "not_implemented"
    assert response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(("route", "body", "param", "words"), STILL_400)
def test_a_wrong_value_beside_them_is_still_a_400(client, route, body, param, words):
    response = client.post(route, json=body_for(route, body))
    error = error_of(response, 400, param, words)
    assert error["type"] == "invalid_request_error" and error["code"] != "not_implemented"
    assert "x-should-retry" not in response.headers


def test_what_is_built_of_those_fields_is_served(client):
    for route, body in (
        ("/v1/completions", {"prompt": "x", "best_of": 2, "n": 2}),
        ("/v1/completions", {"prompt": "x", "suffix": ""}),
        ("/v1/chat/completions", {"messages": CHAT, "function_call": "auto", "functions": []}),
        ("/v1/chat/completions", {"messages": CHAT, "modalities": ["text"], "store": False, "audio": None}),
        ("/v1/completions", {"prompt": "x", "beam_width": 2, "stream": False}),
        ("/v1/completions", {"prompt": "x", "model": "ad"}),
        ("/v1/embeddings", {"input": "x", "model": BASE}),
        ("/v1/responses", {"input": "Hi", "background": False, "include": [], "truncation": "disabled"}),
    ):
        response = client.post(route, json=body_for(route, body))
        assert response.status_code == 200, (body, response.text[:500])


def test_openais_client_gets_the_501_once_without_retrying(client):
    sent = []
    client.event_hooks["request"].append(sent.append)
    sdk = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client, max_retries=2)
    with pytest.raises(openai.InternalServerError) as failure:
        sdk.completions.create(model=BASE, prompt="x", max_tokens=4, best_of=3)
    assert failure.value.status_code == 501 and failure.value.body["code"] == "not_implemented"
    assert len(sent) == 1
