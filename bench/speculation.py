"""Decoding speed with and without speculation, linear and tree, on the same requests in one run.

    python -m bench.speculation [--model builtin:bench] [--output-len 256] [--concurrency 1,8] [--k 4]
                                [--tree-nodes 4,16] [--repeats 3] [--results bench/results]

Workload (chosen to be the case prompt lookup is for, and said so): the
model first continues a seed text greedily; each prompt is then the seed plus
that earlier output (and a few seed tokens, so concurrent prompts differ),
and the model continues again. A model that repeats itself (random-weight
models fall into greedy loops quickly) finds its next tokens earlier in the
context, as real models do when they quote a document or edit code; where the
earlier text branches (the same n-gram followed by different tokens), a
linear draft follows one continuation and a tree verifies several.

Strategies: plain decoding; ``ngram`` (linear prompt lookup) at each ``--k``
drafts per step (the first, 4, is the baseline the speed-ups are against);
``ngram_tree`` at each ``--tree-nodes`` budget per sequence (4 and 16: the
same number of tokens verified per step as linear k=4 and k=16), cut to its
share of ``--step-tree-nodes`` when several requests run (the engine's
default 64: 8 nodes each at 8 requests). Every
run is greedy with eos ignored, and every strategy's output must equal plain
decoding's. Runs alternate between strategies, ``--repeats`` times each;
medians are reported, with output tokens/s, the speed-up over plain and over
linear ngram, tokens accepted per verification (``mean_accepted_length``)
and tree nodes per verification.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tierserve.settings.config import load_settings
from tierserve.engine import EngineClient
from tierserve.core.sampling_params import SamplingParams

SEED = "The report lists the steps of the procedure in order. First, "
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def engine_for(model: str, method: str | None, **speculative) -> EngineClient:
    overrides = {("model", "path"): model, ("logging", "level"): "warning", ("kv_cache", "l1_capacity"): 4096,
                 ("scheduler", "max_num_seqs"): 64}  # fmt: skip
    if method:
        overrides[("speculative", "method")] = method
    for key, value in speculative.items():
        overrides[("speculative", key)] = value
    loaded = load_settings("development", environ={}, overrides=overrides)
    return EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)


def timed(engine: EngineClient, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    engine.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - start, [r.token_ids for r in results]


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:bench")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", type=_ints, default=[1, 8], help="concurrent requests (default: 1,8)")
    parser.add_argument("--k", type=_ints, default=[4, 16],
                        help="linear ngram drafts per step; the first is the baseline (default: 4,16)")
    parser.add_argument("--tree-nodes", type=_ints, default=[4, 16], help="ngram_tree node budgets (default: 4,16)")
    parser.add_argument("--step-tree-nodes", type=int, default=64,
                        help="[speculative] step_tree_nodes: tree nodes per step, shared by the batch (default: 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    args = parser.parse_args()

    strategies: dict[str, EngineClient] = {"plain": engine_for(args.model, None)}
    for k in args.k:
        strategies[f"ngram k={k}"] = engine_for(args.model, "ngram", num_speculative_tokens=k, adaptive=False)
    for nodes in args.tree_nodes:
        # each sequence gets min(nodes, step_tree_nodes // sequences): at 8 requests the default 64 leaves 8
        strategies[f"ngram_tree nodes={nodes}"] = engine_for(
            args.model, "ngram_tree", max_tree_nodes=nodes, step_tree_nodes=args.step_tree_nodes
        )
    plain = strategies["plain"]
    seed = plain.encode_prompt(SEED)
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    [earlier] = plain.generate([seed], greedy)

    rows = []
    for clients in args.concurrency:
        prompts = [seed + earlier.token_ids + seed[: 4 + i] for i in range(clients)]
        times: dict[str, list[float]] = {name: [] for name in strategies}
        before = {name: e.stats().speculation.as_dict() for name, e in strategies.items()}
        reference = None
        # alternate the strategies, so a noisy neighbour on a shared machine hits all alike; report medians
        for _ in range(args.repeats):
            for name, engine in strategies.items():
                seconds, tokens = timed(engine, prompts, greedy)
                times[name].append(seconds)
                reference = reference or tokens
                assert tokens == reference, f"{name} changed the greedy output"
        produced = clients * args.output_len
        base = produced / statistics.median(times["plain"])
        linear = produced / statistics.median(times[f"ngram k={args.k[0]}"])
        for name, engine in strategies.items():
            after, earlier_stats = engine.stats().speculation.as_dict(), before[name]
            checks = after["verifications"] - earlier_stats["verifications"]
            accepted = (after["accepted"] - earlier_stats["accepted"]) / checks if checks else None
            trees = after["tree_verifications"] - earlier_stats["tree_verifications"]
            rate = produced / statistics.median(times[name])
            rows.append({
                "concurrency": clients, "strategy": name, "output_tok_s": round(rate, 1),
                "vs_plain": round(rate / base, 3), "vs_linear_ngram": round(rate / linear, 3),
                "accepted_per_verification": round(accepted, 3) if accepted is not None else None,
                "tree_nodes_per_verification": round(after["tree_nodes_per_step"], 2) if trees else None,
                "seconds": [round(t, 3) for t in times[name]],
            })  # fmt: skip
    for engine in strategies.values():
        engine.close()

    print(f"model {args.model}; prompt {len(seed) + len(earlier.token_ids) + 4}+ tokens (seed + the model's own "
          f"earlier {args.output_len}-token output), {args.output_len} new tokens per request, greedy\n")  # fmt: skip
    print("| requests | decoding | output tokens/s | vs plain | vs linear ngram | accepted / verification | tree nodes / verification |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        accepted = "-" if r["accepted_per_verification"] is None else f"{r['accepted_per_verification']:.2f}"
        nodes = "-" if r["tree_nodes_per_verification"] is None else f"{r['tree_nodes_per_verification']:.1f}"
        print(f"| {r['concurrency']} | {r['strategy']} | {r['output_tok_s']:.1f} | {r['vs_plain']:.2f} | "
              f"{r['vs_linear_ngram']:.2f} | {accepted} | {nodes} |")  # fmt: skip
    print(f"\noutputs identical in all {args.repeats} repeats; medians of {args.repeats} alternating runs")
    from bench.harness import machine

    args.results.mkdir(parents=True, exist_ok=True)
    payload = {"scenario": "speculation", "machine": machine(), "command": "python -m bench.speculation " + " ".join(sys.argv[1:]),
               "config": {"output_len": args.output_len, "k": args.k, "tree_nodes": args.tree_nodes,
                          "step_tree_nodes": args.step_tree_nodes,
                          "repeats": args.repeats, "model": args.model}, "runs": rows}  # fmt: skip
    (args.results / "speculation.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
