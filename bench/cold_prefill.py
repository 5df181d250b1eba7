"""Scenario ``cold-prefill``: time to first token of one long prompt that no cache holds.

One client, one request at a time, ``max_tokens = 1``; every prompt is fresh
(new random text per request), tierserve gets a ``cache_salt`` of its own per
request and llama-server ``cache_prompt: false``, so each system computes the
whole prompt every time. Systems alternate within a repeat; the figure is the
median TTFT per (system, prompt length). ``tierserve-bf16`` and
``tierserve-int8`` (bfloat16 or int8 weights) are compared with the matching
llama-server build (``llama-server-bf16``, ``llama-server-q8_0``).
"""

from __future__ import annotations

import random
import tempfile
import uuid
from pathlib import Path

from bench.client import drive
from bench.harness import BenchContext, warm_up
from bench.llama_cpp import PRECISIONS
from bench.servers import TIERSERVE_PRECISIONS, TIERSERVES, start
from bench.workloads import text_with_tokens

SYSTEMS = ("tierserve", *TIERSERVE_PRECISIONS, *PRECISIONS)
DEFAULT_SYSTEMS = ("tierserve", "llama-server")


def run(ctx: BenchContext, prompt_lens: list[int], requests: int, repeats: int, systems: list[str]) -> dict:
    rng = random.Random(7)
    prompts = {
        (n, repeat, i): text_with_tokens(ctx.tokenizer, n, rng)
        for repeat in range(repeats) for n in prompt_lens for i in range(requests)
    }  # fmt: skip
    runs: list[dict] = []
    total = repeats * len(systems) * len(prompt_lens) * requests
    with ctx.progress(total, "cold-prefill") as bar:
        for repeat in range(repeats):
            for system in systems:
                bar.set_postfix_str(f"{system} (repeat {repeat + 1}/{repeats})")
                with tempfile.TemporaryDirectory(prefix="tierserve-l3-") as l3:
                    server = start(system, ctx.checkpoint, ctx.results_dir / "logs", Path(l3), slots=1,
                                   context_per_slot=max(prompt_lens) + 64)  # fmt: skip
                    try:
                        warm_up(server, ctx.tokenizer)
                        for n in prompt_lens:
                            for i in range(requests):
                                extra = {"cache_salt": f"cold-{uuid.uuid4().hex}"} if system in TIERSERVES else {}
                                if system in PRECISIONS:
                                    extra = {"cache_prompt": False}
                                body = server.completion_body(prompts[(n, repeat, i)], 1, **extra)
                                summary = drive(server, [[body]], on_done=lambda: bar.update(1)).summary()
                                runs.append({"system": system, "prompt_len": n, "repeat": repeat, "request": i,
                                             "ttft_s": summary["ttft_p50_s"], "prompt_tokens": summary["prompt_tokens"],
                                             "cached_tokens": summary["cached_tokens"], "errors": summary["errors"]})  # fmt: skip
                    finally:
                        server.stop()
    config = {"model": ctx.model, "checkpoint": str(ctx.checkpoint), "prompt_lens": prompt_lens,
              "requests": requests, "repeats": repeats, "systems": systems}  # fmt: skip
    return {"config": config, "runs": runs}
