"""Load: 200 concurrent streaming clients, 10% of them leaving mid-stream, plus some bad requests."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.engine_helpers import build_checkpoint, make_engine
from tests.server_helpers import running_server
from tests.waiting import wait_until
from tierserve.settings.config import load_settings
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

CLIENTS = 200
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex boxing frogs".split()


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


def test_two_hundred_streams_with_disconnects(checkpoint):
    overrides = {
        ("model", "path"): str(checkpoint),
        ("scheduler", "max_num_seqs"): 256,
        ("scheduler", "max_waiting_requests"): 1024,
        ("kv_cache", "l1_capacity"): 4096,
    }
    loaded = load_settings(None, environ={}, overrides=overrides)
    engine = make_engine(checkpoint, scheduler__max_num_seqs=256, scheduler__max_waiting_requests=1024,
                         kv_cache__l1_capacity=4096)
    rng = random.Random(11)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 120))) for _ in range(CLIENTS)]
    max_tokens = [rng.randrange(4, 24) for _ in range(CLIENTS)]
    leavers = set(rng.sample(range(CLIENTS), CLIENTS // 10))
    for i in leavers:  # long enough that a leaver cannot have been answered in full before it leaves
        max_tokens[i] = min(400, engine.info.max_model_len - len(engine.encode_prompt(prompts[i])))  # within context
    reference = {
        i: engine.generate([prompts[i]], SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True))[0].text
        for i in range(0, CLIENTS, 7) if i not in leavers
    }
    engine.clear_cache("all")

    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
        baseline = rss_bytes()

        async def client(http: httpx.AsyncClient, i: int):
            body = {"prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0, "stream": True,
                    "ignore_eos": True}
            text, finish, seen = [], None, 0
            async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    seen += 1
                    if i in leavers and seen >= 1 + i % 3:
                        return i, None, "left"
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
            return i, "".join(text), finish

        async def bad(http: httpx.AsyncClient):
            return (await http.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 0})).status_code

        async def run():
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=300)) as http:
                return await asyncio.gather(*(client(http, i) for i in range(CLIENTS)), *(bad(http) for _ in range(5)))

        started = time.monotonic()
        outcomes = asyncio.run(run())
        elapsed = time.monotonic() - started
        results, bad_statuses = outcomes[:CLIENTS], outcomes[CLIENTS:]
        assert bad_statuses == [400] * 5
        finished = [r for r in results if r[2] != "left"]
        assert len(finished) == CLIENTS - len(leavers)
        assert all(finish == "length" for _, _, finish in finished)
        for i, text, _ in finished:
            if i in reference:
                assert text == reference[i], i


        def idle() -> bool:
            stats = engine.stats()
            return not (stats.requests_queued or stats.kv_usage)

        wait_until(idle, timeout=30, what="an idle engine")
        stats = engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.requests_queued == 0
        engine.check_integrity()


        def outcomes() -> tuple[float, float, float, float] | None:  # counted after each response ends
            text = httpx.get(f"{base}/metrics").text
            counts = [metric(text, "tierserve_request_outcomes_total", outcome=o) for o in ("success", "abort", "error")]
            requests = metric(text, "tierserve_requests_total", endpoint="/v1/completions")
            return (requests, *counts) if sum(counts) >= CLIENTS + 5 else None

        requests, success, aborts, errors = wait_until(outcomes, what="every request's outcome in /metrics")
        assert (success, aborts, errors) == (CLIENTS - len(leavers), len(leavers), 5)
        assert requests == success + aborts + errors
        growth = rss_bytes() - baseline
        print(f"\n{CLIENTS} streams ({len(leavers)} left mid-stream) + 5 bad requests in {elapsed:.1f}s; "
              f"RSS growth {growth / 2**20:.1f} MiB")
        assert growth < 256 * 2**20  # bounded: the KV arena is preallocated, caches are capped
    engine.close()
