"""tierserve's benchmark harness: ``python -m bench <scenario> [options]``.

Scenarios (each writes ``<results>/<scenario>.json``; ``report`` turns them
into ``report.md`` and PNG plots):

    throughput   N concurrent clients, P prompt + O output tokens, vs transformers serve and generate()
                 (and llama.cpp's llama-server at F32/BF16/Q8_0 with --systems llama-server,...)
    prefix       multi-turn chats on a shared long system prompt: cold / L1 / L2 / L3-after-restart
    cold-prefill TTFT of 512- and 2048-token prompts no cache holds, vs llama-server
    roofline     batch-1 decode tokens/s against the memory-bandwidth limit, per weight precision
    quality      int8 and bfloat16 weights against float32: greedy agreement and mean KL; for a GGUF file
                 (--model smollm2), perplexity per precision next to llama.cpp's llama-perplexity;
                 --api: that perplexity through a running server's echo + logprobs, next to in-process
    cache-store  put/get speed of the memory and disk tiers, zstd levels
    tier-stall   streams decoding while long prefixes load from L2, L3 or Redis (1 ms away), vs recomputing
    startup      serve to ready on a GGUF file (--model smollm2) vs llama-server, and where the time goes
    fleet        tierserve fleet on Ray: cache-aware vs default routing, prefill/decode disaggregation
    lora         one batch over 4 LoRA adapters vs the base model alone (output tokens/s)
    grammar      per-token mask cost of llguidance and xgrammar, 2k and 150k vocabularies
    responses    TTFT of turn 5: previous_response_id vs the history resent vs cold
    report       markdown table and plots from the JSON results
    all          every scenario, then the report

Every system loads the same checkpoint directory (``--model``, default
``builtin:bench``, written to disk on first use). Servers listen on loopback
ports and are stopped afterwards. The bench is not part of the tests.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"got {', '.join(unknown) or 'nothing'}; allowed: {', '.join(allowed)}")
        return names

    return parse


#: a scenario's checkpoint when --model is not given (builtin:bench otherwise)
SCENARIO_MODELS = {"fleet": "builtin:fleet"}


def build_parser() -> argparse.ArgumentParser:
    from bench import cold_prefill, prefix, roofline, throughput

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or builtin:NAME (default: builtin:bench; "
                        "fleet: builtin:fleet, small enough that 4 replicas share 2 cores)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help=f"results folder (default: {DEFAULT_RESULTS})")
    commands = parser.add_subparsers(dest="scenario", required=True)

    tp = commands.add_parser("throughput", help="output tokens/s, TTFT and TPOT at N concurrent clients")
    tp.add_argument("--concurrency", type=_ints, default=[1, 8, 32, 64], help="client counts (default: 1,8,32,64)")
    tp.add_argument("--prompt-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--repeats", type=int, default=3)
    tp.add_argument("--systems", type=_names(throughput.SYSTEMS), default=list(throughput.DEFAULT_SYSTEMS),
                    help=f"comma-separated, of {','.join(throughput.SYSTEMS)} "
                         f"(default: {','.join(throughput.DEFAULT_SYSTEMS)})")  # fmt: skip

    px = commands.add_parser("prefix", help="shared-prefix multi-turn chats, by cache state")
    px.add_argument("--conversations", type=int, default=8, help="concurrent conversations (default: 8)")
    px.add_argument("--turns", type=int, default=8, help="turns per conversation (default: 8; 64 requests)")
    px.add_argument("--prefix-len", type=int, default=2048)
    px.add_argument("--turn-len", type=int, default=32, help="tokens per user or assistant message (default: 32)")
    px.add_argument("--output-len", type=int, default=32)
    px.add_argument("--repeats", type=int, default=1)
    systems = (*prefix.OURS, *prefix.PEERS)
    defaults = ("tierserve", *prefix.DEFAULT_PEERS)
    px.add_argument("--systems", type=_names(systems), default=list(defaults),
                    help=f"comma-separated, of {','.join(systems)} (default: {','.join(defaults)})")  # fmt: skip
    px.add_argument("--states", type=_names(prefix.CACHE_STATES), default=list(prefix.CACHE_STATES),
                    help=f"tierserve's cache states to run, of {','.join(prefix.CACHE_STATES)} (default: all)")  # fmt: skip

    cp = commands.add_parser("cold-prefill", help="TTFT of long uncached prompts, one at a time (vs llama-server)")
    cp.add_argument("--prompt-lens", type=_ints, default=[512, 2048], help="prompt tokens (default: 512,2048)")
    cp.add_argument("--requests", type=int, default=3, help="requests per length and repeat (default: 3)")
    cp.add_argument("--repeats", type=int, default=3)
    cp.add_argument("--systems", type=_names(cold_prefill.SYSTEMS), default=list(cold_prefill.DEFAULT_SYSTEMS),
                    help=f"comma-separated, of {','.join(cold_prefill.SYSTEMS)} "
                         f"(default: {','.join(cold_prefill.DEFAULT_SYSTEMS)})")  # fmt: skip

    rf = commands.add_parser("roofline", help="batch-1 decode vs the memory-bandwidth limit")
    rf.add_argument("--prompt-len", type=int, default=32)
    rf.add_argument("--decode-tokens", type=int, default=128)
    rf.add_argument("--repeats", type=int, default=3)
    rf.add_argument("--systems", type=_names(tuple(roofline.PRECISIONS)), default=None,
                    help=f"comma-separated, of {','.join(roofline.PRECISIONS)} (default: tierserve-gguf for a GGUF "
                         "file, the others for a checkpoint directory)")  # fmt: skip

    ql = commands.add_parser("quality", help="int8 and bfloat16 weights against float32 (greedy agreement, KL); "
                             "a GGUF file's perplexity next to llama.cpp's")
    ql.add_argument("--model", default=argparse.SUPPRESS, help="as the global --model (e.g. smollm2)")
    ql.add_argument("--architectures", type=_names(("llama", "qwen2", "qwen3", "mistral")),
                    default=["llama", "qwen2", "qwen3", "mistral"],
                    help="tiny seeded checkpoints to measure besides --model (default: llama,qwen2,qwen3,mistral)")  # fmt: skip
    ql.add_argument("--api", action="store_true",
                    help="a GGUF file's perplexity through a running server's echo + logprobs, next to the same "
                         "figure computed in-process (bench/api_perplexity.py)")  # fmt: skip

    su = commands.add_parser("startup", help="serve to ready on a GGUF file vs llama-server, and where the time goes")
    su.add_argument("--model", default=argparse.SUPPRESS, help="as the global --model (e.g. smollm2)")
    su.add_argument("--repeats", type=int, default=3)
    su.add_argument("--threads", type=int, default=2, help="llama-server threads (default: 2)")

    cs = commands.add_parser("cache-store", help="memory and disk tier speed, compression per zstd level")
    cs.add_argument("--block-sizes", type=_ints, default=[16, 64], help="tokens per entry (default: 16,64)")
    cs.add_argument("--tokens", type=int, default=2048, help="prompt tokens whose KV is stored (default: 2048)")
    cs.add_argument("--levels", type=_ints, default=[1, 3, 6, 9, 19], help="zstd levels (default: 1,3,6,9,19)")

    from bench import tier_stall

    ts = commands.add_parser("tier-stall", help="streams decoding while prefixes load from L2/L3/Redis vs recomputing")
    ts.add_argument("--streams", type=int, default=8, help="streams decoding throughout (default: 8)")
    ts.add_argument("--stream-tokens", type=int, default=2000, help="max_tokens of each stream (default: 2000)")
    ts.add_argument("--arrivals", type=int, default=8, help="requests whose prefix sits in the tier (default: 8)")
    ts.add_argument("--prefix-len", type=int, default=2048)
    ts.add_argument("--suffix-len", type=int, default=32)
    ts.add_argument("--arrival-interval", type=float, default=0.25, help="seconds between arrivals (default: 0.25)")
    ts.add_argument("--baseline-seconds", type=float, default=4.0, help="the no-arrivals window (default: 4)")
    ts.add_argument("--redis-delay-ms", type=float, default=1.0, help="added to every Redis round trip (default: 1)")
    ts.add_argument("--repeats", type=int, default=3)
    ts.add_argument("--cases", type=_names(tier_stall.CASES), default=list(tier_stall.CASES),
                    help=f"comma-separated, of {','.join(tier_stall.CASES)} (default: all)")  # fmt: skip

    from bench import fleet as fleet_bench

    fl = commands.add_parser("fleet", help="tierserve fleet on Ray: cache-aware routing, disaggregation")
    fl.add_argument("--parts", type=_names(("routing", "disaggregation", "nodes")), default=["routing", "disaggregation", "nodes"],
                    help="routing, disaggregation, nodes: two Ray nodes, one lost mid-run (default: all three)")
    fl.add_argument("--replicas", type=int, default=4, help="engine replicas of the routing part (default: 4)")
    fl.add_argument("--conversations", type=int, default=64)
    fl.add_argument("--systems-prompts", type=int, default=32, help="tenants, each with its own system prompt (default: 32)")
    fl.add_argument("--turns", type=int, default=4)
    fl.add_argument("--prefix-len", type=int, default=1024)
    fl.add_argument("--turn-len", type=int, default=32)
    fl.add_argument("--output-len", type=int, default=8)
    fl.add_argument("--arrival-rate", type=float, default=2.0, help="conversations starting per second, Poisson (default: 2)")
    fl.add_argument("--l1-prefixes", type=float, default=0.25,
                    help="the fraction of the system prompts one replica's L1 holds (default: 0.25)")
    fl.add_argument("--routings", type=_names(fleet_bench.ROUTINGS), default=list(fleet_bench.ROUTINGS),
                    help=f"routing part: comma-separated, of {','.join(fleet_bench.ROUTINGS)} (default: all)")
    fl.add_argument("--tiers", type=_names(("none", "redis")), default=["none", "redis"],
                    help="below L1: none, and/or a write-through redis tier every replica shares (default: both)")
    fl.add_argument("--decoders", type=int, default=4, help="streams decoding during the long prompts (default: 4)")
    fl.add_argument("--decode-len", type=int, default=192)
    fl.add_argument("--long-prompts", type=int, default=6)
    fl.add_argument("--long-len", type=int, default=1536)
    fl.add_argument("--repeats", type=int, default=2)
    fl.add_argument("--node-clients", type=int, default=4, help="nodes: clients sending requests (default: 4)")
    fl.add_argument("--node-seconds", type=float, default=30.0, help="nodes: how long they send (default: 30)")
    fl.add_argument("--kill-at", type=float, default=10.0, help="nodes: when the worker node is killed (default: 10 s)")

    lr = commands.add_parser("lora", help="a batch mixing LoRA adapters vs the base model alone")
    lr.add_argument("--requests", type=int, default=32)
    lr.add_argument("--prompt-len", type=int, default=128)
    lr.add_argument("--output-len", type=int, default=64)
    lr.add_argument("--adapters", type=int, default=4)
    lr.add_argument("--rank", type=int, default=16)
    lr.add_argument("--repeats", type=int, default=3)

    gr = commands.add_parser("grammar", help="constrained decoding: mask cost per token, llguidance vs xgrammar")
    gr.add_argument("--steps", type=int, default=120)

    rs = commands.add_parser("responses", help="Responses API: turn-5 TTFT with previous_response_id")
    rs.add_argument("--turns", type=int, default=5)
    rs.add_argument("--turn-len", type=int, default=200, help="words of new user text per turn (default: 200)")
    rs.add_argument("--output-len", type=int, default=32)
    rs.add_argument("--repeats", type=int, default=3)

    commands.add_parser("report", help="write report.md and the plots from the results folder")
    commands.add_parser("all", help="every scenario with its defaults, then the report")
    return parser


def run_scenario(name: str, args: argparse.Namespace) -> None:
    from bench import cache_store, cold_prefill, prefix, quality, report, roofline, throughput
    from bench import fleet as fleet_bench
    from bench.harness import BenchContext

    if name == "report":
        written = report.write(args.results)
        print(f"wrote {', '.join(str(p) for p in written)}")
        return
    ctx = BenchContext.create(args.model or SCENARIO_MODELS.get(name, "builtin:bench"), args.results)
    if name == "throughput":
        payload = throughput.run(ctx, args.concurrency, args.prompt_len, args.output_len, args.repeats, args.systems)
    elif name == "prefix":
        payload = prefix.run(
            ctx, args.conversations, args.turns, args.prefix_len, args.turn_len, args.output_len, args.repeats, args.systems,
            args.states,
        )
    elif name == "cold-prefill":
        payload = cold_prefill.run(ctx, args.prompt_lens, args.requests, args.repeats, args.systems)
    elif name == "roofline":
        payload = roofline.run(ctx, args.prompt_len, args.decode_tokens, args.repeats, args.systems)
    elif name == "quality" and args.api:
        from bench import api_perplexity

        payload = api_perplexity.run(ctx)
        name = "perplexity-api"
    elif name == "quality":
        payload = quality.run(ctx, args.architectures)
    elif name == "fleet":
        payload = fleet_bench.run(ctx, args)
    elif name == "lora":
        from bench import lora

        payload = lora.run(ctx, args.requests, args.prompt_len, args.output_len, args.adapters, args.rank, args.repeats)
    elif name == "grammar":
        from bench import grammar

        payload = grammar.run(ctx, args.steps)
    elif name == "responses":
        from bench import responses

        payload = responses.run(ctx, args.turns, args.turn_len, args.output_len, args.repeats)
    elif name == "startup":
        from bench import startup

        payload = startup.run(ctx, args.repeats, args.threads)
    elif name == "tier-stall":
        from bench import tier_stall

        payload = tier_stall.run(
            ctx, args.streams, args.stream_tokens, args.arrivals, args.prefix_len, args.suffix_len,
            args.arrival_interval, args.baseline_seconds, args.redis_delay_ms, args.repeats, args.cases,
        )  # fmt: skip
    elif name == "cache-store":
        payload = cache_store.run(ctx, args.block_sizes, args.tokens, args.levels)
    else:
        raise ValueError(name)
    if "perplexity" in payload:  # quality on a GGUF file: its own results file, beside the precision closeness
        name = "perplexity"
    path = ctx.save(name, payload)
    print(report.section(name, payload))
    print(f"\nsaved {path}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.scenario == "all":
        given = list(sys.argv[1:] if argv is None else argv)
        global_options = given[: given.index("all")]
        for name in ("roofline", "cache-store", "throughput", "prefix"):
            run_scenario(name, parser.parse_args([*global_options, name]))
        run_scenario("report", args)
        return 0
    run_scenario(args.scenario, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
