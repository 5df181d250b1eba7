"""What one request may take from the server: generation length, the sliding window, a client that left
or stopped reading, and prompt text (tokenized off the event loop, bounded before it).

Each test is a regression test for a defect a hostile user found.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
from urllib.parse import urlsplit

import httpx
import pytest

from tests.engine_helpers import assert_pool_released, build_checkpoint, make_engine
from tests.server_helpers import running_server
from tests.waiting import wait_until
from tierserve.settings.config import load_settings
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


def serve(checkpoint, values: dict[str, object]):
    """A server with these dotted settings, around an engine built from the same ones (and that engine)."""
    overrides = {("model", "path"): str(checkpoint), ("model", "device"): "cpu", ("logging", "level"): "warning"}
    overrides.update({tuple(key.split(".")): value for key, value in values.items()})
    loaded = load_settings(None, environ={}, overrides=overrides)
    engine = make_engine(checkpoint, **{key.replace(".", "__"): value for key, value in values.items()})
    return running_server(loaded.settings, engine=engine, plugins=loaded.plugins), engine


def send_raw(base: str, path: str, body: dict) -> socket.socket:
    """POST ``body`` on a socket of our own, so the test decides when the client reads or leaves."""
    address = urlsplit(base)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")  # fmt: skip
    sock = socket.create_connection((address.hostname, address.port))
    sock.sendall(head.encode() + payload)
    return sock


# ---- item 6: unbounded generation ---------------------------------------------------------------


def test_a_non_streaming_request_whose_client_leaves_is_aborted_and_frees_its_blocks(checkpoint):
    # more tokens than the tiny model decodes in the two minutes waited for, even alone on a fast machine
    server, engine = serve(checkpoint, {"sliding_window.enabled": True, "server.max_tokens_limit": 10**7})
    body = {"prompt": "go on and on", "max_tokens": 10**7, "ignore_eos": True, "temperature": 0,
            "enable_sliding_window": True}  # fmt: skip
    with server as base:
        sock = send_raw(base, "/v1/cached/completions", body)
        wait_until(lambda: engine.stats().requests_running == 1, timeout=60)  # it is generating
        sock.close()
        wait_until(lambda: engine.stats().requests_queued == 0, timeout=120)
        stats = engine.stats()
        assert stats.counters.requests_aborted == 1 and stats.counters.finish_reasons.get("length", 0) == 0
        assert stats.counters.generation_tokens < body["max_tokens"]  # it stopped when its client left
        assert_pool_released(engine)
        assert httpx.get(f"{base}/health/live").status_code == 200
    engine.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 65}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 65}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 65}),
        ("/v1/cached/completions", {"prompt": "Hi", "max_tokens": 10**9, "enable_sliding_window": True}),
        ("/v1/cached/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 65, "enable_sliding_window": True}),
        ("/v1/cached/completions", {"prompt": "Hi", "max_tokens": 65, "use_beam_search": True}),
    ],
)
def test_max_tokens_above_max_tokens_limit_is_a_400_on_every_route(checkpoint, path, body):
    server, engine = serve(checkpoint, {"server.max_tokens_limit": 64, "sliding_window.enabled": True})
    with server as base:
        refused = httpx.post(base + path, json=body, timeout=60)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        assert error["param"] == param and "64" in error["message"] and "server.max_tokens_limit" in error["message"]
        at_limit = {**body, param: 64, "ignore_eos": True}
        if "use_beam_search" not in body:
            assert httpx.post(base + path, json=at_limit, timeout=120).json()["usage"]["completion_tokens"] == 64
    engine.close()


def test_a_request_naming_no_max_tokens_generates_at_most_max_tokens_limit(checkpoint):
    server, engine = serve(checkpoint, {"server.max_tokens_limit": 8})
    with server as base:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        reply = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60)
        assert reply.json()["usage"]["completion_tokens"] == 8
    engine.close()


def test_the_window_flag_is_a_400_where_the_operator_forbids_it(checkpoint):
    past_context = {"prompt": "Hello there", "max_tokens": 520, "ignore_eos": True, "temperature": 0}
    server, engine = serve(checkpoint, {"sliding_window.allow_per_request": False})
    with server as base:
        windowed = {**past_context, "enable_sliding_window": True}
        refused = httpx.post(f"{base}/v1/cached/completions", json=windowed, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "enable_sliding_window"
        assert "allow_per_request" in refused.json()["error"]["message"]
        off = {"prompt": "Hi", "max_tokens": 2, "enable_sliding_window": False}
        assert httpx.post(f"{base}/v1/cached/completions", json=off, timeout=60).status_code == 200
    assert_pool_released(engine)
    engine.close()
    window = {"sliding_window.window_size": 64, "sliding_window.window_overlap": 16}  # allowed per request by default
    server, engine = serve(checkpoint, window)
    with server as base:
        windowed = {**past_context, "enable_sliding_window": True}
        allowed = httpx.post(f"{base}/v1/cached/completions", json=windowed, timeout=120)
        assert allowed.status_code == 200, allowed.text
        assert allowed.json()["usage"]["completion_tokens"] == 520  # past the 512-token context: the window slid
        plain = httpx.post(f"{base}/v1/cached/completions", json=past_context, timeout=120)
        # allowed per request, not on by default: without it the context bounds the request (a 400, no clamp)
        assert plain.status_code == 400 and plain.json()["error"]["code"] == "context_length_exceeded"
    engine.close()


def test_a_stream_whose_reader_stops_reading_is_aborted_past_max_stream_backlog(checkpoint):
    engine = make_engine(checkpoint, server__max_stream_backlog=8)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def scenario():
        ids = engine.encode_prompt("nobody reads")
        request_id, stream = engine.submit(ids, params, loop=asyncio.get_running_loop())
        for _ in range(40):  # the core steps; the stream's reader (this coroutine) takes nothing meanwhile
            engine.step()
        stats = engine.stats()
        assert stats.requests_queued == 0 and stats.counters.requests_aborted == 1
        return [output async for output in engine.outputs(request_id, stream)]

    outputs = asyncio.run(scenario())
    assert outputs[-1].finish_reason == "abort" and len(outputs) <= 10  # 9 unread deltas, then the end
    assert_pool_released(engine)

    async def reading():  # a reader that keeps up (one delta taken per step) is never cut short
        request_id, stream = engine.submit(engine.encode_prompt("read along"), params, loop=asyncio.get_running_loop())
        deltas = engine.outputs(request_id, stream)
        taken = []
        while not taken or not taken[-1].finished:
            engine.step()
            taken.append(await asyncio.wait_for(anext(deltas), 30))
        return taken

    taken = asyncio.run(reading())
    assert taken[-1].finish_reason == "length" and len(taken) == params.max_tokens
    engine.close()


def test_a_reader_with_a_deadline_cancelled_as_a_delta_arrives_still_aborts_its_request(checkpoint):
    # Python 3.11's asyncio.wait_for returned the delta and dropped the cancel when both came in one loop
    # iteration: the non-streaming handler then waited for ever on a request generating without end
    engine = make_engine(checkpoint)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def cancelled_after(turns: int) -> None:
        loop = asyncio.get_running_loop()
        request_id, stream = engine.submit(engine.encode_prompt("cancel me"), params, loop=loop)

        async def read() -> None:
            async for _ in engine.outputs(request_id, stream, deadline=loop.time() + 600):
                pass

        reader = asyncio.create_task(read())
        for _ in range(3):
            await asyncio.sleep(0)  # the reader waits for its first delta
        engine.step()  # one delta is on its way to the reader's queue
        for _ in range(turns):
            await asyncio.sleep(0)
        reader.cancel()
        done, _ = await asyncio.wait({reader}, timeout=10)
        assert done and reader.cancelled(), f"cancelled {turns} loop turns after a delta: the reader kept waiting"
        engine.step()  # the abort the reader sent applies
        assert engine.stats().requests_queued == 0

    for turns in range(6):
        asyncio.run(cancelled_after(turns))
    assert engine.stats().counters.requests_aborted == 6
    assert_pool_released(engine)
    engine.close()


# ---- item 8: tokenizing on the event loop ---------------------------------------------------------


def test_health_live_answers_while_a_long_prompt_is_tokenized(checkpoint):
    # under the default server.max_prompt_bytes (1 MiB), and seconds of tokenizing with this tokenizer
    text = "1234567890 " * 90_000
    server, engine = serve(checkpoint, {})
    tokenizing, encode = threading.Event(), engine.encode_prompt

    def encode_and_say_so(*args, **kwargs):
        tokenizing.set()
        return encode(*args, **kwargs)

    engine.encode_prompt = encode_and_say_so
    with server as base:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
        sock = send_raw(base, "/v1/chat/completions", body)
        wait_until(tokenizing.is_set, timeout=60, what="the server to begin tokenizing the long prompt")
        for _ in range(3):
            assert httpx.get(f"{base}/health/live", timeout=120).status_code == 200
        readable, _, _ = select.select([sock], [], [], 0)
        assert not readable, "the long prompt was answered before /health/live: the event loop was blocked"
        sock.settimeout(120)
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 400")  # it was tokenized: 180,000 tokens do not fit the context
        sock.close()
    engine.close()


def test_prompt_text_over_max_prompt_bytes_is_a_400_before_tokenizing(checkpoint):
    server, engine = serve(checkpoint, {"server.max_prompt_bytes": 1000})
    over = "é" * 501  # 1,002 bytes in 501 characters; tokenized, far more than the context allows
    with server as base:
        for path, body, param in (
            ("/v1/completions", {"prompt": over, "max_tokens": 1}, "prompt"),
            ("/v1/completions", {"prompt": ["short", over[:300], over[:300]], "max_tokens": 1}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}]}, "messages"),
            ("/v1/cached/chat/completions",
             {"messages": [{"role": "user", "content": [{"type": "text", "text": over}]}]}, "messages"),
            ("/v1/embeddings", {"input": [over]}, "input"),
        ):
            refused = httpx.post(base + path, json=body, timeout=60)
            assert refused.status_code == 400, (path, refused.text)
            error = refused.json()["error"]
            assert error["param"] == param and "1000" in error["message"] and "max_prompt_bytes" in error["message"]
        fits = httpx.post(f"{base}/v1/completions", json={"prompt": "é" * 400, "max_tokens": 1}, timeout=60)
        assert fits.status_code == 200, fits.text
    engine.close()
