"""Decoding speed with and without n-gram speculation (prompt lookup), on the same requests in one run.

    python -m bench.speculation [--model builtin:bench] [--output-len 256] [--requests 1]

Workload (chosen to be the case prompt lookup is for, and said so): the
model first continues a seed text greedily; the prompt is then the seed plus
that earlier output, and the model continues again. A model that repeats
itself (random-weight models fall into greedy loops quickly) finds its next
tokens earlier in the context, as real models do when they quote a document
or edit code. Both runs are greedy with eos ignored; their outputs must be
identical, and the table reports output tokens/s, the ratio, and the
acceptance rate of the drafts.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tierserve.core.config import load_settings
from tierserve.core.engine import EngineClient
from tierserve.core.sampling_params import SamplingParams

SEED = "The report lists the steps of the procedure in order. First, "


def engine_for(model: str, method: str | None) -> EngineClient:
    overrides = {("model", "path"): model, ("logging", "level"): "warning", ("kv_cache", "l1_capacity"): 2048}
    if method:
        overrides[("speculative", "method")] = method
    loaded = load_settings("development", environ={}, overrides=overrides)
    return EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)


def timed(engine: EngineClient, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    engine.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - start, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:bench")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    plain = engine_for(args.model, None)
    seed = plain.encode_prompt(SEED)
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    [earlier] = plain.generate([seed], greedy)
    prompts = [seed + earlier.token_ids + seed[: 4 + i] for i in range(args.requests)]
    speculative = engine_for(args.model, "ngram")
    speculative.settings.speculative.num_speculative_tokens = args.k

    # alternate the two, so a noisy neighbour on a shared machine hits both alike; report medians
    base_times, spec_times = [], []
    for _ in range(args.repeats):
        seconds, base_tokens = timed(plain, prompts, greedy)
        base_times.append(seconds)
        seconds, spec_tokens = timed(speculative, prompts, greedy)
        spec_times.append(seconds)
        assert spec_tokens == base_tokens, "speculation changed the greedy output"
    base_seconds, spec_seconds = statistics.median(base_times), statistics.median(spec_times)
    stats = speculative.cache_stats()["speculation"]
    plain.close()
    speculative.close()

    produced = args.requests * args.output_len
    base_rate, spec_rate = produced / base_seconds, produced / spec_seconds
    print(f"model {args.model}; {args.requests} request(s), prompt {len(prompts[0])} tokens "
          f"(seed + the model's own earlier {args.output_len}-token output), {args.output_len} new tokens, greedy\n")
    print("| decoding | output tokens/s | speed-up | acceptance rate | mean accepted per step |")
    print("|---|---:|---:|---:|---:|")
    print(f"| plain | {base_rate:.1f} | 1.00 | - | - |")
    print(f"| ngram, k={args.k} | {spec_rate:.1f} | {spec_rate / base_rate:.2f} | "
          f"{stats['acceptance_rate']:.3f} | {stats['mean_accepted_length']:.2f} |")
    print(f"\noutputs identical in all {args.repeats} repeats; medians of {args.repeats} alternating runs")


if __name__ == "__main__":
    main()
