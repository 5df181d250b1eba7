"""Scenario ``roofline``: batch-1 decode speed against this machine's memory-bandwidth limit.

A decode step of one sequence reads every weight once, so its speed is bounded by

    limit (tokens/s) = memory bandwidth / weight bytes read per token

- weight bytes per token: every parameter but the input embedding table
  (a step reads one row of it); a tied output head is counted once, as the head;
- bandwidth: a STREAM-style copy of a buffer far larger than the caches,
  counted as bytes read + bytes written, best of several trials (as STREAM
  reports), with this process's torch threads.

Each weight precision has its own limit: ``tierserve`` reads float32 weights,
``tierserve-bf16`` two bytes per weight, ``tierserve-int8`` one (plus a float32
scale per output row). A GGUF file (``--model FILE.gguf``) runs as ``tierserve-gguf``
(``model.quantization = "gguf"``): the bytes a step reads are the tensors as tierserve
holds them (``server.model_memory``'s per-type sizes: the file's blocks, Q4_K and Q6_K
repacked a little larger), every tensor but the input embedding table (a tied table
counted once, as the head); Hugging Face ``generate()`` is not run on a GGUF file.

Decode tokens/s is measured in-process for the tierserve engine (the same
engine the server runs) and for Hugging Face ``generate()``: the time of a
1 + D token generation minus that of a 1 token generation on the same
prompt, over D, median of the repeats.
"""

from __future__ import annotations

import statistics
import time

import torch
from safetensors import safe_open

from bench.harness import BenchContext
from bench.hf_reference import HFGenerate


def copy_bandwidth(megabytes: int = 512, trials: int = 10) -> float:
    """Bytes per second moved by ``dst.copy_(src)`` (read + write), best of ``trials``."""
    src = torch.ones(megabytes * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes_per_token(ctx: BenchContext) -> tuple[int, int]:
    """(bytes read per decode step, total parameter bytes) from the checkpoint's safetensors."""
    total = embedding = 0
    tied = True
    for path in sorted(ctx.checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                shape = tensor.get_shape()
                size = torch.empty((), dtype=_DTYPES[tensor.get_dtype()]).element_size()
                for dim in shape:
                    size *= dim
                total += size
                if name.endswith("embed_tokens.weight"):
                    embedding = size
                if name == "lm_head.weight":
                    tied = False
    # untied: the embedding table is not read by a step; tied: it is read once, as the output head
    return (total - embedding if not tied else total), total


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def gguf_bytes_per_token(path) -> tuple[int, int]:
    """(bytes a decode step reads, the file's tensor bytes) for a GGUF file run with ``model.quantization =
    "gguf"``: each tensor at the size tierserve holds it in, the embedding table only when tied (as the head)."""
    from tierserve.models.gguf import check_gguf
    from tierserve.server.model_memory import gguf_held_bytes

    tensors = check_gguf(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    read = sum(gguf_held_bytes(t) for t in tensors if tied or t.name != "token_embd.weight")
    return int(read), sum(t.n_bytes for t in tensors)


def _decode_rate(generate, prompt: list[int], decode_tokens: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(prompt, 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        generate(prompt, 1 + decode_tokens)
        full = time.perf_counter() - start
        rates.append(decode_tokens / max(full - first, 1e-9))
    return statistics.median(rates)


PRECISIONS = {
    "tierserve-gguf": ({("model", "quantization"): "gguf"}, None),  # a GGUF file's blocks as stored
    "tierserve": ({}, None),
    "tierserve-bf16": ({("model", "dtype"): "bfloat16"}, 2),
    "tierserve-int8": ({("model", "quantization"): "int8"}, 1),
}


def run(ctx: BenchContext, prompt_len: int, decode_tokens: int, repeats: int, systems: list[str] | None = None) -> dict:
    from tierserve.settings.config import load_settings
    from tierserve.engine import EngineClient
    from tierserve.core.sampling_params import SamplingParams

    from tierserve.models.gguf import is_gguf

    gguf = is_gguf(ctx.checkpoint)
    if systems and gguf != (systems == ["tierserve-gguf"]):
        raise ValueError(f"--systems {','.join(systems)}: a GGUF file runs as tierserve-gguf alone, a checkpoint "
                         f"directory as the others ({', '.join(p for p in PRECISIONS if p != 'tierserve-gguf')})")
    systems = ["tierserve-gguf"] if gguf else (systems or [p for p in PRECISIONS if p != "tierserve-gguf"])
    bandwidth = copy_bandwidth()
    step_bytes, total_bytes = gguf_bytes_per_token(ctx.checkpoint) if gguf else weight_bytes_per_token(ctx)
    parameters = step_bytes // 4  # the bench checkpoints are float32 on disk
    bytes_by_system = {} if gguf else {"hf-generate": step_bytes}
    for name in systems:
        width = PRECISIONS[name][1]
        bytes_by_system[name] = step_bytes if width is None else parameters * width
    prompt = list(ctx.tokenizer("the " * prompt_len)["input_ids"])[:prompt_len]
    results: dict[str, float] = {}
    with ctx.progress(len(systems) + 1, "roofline") as bar:
        for name in systems:
            overrides = {
                ("model", "path"): str(ctx.checkpoint),
                # every call prefills its prompt anew: nothing may come from a cache
                ("kv_cache", "enable_prefix_caching"): False,
                ("kv_cache", "l1_capacity"): 512,
                ("logging", "level"): "warning",
                **PRECISIONS[name][0],
            }
            loaded = load_settings("production", environ={}, overrides=overrides)
            engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
            try:
                def ours(ids: list[int], n: int) -> None:
                    engine.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

                ours(prompt, 4)
                results[name] = _decode_rate(ours, prompt, decode_tokens, repeats)
            finally:
                engine.close()
            bar.update(1)
        if not gguf:
            reference = HFGenerate(ctx.checkpoint)
            reference.warm_up()
            results["hf-generate"] = _decode_rate(
                lambda ids, n: reference.generate(torch.tensor([ids]), n), prompt, decode_tokens, repeats
            )
        bar.update(1)
    return {
        "config": {"model": ctx.model, "prompt_len": prompt_len, "decode_tokens": decode_tokens, "repeats": repeats},
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_per_token": step_bytes,
        "parameter_bytes": total_bytes,
        "limit_tok_s": bandwidth / step_bytes,
        "weight_bytes_by_system": bytes_by_system,
        "limit_tok_s_by_system": {name: bandwidth / size for name, size in bytes_by_system.items()},
        "decode_tok_s": results,
        "fraction_of_limit": {name: rate * bytes_by_system[name] / bandwidth for name, rate in results.items()},
    }
