"""Scenario ``startup``: seconds from ``serve`` to ready on a GGUF file, tierserve against llama-server, and where
tierserve's time goes.

Each system is started ``repeats`` times, alternating, on the same file and the same loopback port range:
``tierserve serve --model MODEL`` until ``/health/ready`` answers 200, ``llama-server -m FILE -t THREADS`` until
``/health`` answers 200; then one greedy chat request is timed too (the first answer). tierserve's caches are
warm (the model pulled, its GGUF metadata converted once, the kernels built at install), as on any start after
the first; a cold run is reported once, after clearing the converted-metadata cache.

The breakdown runs the steps of a start one after another in a fresh interpreter (so imports are cold) and times
each: what the HTTP process and the engine process pay, whichever overlaps.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

PHASES_CODE = r"""
import json, sys, time
laps = {}
T = time.perf_counter()
def lap(name):
    global T
    now = time.perf_counter(); laps[name] = round(now - T, 3); T = now
from pathlib import Path
path = Path(sys.argv[1])
from tierserve.settings.config import load_settings
from tierserve.models.gguf import check_gguf
lap("import tierserve (settings, plugins, GGUF reader)")
check_gguf(path); lap("check the GGUF file (header, metadata, tensor directory)")
import torch; lap("import torch")
import transformers; lap("import transformers")
from tierserve.models.checkpoints import load_config, load_tokenizer
config = load_config(path); lap("config (converted-metadata cache)")
tokenizer = load_tokenizer(path); lap("tokenizer (converted-metadata cache)")
from tierserve.plugins.backends.gguf_weights import hf_name_map, load_gguf_state
hf_name_map(config, check_gguf(path).architecture); lap("GGUF -> Hugging Face tensor names")
state = load_gguf_state(path, config, torch.float32, "none"); lap("weights: read and dequantize to float32")
from tierserve.engine.builder import build_core
loaded = load_settings(None, environ={}, overrides={("model", "path"): str(path), ("model", "device"): "cpu"})
lap("settings")
core = build_core(loaded.settings, loaded.plugins); lap("engine build (backend, pool, store; weights again)")
print(json.dumps(laps))
"""


def wait_for(url: str, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return False


def first_answer(base: str, model: str) -> tuple[float, str]:
    started = time.perf_counter()
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
              "max_tokens": 16, "temperature": 0},
        timeout=120,
    ).json()  # fmt: skip
    return time.perf_counter() - started, reply["choices"][0]["message"]["content"]


def start_once(command: list[str], ready_url: str, base: str, model: str) -> dict:
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not wait_for(ready_url, started + 300):
            raise RuntimeError(f"{command[0]} was not ready within 300 s")
        ready = time.monotonic() - started
        answer_s, answer = first_answer(base, model)
        return {"ready_s": ready, "first_answer_s": ready + answer_s, "answer": answer}
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def phases(path: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", PHASES_CODE, str(path)], capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"the phase timing failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(ctx, repeats: int, threads: int, port: int = 8350) -> dict:
    from bench.llama_cpp import llama_server_binary
    from tierserve.models.gguf import is_gguf
    from tierserve.models.gguf_transformers import cache_dir_for

    path = ctx.checkpoint
    if not is_gguf(path):
        raise SystemExit("bench startup compares GGUF loading with llama-server: pass --model smollm2 or a .gguf file")
    tierserve = [sys.executable, "-m", "tierserve.cli", "serve", "--model", ctx.model, "--port", str(port)]
    llama = [str(llama_server_binary()), "-m", str(path), "--host", "127.0.0.1", "--port", str(port + 1), "-t",
             str(threads), "--no-webui"]  # fmt: skip
    systems = {
        "tierserve": (tierserve, f"http://127.0.0.1:{port}/health/ready", f"http://127.0.0.1:{port}"),
        "llama-server": (llama, f"http://127.0.0.1:{port + 1}/health", f"http://127.0.0.1:{port + 1}"),
    }
    shutil.rmtree(cache_dir_for(path), ignore_errors=True)  # one cold start: the GGUF metadata converted again
    cold = start_once(*systems["tierserve"], "smollm2")
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    with ctx.progress(repeats * len(systems), "startup") as bar:
        for _ in range(repeats):
            for name, (command, ready_url, base) in systems.items():
                runs[name].append(start_once(command, ready_url, base, "smollm2"))
                bar.update(1)
    summary = {
        name: {
            "ready_s": statistics.median(r["ready_s"] for r in rs),
            "first_answer_s": statistics.median(r["first_answer_s"] for r in rs),
            "answer": rs[-1]["answer"],
        }
        for name, rs in runs.items()
    }
    return {
        "config": {"model": ctx.model, "file": path.name, "repeats": repeats, "threads": threads},
        "cold": cold, "summary": summary, "runs": runs, "phases": phases(path),
    }  # fmt: skip
