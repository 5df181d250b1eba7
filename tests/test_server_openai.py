"""The OpenAI-compatible API, driven by the official ``openai`` client against a real uvicorn server."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.engine_helpers import PROMPTS, build_checkpoint, hf_greedy, make_engine
from tests.server_helpers import running_server
from tests.waiting import wait_until
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


def server_settings(path, tmp_path=None, **extra):
    overrides = {
        ("model", "path"): str(path),
        ("model", "device"): "cpu",
        ("scheduler", "max_num_seqs"): 128,
        ("scheduler", "max_waiting_requests"): 512,
        ("kv_cache", "l1_capacity"): 2048,
    }
    overrides.update(extra)
    return load_settings(None, environ={}, overrides=overrides)


@pytest.fixture(scope="module")
def server(checkpoint):
    loaded = server_settings(checkpoint)
    engine = make_engine(checkpoint, scheduler__max_num_seqs=128, scheduler__max_waiting_requests=512, kv_cache__l1_capacity=2048)
    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
        yield base, engine, str(checkpoint)
    engine.close()


@pytest.fixture
def client(server):
    base, _, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list(client, server):
    models = client.models.list()
    [model] = models.data
    assert model.id == server[2]
    raw = httpx.get(f"{server[0]}/v1/models").json()["data"][0]
    assert raw["status"] == "ready" and raw["name"] == server[2] and raw["description"]
    assert raw["backend"] == server[1].info.backend == "native"  # model.backend = "auto", for a Llama checkpoint


def test_completion_matches_transformers_greedy(client, server, checkpoint):
    expected = hf_greedy(checkpoint, [PROMPTS[1]], 8)[0]
    result = client.completions.create(
        model=server[2], prompt=PROMPTS[1], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    engine = server[1]
    assert result.choices[0].text == engine.decode(expected)
    assert result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens == len(engine.encode_prompt(PROMPTS[1]))
    assert result.choices[0].finish_reason == "length"
    assert result.object == "text_completion" and result.id.startswith("cmpl-")


def test_completion_prompt_forms_n_and_logprobs(client, server):
    engine = server[1]
    ids = engine.encode_prompt("Hello there")
    by_text = client.completions.create(model=server[2], prompt="Hello there", max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=server[2], prompt=ids, max_tokens=4, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    many = client.completions.create(model=server[2], prompt=["a", "b"], max_tokens=3, n=2, temperature=0.8, seed=3,
                                     logprobs=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    for choice in many.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) >= 1
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)


def test_chat_and_cached_tokens_on_repeat(client, server):
    messages = [
        {"role": "system", "content": "You are a terse assistant who answers in one line. " * 6},
        {"role": "user", "content": "Name a colour."},
    ]
    first = client.chat.completions.create(model=server[2], messages=messages, max_tokens=6, temperature=0)
    second = client.chat.completions.create(model=server[2], messages=messages, max_tokens=6, temperature=0)
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_streaming_chat_with_usage(client, server):
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model=server[2], messages=messages, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=server[2], messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    text, usage, finish, roles = [], None, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles += choice.delta.role == "assistant"
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(text) == full.choices[0].message.content
    assert roles == 1 and finish == "length"
    assert usage.completion_tokens == 10


def test_streaming_sse_wire_format(server):
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_cached_endpoint_reports_measured_cache_stats(server):
    base = server[0]
    prefix = "The shared context of this conversation is long enough to fill several blocks. " * 4
    body = {"prompt": prefix + "First?", "max_tokens": 4, "temperature": 0, "cache_key": "ctx-1"}
    first = httpx.post(f"{base}/v1/cached/completions", json=body, timeout=60).json()
    second = httpx.post(f"{base}/v1/cached/completions", json={**body, "prompt": prefix + "Second?"}, timeout=60).json()
    engine = server[1]
    assert first["usage"]["prompt_tokens"] == len(engine.encode_prompt(prefix + "First?"))
    assert second["usage"]["prompt_tokens"] == len(engine.encode_prompt(prefix + "Second?"))  # the key adds nothing
    stats, perf = second["cache_stats"], second["performance"]
    assert stats["cache_used"] is True and stats["cache_hits"] > 0 and stats["prefix_matches"] == 1
    assert 0 < stats["hit_rate"] <= 100  # percent, as the spec shows it
    assert second["text"] == second["choices"][0]["text"] and second["finish_reason"] == "length"
    assert second["request_id"] == second["id"]
    assert second["usage"]["cached_tokens"] == second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert perf["total_time_ms"] > 0 and perf["inference_time_ms"] > 0 and perf["memory_usage_bytes"] > 0
    assert perf["tokens_per_second"] > 0
    off = httpx.post(f"{base}/v1/cached/completions",
                     json={**body, "cache_key": None, "enable_caching": False}, timeout=60).json()
    assert off["cache_stats"]["cache_used"] is False and off["usage"]["cached_tokens"] == 0
    # no speculator configured: asking for speculation gets prompt lookup, and the response says so
    drafted = httpx.post(f"{base}/v1/cached/completions", json={**body, "enable_speculation": True}, timeout=60)
    assert drafted.status_code == 200 and drafted.json()["cache_stats"]["speculation_method"] == "ngram"
    assert drafted.json()["choices"][0]["text"] == first["choices"][0]["text"]  # greedy speculation is lossless


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": 7}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "", "max_tokens": 3}, 400, "prompt"),
        ({"prompt": [10**9], "max_tokens": 3}, 400, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ({"prompt": "word " * 600}, 400, "prompt"),
    ],
)
def test_errors_have_openai_shape(server, body, status, param):
    response = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert "Traceback" not in response.text and "/work/" not in response.text


def test_unknown_route_and_method_and_body_size(server):
    base = server[0]
    missing = httpx.get(f"{base}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.get(f"{base}/v1/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()
    huge = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "' + b"a" * (11 * 1024 * 1024) + b'"}',
                      headers={"content-type": "application/json"}, timeout=60)
    assert huge.status_code == 413 and "error" in huge.json()
    broken = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "error" in broken.json()


def test_unknown_fields_are_ignored(client, server):
    result = client.completions.create(model=server[2], prompt="Hi", max_tokens=2, temperature=0,
                                       extra_body={"some_future_field": {"a": 1}, "user": "u1"})
    assert result.usage.completion_tokens >= 1


def test_disconnecting_stream_frees_blocks(server):
    base, engine, _ = server
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        for index, _ in enumerate(response.iter_lines()):
            if index >= 3:
                break  # leave mid-stream
    def settled() -> bool:  # blocks other tests' cache keys pin stay taken
        stats = engine.stats()
        return not stats.requests_queued and stats.kv_blocks_free + stats.kv_blocks_pinned == stats.kv_blocks_total

    wait_until(settled, timeout=20, what="the left stream's blocks to be freed")
    stats = engine.stats()
    assert stats.requests_queued == 0
    assert stats.kv_blocks_free + stats.kv_blocks_pinned == stats.kv_blocks_total  # pinned: other tests' cache keys
    assert stats.counters.requests_aborted >= 1


def test_hundred_concurrent_streams_all_complete(server):
    base, engine, _ = server
    expected = {}

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str, str | None]:
        body = {"prompt": f"Request number {i}: ", "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True}
        text, finish = [], None
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
        return i, "".join(text), finish

    async def run_all():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(120)))

    results = asyncio.run(run_all())
    for i in (0, 57, 119):
        expected[i] = engine.generate(
            [f"Request number {i}: "],
            __import__("tierserve.core.sampling_params", fromlist=["SamplingParams"]).SamplingParams(
                temperature=0, max_tokens=6, ignore_eos=True
            ),
        )[0].text
    assert len(results) == 120 and all(finish == "length" for _, _, finish in results)
    for i, text, _ in results:
        if i in expected:
            assert text == expected[i]


def test_echo_prepends_the_prompt(server):
    base = server[0]
    body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    echoed = httpx.post(f"{base}/v1/completions", json={**body, "echo": True}, timeout=60).json()["choices"][0]["text"]
    assert echoed == "Hello there" + plain
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "echo": True, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == echoed
    scored = httpx.post(f"{base}/v1/completions", json={**body, "echo": True, "logprobs": 1}, timeout=60).json()
    assert scored["choices"][0]["text"] == echoed  # the prompt's logprobs too: tests/test_prompt_logprobs.py
    assert scored["choices"][0]["logprobs"]["token_logprobs"][0] is None


def test_warm_under_a_cache_key_then_reference_it(server):
    base = server[0]
    context = "A manual for the espresso machine: descale monthly, use filtered water, purge the wand. " * 3
    warmed = httpx.post(f"{base}/v1/cache/warm", json={"prompts": [context], "cache_key": "manual"}, timeout=60).json()
    assert warmed["tokens"] > 0
    question = context + " How often to descale?"  # a key names the prefix; the prompt still carries it
    reply = httpx.post(f"{base}/v1/cached/completions",
                       json={"prompt": question, "cache_key": "manual", "max_tokens": 3}, timeout=60).json()
    assert reply["cache_stats"]["cache_used"] and reply["usage"]["cached_tokens"] >= warmed["tokens"] - 16
    assert reply["usage"]["prompt_tokens"] == len(server[1].encode_prompt(question))
    two = httpx.post(f"{base}/v1/cache/warm", json={"prompts": ["a", "b"], "cache_key": "x"}, timeout=60)
    assert two.status_code == 400 and two.json()["error"]["param"] == "cache_key"


def test_beam_search_request_option(server, checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    base, engine, name = server
    ids = engine.encode_prompt("Once upon a time")
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             num_beams=3, do_sample=False, max_new_tokens=6, num_return_sequences=2, pad_token_id=4)
    reply = httpx.post(f"{base}/v1/completions", json={"prompt": ids, "max_tokens": 6, "beam_width": 3, "n": 2},
                       timeout=60).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for choice, row in zip(reply["choices"], out[:, len(ids):].tolist()):
        expected = [t for t in row if t != 4]
        assert choice["text"] == engine.decode(
            [t for t in expected if t not in engine.info.eos_token_ids], skip_special_tokens=True)
    bad = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "beam_width": 3, "stream": True}, timeout=60)
    assert bad.status_code == 501 and bad.json()["error"]["param"] == "stream"


def test_tenants_never_share_cached_prefixes(server):
    base = server[0]
    prompt = "Confidential context of tenant A, long enough to fill a few KV blocks of sixteen tokens. " * 3
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}

    def cached(salt):
        reply = httpx.post(f"{base}/v1/completions", json={**body, "cache_salt": salt}, timeout=60).json()
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same tokens, other tenant: no hit
    assert cached(None) == 0  # nor for requests without a salt
    assert cached("tenant-a") > 0
