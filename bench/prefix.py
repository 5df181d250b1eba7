"""Scenario ``prefix``: multi-turn chats sharing one long system prompt.

C conversations run concurrently, each T turns in order (C x T requests).
Turn t's prompt is the shared P-token system prompt, the conversation's
earlier turns (fixed text, so every system sees the same prompts), and a new
user message; each request asks for O tokens, greedy, eos ignored.

tierserve runs the workload once per cache state, each time from a cleared
cache and under its own ``cache_salt`` (so one state's blocks never serve
another's):

- ``cold``: every request has a salt of its own, so nothing is ever reused;
- ``fresh``: an empty cache and one salt, so the first requests compute the
  system prompt and later ones reuse it (what an in-memory prefix cache such
  as transformers serve's ``--continuous-batching`` block sharing gives);
- ``L1``: the system prompt was warmed (``/v1/cache/warm``) into the live pool;
- ``L2``: warmed, then moved to host memory (``/v1/cache/offload``);
- ``L3``: warmed, then the server was stopped and started again on the same
  disk folder, so the prefix is read back from disk.

Within a run, later turns also reuse the conversation's own earlier turns.
``tierserve-bf16`` and ``tierserve-int8`` run the same states with bfloat16 or
int8 weights, the peers of ``llama-server-bf16`` and ``llama-server-q8_0``;
``tierserve-kvbf16-whole-blocks`` reuses whole blocks only (against
``tierserve-kvbf16``: what partial-block reuse gives);
``tierserve-prompts-every-step`` and ``tierserve-kvbf16-prompts-every-step`` let
new prompts start in the step right after one that started prompts (against
``tierserve`` and ``tierserve-kvbf16``: what the production preset's decode step
between prefills gives).
The peers run the same requests once, on a freshly started server.
``transformers serve`` without continuous batching keeps no KV between
requests; with it, identical prompt blocks are shared in memory while the
server runs (comparable to ``fresh``), and nothing survives a restart.
``llama-server`` keeps each slot's last prompt (``cache_prompt``) and reuses
its longest common prefix with the slot's next request. Reported per run: TTFT p50/p99 over all requests, the median TTFT of
the first turns (the requests that read the system prompt from the tier under
test), output tokens/s, and the prompt tokens served from cache.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import httpx

from bench.client import RunResult, drive
from bench.harness import BenchContext, warm_up
from bench.llama_cpp import PRECISIONS as LLAMA_SERVER_PRECISIONS
from bench.servers import TIERSERVE_PRECISIONS, Server, start
from bench.stats import median
from bench.workloads import shared_prefix_conversations

OURS = ("tierserve", *TIERSERVE_PRECISIONS, "tierserve-kvbf16-whole-blocks", "tierserve-prompts-every-step",
        "tierserve-kvbf16-prompts-every-step")
PEERS = ("transformers-serve-cb", "transformers-serve", *LLAMA_SERVER_PRECISIONS)
DEFAULT_PEERS = PEERS[:2]  # llama-server (built from source on first use) on request
CACHE_STATES = ("cold", "fresh", "L1", "L2", "L3")


def _summarise(result: RunResult) -> dict:
    summary = result.summary()
    summary["first_turn_ttft_s"] = median([r.ttft for r in result.ok if r.turn == 0])
    return summary


def _admin(server: Server, path: str, body: dict | None = None) -> dict:
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def run(
    ctx: BenchContext,
    conversations: int,
    turns: int,
    prefix_len: int,
    turn_len: int,
    output_len: int,
    repeats: int,
    systems: list[str],
    states: tuple[str, ...] | list[str] = CACHE_STATES,
) -> dict:
    system_prompt, chats = shared_prefix_conversations(ctx.tokenizer, conversations, turns, prefix_len, turn_len)
    requests = conversations * turns
    ours = [s for s in systems if s in OURS]
    peers = [s for s in systems if s not in OURS]
    states = [state for state in CACHE_STATES if state in states]
    total = repeats * requests * (len(states) * len(ours) + len(peers))
    runs: list[dict] = []

    def sessions(server: Server, salt: str | None) -> list[list[dict]]:
        def extra() -> dict:
            if server.name not in OURS:
                return {}
            return {"cache_salt": salt or f"cold-{uuid.uuid4().hex}"}

        return [
            [server.completion_body(chat.prompt(t), output_len, **extra()) for t in range(turns)] for chat in chats
        ]

    with ctx.progress(total, "prefix") as bar:
        done = lambda: bar.update(1)  # noqa: E731
        for repeat in range(repeats):
            for name in ours:
                with tempfile.TemporaryDirectory(prefix="tierserve-l3-") as l3:
                    logs = ctx.results_dir / "logs"
                    server = start(name, ctx.checkpoint, logs, Path(l3))
                    try:
                        warm_up(server, ctx.tokenizer)
                        for state in states:
                            bar.set_postfix_str(f"{name} {state} (repeat {repeat + 1}/{repeats})")
                            _admin(server, "/v1/cache/clear")
                            salt = None if state == "cold" else f"{state}-{repeat}"
                            if state not in ("cold", "fresh"):
                                _admin(server, "/v1/cache/warm", {"prompts": [system_prompt], "cache_salt": salt})
                            if state == "L2":
                                _admin(server, "/v1/cache/offload")
                            if state == "L3":
                                server.stop()  # graceful: queued L3 writes are flushed
                                server = start(name, ctx.checkpoint, logs, Path(l3))
                                warm_up(server, ctx.tokenizer)
                            result = drive(server, sessions(server, salt), on_done=done)
                            runs.append({"system": name, "cache": state, "repeat": repeat, **_summarise(result)})
                    finally:
                        server.stop()
            for peer in peers:
                bar.set_postfix_str(f"{peer} (repeat {repeat + 1}/{repeats})")
                context = prefix_len + turns * (2 * turn_len + output_len) + 256  # the last turn, with room to spare
                server = start(peer, ctx.checkpoint, ctx.results_dir / "logs", Path(tempfile.gettempdir()),
                               slots=conversations, context_per_slot=context)  # fmt: skip
                try:
                    warm_up(server, ctx.tokenizer)
                    result = drive(server, sessions(server, None), on_done=done)
                    cache = "slot prompt cache" if peer in LLAMA_SERVER_PRECISIONS else "none"
                    runs.append({"system": peer, "cache": cache, "repeat": repeat, **_summarise(result)})
                finally:
                    server.stop()
    config = {
        "model": ctx.model,
        "checkpoint": str(ctx.checkpoint),
        "conversations": conversations,
        "turns": turns,
        "prefix_len": prefix_len,
        "turn_len": turn_len,
        "output_len": output_len,
        "repeats": repeats,
        "systems": systems,
        "states": states,
    }
    return {"config": config, "runs": runs}
