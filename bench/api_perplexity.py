"""``python -m bench quality --api``: perplexity through a running server's ``echo`` + ``logprobs``, next to the
same figure computed in-process on the same weights.

This is how an evaluation harness scores a served model: each ``n_ctx``-token chunk of the text (as
``bench.perplexity`` cuts it, the way llama.cpp's ``llama-perplexity`` does) goes to ``/v1/completions`` as token
ids with ``echo: true, logprobs: 1, max_tokens: 0``, and the negative log-likelihood of every token in the
chunk's second half is read from ``token_logprobs``. Two in-process figures stand beside it, per precision:

- an engine built in this process with the server's preset and settings (``prompt_logprobs`` on
  ``EngineClient.generate``): the same computation, so the API must return exactly its numbers;
- the whole-sequence model (``bench perplexity``'s figure: each chunk in one unpaged forward pass). In float32
  it agrees with the engine to float rounding; with the file's 4-bit blocks kept, activations are rounded to
  Q8_0 blocks before every matrix product (as llama.cpp does), and the paged and unpaged attention's last-bit
  differences change some of those roundings, so per-token figures differ by more while the perplexity stays
  close.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.perplexity import N_CTX, TEXT, chunks, load_native, nll_of_chunks, ppl
from bench.servers import start_tierserve

# the precisions compared: tierserve's --set assignments for the server and the in-process engine
PRECISIONS = {
    "as stored (model.quantization = gguf)": ["model.dtype=float32", "model.quantization=gguf"],
    "float32 (dequantized)": ["model.dtype=float32", "model.quantization=none"],
}


def api_nll(base_url: str, model: str, windows: list[list[int]]) -> list[float]:
    """Negative log-likelihoods of the second half of each window, read from the server's prompt logprobs."""
    first = N_CTX // 2
    out: list[float] = []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for window in windows:
            body = {"model": model, "prompt": window, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
            answer = client.post("/v1/completions", json=body)
            answer.raise_for_status()
            logprobs = answer.json()["choices"][0]["logprobs"]["token_logprobs"]
            if len(logprobs) != len(window) or logprobs[0] is not None:
                raise RuntimeError(f"expected {len(window)} prompt logprobs, the first null; got {len(logprobs)}")
            out.extend(-value for value in logprobs[first + 1 :])
    return out


def engine_nll(path: Path, settings: list[str], l3: Path, windows: list[list[int]]) -> list[float]:
    """The same, from an engine built in this process with the server's preset and settings."""
    from tierserve.core.sampling_params import SamplingParams
    from tierserve.engine import EngineClient
    from tierserve.settings.config import load_settings

    overrides = {("model", "path"): str(path), ("kv_cache", "disk_path"): str(l3), ("server", "engine_process"): False}
    for assignment in settings:
        dotted, value = assignment.split("=", 1)
        section, key = dotted.rsplit(".", 1)
        overrides[(section, key)] = value
    loaded = load_settings("production", environ={}, overrides=overrides)
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
    try:
        done = engine.generate(windows, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0))
    finally:
        engine.close()
    first = N_CTX // 2
    out: list[float] = []
    for result in done:
        scored = [item.logprob for item in result.prompt_logprobs if item is not None]  # positions 1 .. len - 1
        out.extend(-value for value in scored[first:])
    return out


def figures(nll: list[float], seconds: float) -> dict:
    value, error = ppl(nll)
    return {"ppl": value, "stderr": error, "scored_tokens": len(nll), "seconds": seconds}


def run(ctx) -> dict:
    """Per precision: the perplexity through the API, from an in-process engine, and from the whole-sequence
    model (``bench perplexity``'s figure), with the largest per-token differences from the API's."""
    from tierserve.models.gguf import is_gguf
    from tierserve.models.gguf_reader import GGUFFile

    path = ctx.checkpoint
    if not is_gguf(path):
        raise SystemExit("quality --api needs a GGUF file (--model smollm2 or a .gguf path)")
    metadata = GGUFFile(path)
    add_bos = bool(metadata.value("tokenizer.ggml.add_bos_token", False))
    bos = metadata.value("tokenizer.ggml.bos_token_id") if add_bos else None
    metadata.close()
    ids = ctx.tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    windows = chunks(ids, N_CTX, bos)
    rows = []
    for precision, settings in PRECISIONS.items():
        options = {"dtype": torch.float32, "quantization": settings[1].split("=")[1]}
        with tempfile.TemporaryDirectory(prefix="tierserve-api-ppl-") as scratch:
            started = time.perf_counter()
            whole = nll_of_chunks(load_native(path, **options), windows)
            whole_seconds = time.perf_counter() - started
            started = time.perf_counter()
            engine = engine_nll(path, settings, Path(scratch) / "engine-l3", windows)
            engine_seconds = time.perf_counter() - started
            server = start_tierserve(path, Path(scratch), Path(scratch) / "l3", settings=settings)
            try:
                started = time.perf_counter()
                through_api = api_nll(server.base_url, server.model, windows)
                api_seconds = time.perf_counter() - started
            finally:
                server.stop()
        rows.append({
            "precision": precision, "settings": settings,
            "api": figures(through_api, api_seconds),
            "engine": figures(engine, engine_seconds),
            "whole_sequence": figures(whole, whole_seconds),
            "max_difference_engine": max(abs(a - b) for a, b in zip(engine, through_api)),
            "max_difference_whole_sequence": max(abs(a - b) for a, b in zip(whole, through_api)),
        })  # fmt: skip
    return {
        "config": {"model": ctx.model, "file": path.name},
        "perplexity_api": {"text": TEXT.name, "tokens": len(ids), "n_ctx": N_CTX, "chunks": len(windows), "rows": rows},
    }
