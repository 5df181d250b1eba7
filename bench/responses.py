"""The Responses API: TTFT of a conversation's 5th turn, chained by previous_response_id or resent whole.

One ``tierserve serve --preset production`` on the bench checkpoint. Each
repeat runs two fresh 5-turn conversations (``--turn-len`` words of new user
text per turn, ``--output-len`` tokens out) and times the first output_text
delta of turn 5:

- ``previous_response_id``: each turn names the one before (the server renders
  the stored conversation again: the earlier turns are a prefix-cache hit);
- ``history resent``: the other conversation, each turn sending all earlier
  turns as input items with ``store: false`` (what a client without
  ``previous_response_id`` does; the same tokens, so also a hit);
- ``cold``: that conversation's turn 5 again after ``POST /v1/cache/clear``.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import BenchContext
from bench.servers import start_tierserve
from bench.stats import median


def words(rng: random.Random, count: int) -> str:
    vocabulary = "the a dragon sea cave gold night stone river king storm ship light old new song".split()
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def first_delta_seconds(client: httpx.Client, body: dict) -> tuple[float, dict]:
    """Seconds to the first text delta of a streamed response, and the final response object."""
    start = time.perf_counter()
    first = None
    final: dict = {}
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if first is None and event["type"] == "response.output_text.delta":
                first = time.perf_counter() - start
            if event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    return (first if first is not None else time.perf_counter() - start), final


def run(ctx: BenchContext, turns: int, turn_len: int, output_len: int, repeats: int) -> dict:
    rows: dict[str, list[float]] = {"previous_response_id": [], "history resent": [], "cold": []}
    cached: dict[str, list[int]] = {name: [] for name in rows}
    with tempfile.TemporaryDirectory() as l3:
        server = start_tierserve(ctx.checkpoint, ctx.results_dir, Path(l3))
        try:
            client = httpx.Client(base_url=server.base_url, timeout=600)
            for repeat in range(repeats):
                rng = random.Random(repeat)
                previous = None
                for turn in range(turns):
                    body = {"model": server.model, "input": words(rng, turn_len), "max_output_tokens": output_len,
                            "temperature": 0}  # fmt: skip
                    if previous is not None:
                        body["previous_response_id"] = previous["id"]
                    seconds, previous = first_delta_seconds(client, body)
                rows["previous_response_id"].append(seconds)
                cached["previous_response_id"].append(previous["usage"]["input_tokens_details"]["cached_tokens"])
                history: list[dict] = []
                for turn in range(turns):
                    history.append({"role": "user", "content": words(rng, turn_len)})
                    resend = {"model": server.model, "input": history, "max_output_tokens": output_len,
                              "temperature": 0, "store": False}  # fmt: skip
                    seconds, final = first_delta_seconds(client, resend)
                    history.append({"role": "assistant", "content": final["output"][0]["content"][0]["text"]})
                rows["history resent"].append(seconds)
                cached["history resent"].append(final["usage"]["input_tokens_details"]["cached_tokens"])
                client.post("/v1/cache/clear", json={"tiers": "all"}).raise_for_status()
                seconds, final = first_delta_seconds(client, {**resend, "input": history[:-1]})
                rows["cold"].append(seconds)
                cached["cold"].append(final["usage"]["input_tokens_details"]["cached_tokens"])
                print({name: round(values[-1], 4) for name, values in rows.items()}, flush=True)
        finally:
            server.stop()
    summary = {name: {"ttft_s": median(values), "cached_tokens": median(cached[name])} for name, values in rows.items()}
    return {
        "config": {"turns": turns, "turn_len": turn_len, "output_len": output_len, "repeats": repeats},
        "rows": rows, "cached": cached, "summary": summary,
    }  # fmt: skip
