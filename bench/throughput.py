"""Scenario ``throughput``: N concurrent clients, each one request of P prompt + O output tokens, greedy, eos ignored.

Every system gets the same requests: for each (N, repeat) a fresh set of
distinct prompts, so no run's prefixes are in the cache of the next. Each
repeat starts every server anew and runs the concurrency levels in order;
systems alternate within a repeat, so slow drift of the machine hits them all.
``hf-generate`` runs the same prompts as one static ``generate()`` batch of N
in this process (N = 1 is one request at a time). Each server's resident memory
(its whole process tree) is recorded after loading and at its peak in each run.
"""

from __future__ import annotations

import functools
import tempfile
import threading
from pathlib import Path

from bench.client import drive
from bench.harness import BenchContext, warm_up
from bench.hf_reference import HFGenerate
from bench.llama_cpp import PRECISIONS as LLAMA_SERVER_PRECISIONS
from bench.servers import TIERSERVE_VARIANTS, start
from bench.workloads import throughput_requests

SYSTEMS = ("tierserve", "transformers-serve-cb", "transformers-serve", "hf-generate", "tierserve-inproc", "tierserve-process",
           *LLAMA_SERVER_PRECISIONS, *TIERSERVE_VARIANTS)  # fmt: skip
DEFAULT_SYSTEMS = SYSTEMS[:4]  # engine-core placements and llama.cpp are compared on request (--systems)


class PeakMemory:
    """The highest resident memory of a server's process tree while the block runs (sampled every 0.2 s)."""

    def __init__(self, server) -> None:
        self.server = server
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, self.server.rss_bytes())
            if self._stop.wait(0.2):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, self.server.rss_bytes())


def run(
    ctx: BenchContext,
    concurrency: list[int],
    prompt_len: int,
    output_len: int,
    repeats: int,
    systems: list[str],
) -> dict:
    runs: list[dict] = []

    @functools.cache
    def requests_for(n: int, repeat: int) -> list:
        return throughput_requests(ctx.tokenizer, n, prompt_len, output_len, seed=1000 * repeat + n)

    total = repeats * len(systems) * sum(concurrency)
    reference: HFGenerate | None = None
    with ctx.progress(total, "throughput") as bar:
        for repeat in range(repeats):
            for system in systems:
                bar.set_postfix_str(f"{system} (repeat {repeat + 1}/{repeats})")
                if system == "hf-generate":
                    if reference is None:
                        reference = HFGenerate(ctx.checkpoint)
                        reference.warm_up()
                    for n in concurrency:
                        requests = requests_for(n, repeat)
                        summary = reference.static_batch([r.prompt for r in requests], output_len)
                        runs.append({"system": system, "concurrency": n, "repeat": repeat, **summary})
                        bar.update(n)
                    continue
                l3 = tempfile.TemporaryDirectory(prefix="tierserve-l3-")
                server = start(system, ctx.checkpoint, ctx.results_dir / "logs", Path(l3.name),
                               slots=max(concurrency), context_per_slot=prompt_len + output_len + 64)  # fmt: skip
                try:
                    loaded_rss = server.rss_bytes()
                    warm_up(server, ctx.tokenizer)
                    for n in concurrency:
                        requests = requests_for(n, repeat)
                        sessions = [[server.completion_body(r.prompt, r.max_tokens)] for r in requests]
                        with PeakMemory(server) as peak:
                            result = drive(server, sessions, on_done=lambda: bar.update(1))
                        summary = result.summary()
                        summary["short_outputs"] = sum(1 for r in result.ok if r.output_tokens != output_len)
                        summary["rss_load_bytes"], summary["rss_peak_bytes"] = loaded_rss, peak.bytes
                        runs.append({"system": system, "concurrency": n, "repeat": repeat, **summary})
                finally:
                    server.stop()
                    l3.cleanup()
    config = {
        "model": ctx.model,
        "checkpoint": str(ctx.checkpoint),
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "repeats": repeats,
        "systems": systems,
    }
    return {"config": config, "runs": runs}
