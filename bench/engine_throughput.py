"""Engine throughput vs Hugging Face ``generate()``, in one process, on the same checkpoint.

    python -m bench.engine_throughput [--requests 32] [--prompt-len 128] [--output-len 128]
                                      [--model builtin:bench] [--sequential-requests 4]

Workload: N requests of ``prompt-len`` random token ids, greedy, exactly
``output-len`` new tokens each (eos ignored). Three runs, each after a short
warm-up:

- tierserve: all N submitted at once to the engine (continuous batching);
- HF static batch: one ``generate()`` call on the N prompts as a batch;
- HF one at a time: ``generate()`` per request, sequentially. It is slow, so
  by default only ``--sequential-requests`` of them run; its tokens/s is a
  rate and does not depend on how many run.

Prints output tokens/s for each and the ratios to tierserve.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import AutoModelForCausalLM

from tierserve.models.checkpoints import resolve_model_path
from tierserve.settings.config import load_settings
from tierserve.engine import EngineClient
from tierserve.core.sampling_params import SamplingParams


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(count)]


def run_tierserve(model: str, prompts: list[list[int]], output_len: int) -> float:
    overrides = {
        ("model", "path"): model,
        ("scheduler", "max_num_seqs"): max(64, len(prompts)),
        ("scheduler", "max_num_batched_tokens"): 2048,
        ("kv_cache", "l1_capacity"): 2 * len(prompts) * -(-(len(prompts[0]) + output_len) // 16),
        ("logging", "level"): "warning",
    }
    loaded = load_settings("development", environ={}, overrides=overrides)
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == output_len for r in results)
    return len(prompts) * output_len / elapsed


def hf_generate(model, batch: torch.Tensor, output_len: int) -> torch.Tensor:
    return model.generate(
        batch,
        attention_mask=torch.ones_like(batch),
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        pad_token_id=0,
    )


def run_hf(model_path, prompts: list[list[int]], output_len: int, sequential: int) -> tuple[float, float]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    batch = torch.tensor(prompts)
    with torch.inference_mode():
        hf_generate(model, batch[:2, :8], 4)
        start = time.perf_counter()
        out = hf_generate(model, batch, output_len)
        static = out[:, batch.shape[1] :].numel() / (time.perf_counter() - start)
        start = time.perf_counter()
        produced = 0
        for row in batch[:sequential]:
            produced += hf_generate(model, row[None], output_len).shape[1] - batch.shape[1]
        one_at_a_time = produced / (time.perf_counter() - start)
    return static, one_at_a_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:bench")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--sequential-requests", type=int, default=4)
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    prompts = make_prompts(args.requests, args.prompt_len, vocab)
    print(f"model {args.model} ({path}), torch threads {torch.get_num_threads()}")
    print(f"{args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, greedy\n")
    ours = run_tierserve(args.model, prompts, args.output_len)
    static, single = run_hf(path, prompts, args.output_len, min(args.sequential_requests, args.requests))
    print("| run | output tokens/s | tierserve / run |")
    print("|---|---:|---:|")
    print(f"| tierserve engine (continuous batching) | {ours:.1f} | 1.00 |")
    print(f"| HF generate, static batch of {args.requests} | {static:.1f} | {ours / static:.2f} |")
    print(f"| HF generate, one request at a time | {single:.1f} | {ours / single:.2f} |")


if __name__ == "__main__":
    main()
