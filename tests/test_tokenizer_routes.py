"""vLLM's tokenizer routes (``/tokenize``, ``/detokenize``, ``/tokenizer_info``): the ids are the completion
routes' own (lm-evaluation-harness's remote tokenizer uses them: tests/test_lm_eval.py)."""

from __future__ import annotations

import pytest

from tierserve.testing import http_client

pytestmark = pytest.mark.integration

TEXT = "The harbour tram leaves at nine."


@pytest.fixture(scope="module")
def client():
    with http_client({"auth.api_keys": ["tok-key-0123456789"]}) as client:
        client.headers["Authorization"] = "Bearer tok-key-0123456789"
        yield client


def test_tokenize_gives_the_ids_a_completion_counts_and_detokenize_reverses_them(client):
    engine = client.engine
    counted = client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    answer = client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == engine.encode_prompt(TEXT) and body["count"] == counted == len(body["tokens"])
    assert body["max_model_len"] == engine.max_model_len and "".join(body["token_strs"]).strip() != ""
    bare = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert bare == engine.tokenize(TEXT, add_special_tokens=False)
    assert client.post("/detokenize", json={"tokens": bare}).json()["prompt"] == TEXT
    chat = [{"role": "user", "content": TEXT}]
    rendered = client.post("/tokenize", json={"messages": chat}).json()
    assert rendered["tokens"] == engine.encode_prompt(None, chat)


def test_tokenizer_info_names_the_special_tokens(client):
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] is not None and info["model_max_length"] == client.engine.max_model_len
    assert info["vocab_size"] == client.engine.info.vocab_size


def test_bad_tokenizer_requests_are_400s_naming_the_field_and_keys_are_required(client):
    neither = client.post("/tokenize", json={})
    assert neither.status_code == 400 and "prompt" in neither.json()["error"]["message"]
    outside = client.post("/detokenize", json={"tokens": [10**9]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    assert client.post("/detokenize", json={"tokens": [True]}).status_code == 400  # a boolean is no token id
    empty = client.post("/tokenize", json={"messages": []})
    assert empty.status_code == 400 and "messages" in empty.json()["error"]["message"]
    unknown = client.post("/tokenize", json={"prompt": "x", "model": "no-such-model"})
    assert unknown.status_code == 404
    anonymous = client.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": ""})
    assert anonymous.status_code == 401

