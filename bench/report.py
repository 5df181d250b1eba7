"""The report: ``report.md`` and PNG plots from the scenarios' JSON results.

    python -m bench report [--results bench/results]

Every figure is a median over the repeats of a scenario; ratios compare
systems measured in the same invocation. Targets from the benchmark issue are
checked and printed as met or missed, never hidden.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from bench.stats import median, ratio

SCENARIOS = ("throughput", "prefix", "cold-prefill", "roofline", "cache-store", "tier-stall", "fleet", "perplexity",
             "perplexity-api", "startup")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}" if seconds >= 0.1 else f"{seconds * 1000:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "**missed**"


# ---- throughput -------------------------------------------------------------------------


def throughput_medians(payload: dict) -> dict[tuple[str, int], dict]:
    """(system, clients) -> median of every metric over the repeats."""
    grouped: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for run in payload["runs"]:
        grouped[(run["system"], run["concurrency"])].append(run)
    metrics = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "rss_load_bytes", "rss_peak_bytes")
    out = {}
    for key, runs in grouped.items():
        out[key] = {m: median([r.get(m) for r in runs]) for m in metrics}
        out[key]["runs"] = len(runs)
        out[key]["errors"] = sum(r.get("errors", 0) for r in runs)
        out[key]["short_outputs"] = sum(r.get("short_outputs", 0) for r in runs)
    return out


# each precision against llama.cpp's own at that precision (int8 weights against Q8_0); llama-server keeps
# an F16 KV cache at every precision, so the float32 and int8 weights also run with bfloat16 KV
PRECISION_PAIRS = {
    "llama-server": ("tierserve", "tierserve-kvbf16", "tierserve-gguf"),  # -gguf: a GGUF file served as stored
    "llama-server-bf16": ("tierserve-bf16",),
    "llama-server-q8_0": ("tierserve-int8", "tierserve-int8-kvbf16"),
}


def _ours_for(system: str, n: int, present) -> tuple[str, int]:
    """The tierserve row ``system`` is compared with at ``n``: the first of its precision's peers that ran,
    else tierserve."""
    paired = [ours for ours in PRECISION_PAIRS.get(system, ()) if (ours, n) in present]
    return (paired[0] if paired else "tierserve", n)


def _mb(size: float | None) -> str:
    return "-" if not size else f"{size / 1e6:.0f}"


def throughput_section(payload: dict) -> str:
    config = payload["config"]
    table = throughput_medians(payload)
    systems = config["systems"]
    lines = [
        f"{config['prompt_len']} prompt + {config['output_len']} output tokens per request, greedy, eos ignored; "
        f"medians of {config['repeats']} repeats. `hf-generate` is one static `generate()` batch of N in the "
        "bench process (N = 1: one request at a time); its TTFT is a 1-token `generate()` of the same batch.",
        "",
        "| clients | system | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) "
        "| RSS loaded / peak (MB) | tierserve / system |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in config["concurrency"]:
        for system in systems:
            # llama-server at BF16 / Q8_0 is compared with tierserve at the same precision when it ran
            ours = table.get(_ours_for(system, n, table), {}).get("output_tok_s")
            row = table.get((system, n))
            if row is None:
                continue
            note = ""
            if row["errors"] or row["short_outputs"]:
                note = f" ({row['errors']} errors, {row['short_outputs']} short)"
            lines.append(
                f"| {n} | {system}{note} | {_num(row['output_tok_s'])} | {_ms(row['ttft_p50_s'])} | {_ms(row['ttft_p99_s'])} "
                f"| {_ms(row['tpot_p50_s'])} | {_ms(row['tpot_p99_s'])} | {_mb(row['rss_load_bytes'])} / "
                f"{_mb(row['rss_peak_bytes'])} | {_x(ratio(ours, row['output_tok_s']))} |"
            )
    lines += ["", "Targets:", ""]

    def speedup(n: int, ours: str, peer: str) -> float | None:
        return ratio(table.get((ours, n), {}).get("output_tok_s"), table.get((peer, n), {}).get("output_tok_s"))

    llama = [(n, ours, p, t) for p, pairs in PRECISION_PAIRS.items() for ours in pairs for n, t in ((32, 1.2), (1, 0.8))]
    peers = [(32, "tierserve", "transformers-serve-cb", 3.0), (32, "tierserve", "hf-generate", 0.9),
             (1, "tierserve", "hf-generate", 0.9), *llama]  # fmt: skip
    for n, ours, peer, target in peers:
        if (ours, n) in table and (peer, n) in table:
            value = speedup(n, ours, peer)
            lines.append(f"- {n} clients, {ours} / {peer} >= {target}: {_x(value)}, {_verdict(value, target)}")
    placements = [
        (n, ratio(table[("tierserve-process", n)]["output_tok_s"], table[("tierserve-inproc", n)]["output_tok_s"]))
        for n in config["concurrency"]
        if ("tierserve-process", n) in table and ("tierserve-inproc", n) in table
    ]
    if placements:
        lines += ["", "Engine core placement (output tok/s, engine in a child process / on a thread of the server):", ""]
        lines += [f"- {n} clients: {_x(value)}" for n, value in placements]
    return "\n".join(lines)


# ---- prefix ----------------------------------------------------------------------------


def prefix_medians(payload: dict) -> dict[tuple[str, str], dict]:
    grouped: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for run in payload["runs"]:
        grouped[(run["system"], run["cache"])].append(run)
    metrics = ("ttft_p50_s", "ttft_p99_s", "first_turn_ttft_s", "output_tok_s", "cached_tokens", "prompt_tokens")
    out = {}
    for key, runs in grouped.items():
        out[key] = {m: median([r.get(m) for r in runs]) for m in metrics}
        out[key]["errors"] = sum(r.get("errors", 0) for r in runs)
    return out


def prefix_section(payload: dict) -> str:
    config = payload["config"]
    table = prefix_medians(payload)
    requests = config["conversations"] * config["turns"]
    cold = table.get(("tierserve", "cold"), {})
    lines = [
        f"{config['conversations']} concurrent conversations x {config['turns']} turns = {requests} requests; "
        f"a {config['prefix_len']}-token shared system prompt, {config['turn_len']}-token messages, "
        f"{config['output_len']} output tokens, greedy; medians of {config['repeats']} repeat(s). "
        "First-turn TTFT: median over the first turns, which read the system prompt from the tier named.",
        "",
        "| system | prefix cache | TTFT p50 (ms) | TTFT p99 (ms) | first-turn TTFT (ms) | output tok/s | prompt tokens from cache | TTFT p50 / tierserve cold |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (system, cache), row in table.items():
        share = ratio(row["cached_tokens"], row["prompt_tokens"])
        errors = f" ({row['errors']} errors)" if row["errors"] else ""
        lines.append(
            f"| {system}{errors} | {cache} | {_ms(row['ttft_p50_s'])} | {_ms(row['ttft_p99_s'])} "
            f"| {_ms(row['first_turn_ttft_s'])} | {_num(row['output_tok_s'])} | {_num(share * 100 if share is not None else None)}% "
            f"| {_num(ratio(row['ttft_p50_s'], cold.get('ttft_p50_s')), 3)} |"
        )
    lines += ["", "Targets:", ""]
    for state, target in (("L1", 0.1), ("L3", 0.2)):
        for metric, label in (("ttft_p50_s", "TTFT p50"), ("first_turn_ttft_s", "first-turn TTFT")):
            value = ratio(table.get(("tierserve", state), {}).get(metric), cold.get(metric))
            lines.append(f"- {state} {label} / cold <= {target}: {_num(value, 3)}, {_verdict(value, target, False)}")
    fresh = table.get(("tierserve", "fresh"), {}).get("ttft_p50_s")
    theirs = table.get(("transformers-serve-cb", "none"), {}).get("ttft_p50_s")
    if fresh is not None and theirs is not None:
        lines.append(
            f"- like for like (both share the prefix in memory from an empty start): transformers-serve-cb "
            f"TTFT p50 / tierserve fresh TTFT p50 = {_x(ratio(theirs, fresh))} (not a target)"
        )
    for peer in ("transformers-serve-cb", "transformers-serve"):
        theirs = table.get((peer, "none"), {}).get("ttft_p50_s")
        for state in ("L1", "L3"):
            value = ratio(theirs, table.get(("tierserve", state), {}).get("ttft_p50_s"))
            lines.append(f"- {peer} TTFT p50 / tierserve {state} TTFT p50 >= 5: {_x(value)}, {_verdict(value, 5.0)}")
    for peer, pairs in PRECISION_PAIRS.items():  # each precision against its own peer
        llama = table.get((peer, "slot prompt cache"), {}).get("ttft_p50_s")
        if llama is None:
            continue
        for ours in pairs:
            for state in ("fresh", "L1", "L3"):
                value = ratio(llama, table.get((ours, state), {}).get("ttft_p50_s"))
                if value is not None or ours == "tierserve":
                    lines.append(f"- {peer} TTFT p50 / {ours} {state} TTFT p50 >= 3: {_x(value)}, {_verdict(value, 3.0)}")
    return "\n".join(lines)


# ---- roofline and cache store ------------------------------------------------------------------


def roofline_section(payload: dict) -> str:
    lines = [
        f"Copy bandwidth {payload['copy_bandwidth_gb_s']:.1f} GB/s (read + write, best of 10); "
        f"{payload['weight_bytes_per_token'] / 1e6:.1f} MB of weights read per decode step; "
        f"limit {payload['limit_tok_s']:.1f} tokens/s at batch 1.",
        "",
        "| system | weight MB read per token | limit tok/s | batch-1 decode tok/s | fraction of the limit |",
        "|---|---:|---:|---:|---:|",
    ]
    sizes = payload.get("weight_bytes_by_system", {})
    limits = payload.get("limit_tok_s_by_system", {})
    for name, rate in payload["decode_tok_s"].items():
        size = sizes.get(name, payload["weight_bytes_per_token"])
        limit = limits.get(name, payload["limit_tok_s"])
        lines.append(f"| {name} | {size / 1e6:.1f} | {limit:.1f} | {rate:.1f} | {payload['fraction_of_limit'][name]:.2f} |")
    lines += ["", "Targets:", ""]
    for name in ("tierserve", "tierserve-bf16", "tierserve-int8"):
        value = payload["fraction_of_limit"].get(name)
        if value is not None:
            lines.append(f"- {name} >= 0.70 of its limit: {_num(value, 2)}, {_verdict(value, 0.7)}")
    return "\n".join(lines)


def perplexity_section(payload: dict) -> str:
    ppl = payload["perplexity"]
    lines = [
        f"Perplexity of {payload['config']['file']} over `bench/data/{ppl['text']}` ({ppl['tokens']} tokens, "
        f"{ppl['chunks']} chunks of {ppl['n_ctx']}, the second half of each scored: {ppl['scored_tokens']} tokens), "
        "computed as llama.cpp's `llama-perplexity` computes it; llama.cpp runs the file as stored and as its own "
        "`llama-quantize --allow-requantize` converts it to the same precision class as tierserve's.",
        "",
        "| precision | tierserve PPL | llama.cpp PPL | tierserve / llama.cpp |",
        "|---|---:|---:|---:|",
    ]
    for row in ppl["rows"]:
        ours, theirs = row["tierserve"], row["llama.cpp"]
        shown = f"{ours['ppl']:.4f} ± {ours['stderr']:.3f}" if ours else "—"
        ratio = f"{ours['ppl'] / theirs['ppl']:.4f}" if ours else "—"
        lines.append(f"| {row['precision']} | {shown} | {theirs['ppl']:.4f} ± {theirs['stderr']:.3f} | {ratio} |")
    return "\n".join(lines)


def perplexity_api_section(payload: dict) -> str:
    ppl = payload["perplexity_api"]
    lines = [
        f"Perplexity of {payload['config']['file']} over `bench/data/{ppl['text']}` ({ppl['chunks']} chunks of "
        f"{ppl['n_ctx']} tokens, the second half of each scored) through a running server's `echo` + `logprobs` "
        "(`max_tokens: 0`), as an evaluation harness reads it, next to an engine in this process with the same "
        "settings and to the whole-sequence model (`bench perplexity`'s figure). Differences are the largest "
        "per-token difference in negative log-likelihood from the API's, in nats.",
        "",
        "| precision | through the API | in-process engine | whole-sequence model | max diff engine | max diff whole |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in ppl["rows"]:
        api, engine, whole = row["api"], row["engine"], row["whole_sequence"]
        lines.append(
            f"| {row['precision']} | {api['ppl']:.4f} ± {api['stderr']:.3f} | {engine['ppl']:.4f} | {whole['ppl']:.4f} "
            f"| {row['max_difference_engine']:.1e} | {row['max_difference_whole_sequence']:.1e} |"
        )
    return "\n".join(lines)


def startup_section(payload: dict) -> str:
    config, summary = payload["config"], payload["summary"]
    lines = [
        f"`serve` to ready on {config['file']}, median of {config['repeats']} alternating starts (tierserve with its "
        f"caches warm; llama-server with {config['threads']} threads), then one greedy chat answer.",
        "",
        "| system | ready (s) | first answer (s) | answer |",
        "|---|---:|---:|---|",
    ]
    for name, row in summary.items():
        lines.append(f"| {name} | {row['ready_s']:.2f} | {row['first_answer_s']:.2f} | {row['answer']!r} |")
    cold = payload["cold"]
    lines += [
        "",
        f"tierserve's first start after its converted-metadata cache is cleared: ready in {cold['ready_s']:.2f} s.",
        "",
        "Where tierserve's time goes (each step in turn in a fresh interpreter; the HTTP process and the engine "
        "process overlap some of them):",
        "",
        "| step | seconds |",
        "|---|---:|",
    ]
    lines += [f"| {step} | {seconds:.2f} |" for step, seconds in payload["phases"].items()]
    return "\n".join(lines)


def quality_section(payload: dict) -> str:
    lines = [
        f"Teacher-forced logits at every position of {payload['config']['texts']} texts, each variant against "
        "float32 on the same checkpoint.",
        "",
        "| checkpoint | variant | greedy agreement | mean KL (nats) | positions |",
        "|---|---|---:|---:|---:|",
    ]
    for checkpoint, variants in payload["results"].items():
        for name, row in variants.items():
            lines.append(
                f"| {checkpoint} | {name} | {row['greedy_agreement']:.3f} | {row['mean_kl']:.5f} | {row['positions']} |"
            )
    return "\n".join(lines)


def cache_store_section(payload: dict) -> str:
    lines = [
        "| tier | tokens per entry | entry KB | put MB/s | put p50 (ms) | put p99 (ms) | get MB/s | get p50 (ms) | get p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in payload["tiers"]:
        lines.append(
            f"| {row['tier']} | {row['block_size']} | {row['entry_bytes'] / 1024:.0f} | {row['put_mb_s']:.0f} "
            f"| {row['put_p50_ms']:.3f} | {row['put_p99_ms']:.3f} | {row['get_mb_s']:.0f} | {row['get_p50_ms']:.3f} "
            f"| {row['get_p99_ms']:.3f} |"
        )
    lines += [
        "",
        "Put is the demotion path: the block copied off the live pool, then stored; for disk, puts of every "
        "entry plus `flush()` over the count (time until on disk). Get is the promotion path: the hit fetched "
        "(disk: a file in the OS page cache) and copied back into the pool.",
        "",
        "| zstd level | tokens per entry | compression ratio | stored bytes/token | raw bytes/token | encode MB/s | decode MB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in payload["codec"]:
        lines.append(
            f"| {row['level']} | {row['block_size']} | {row['ratio']:.3f} | {row['stored_bytes_per_token']:.0f} "
            f"| {row['raw_bytes_per_token']} | {row['encode_mb_s']:.0f} | {row['decode_mb_s']:.0f} |"
        )
    return "\n".join(lines)


# ---- cold prefill --------------------------------------------------------------------------


def cold_prefill_section(payload: dict) -> str:
    config = payload["config"]
    grouped: dict[tuple[str, int], list[float]] = defaultdict(list)
    errors: dict[tuple[str, int], int] = defaultdict(int)
    for run in payload["runs"]:
        key = (run["system"], run["prompt_len"])
        errors[key] += run.get("errors", 0)
        if run.get("ttft_s") is not None:
            grouped[key].append(run["ttft_s"])
    lines = [
        f"One request at a time, a fresh prompt each (no cache can serve it), max_tokens 1; median TTFT over "
        f"{config['requests']} requests x {config['repeats']} repeats.",
        "",
        "| prompt tokens | system | TTFT p50 (ms) | prompt tok/s | system / tierserve TTFT |",
        "|---:|---|---:|---:|---:|",
    ]
    for n in config["prompt_lens"]:
        for system in config["systems"]:
            ttft = median(grouped.get((system, n), []))
            ours = median(grouped.get(_ours_for(system, n, grouped), []))
            note = f" ({errors[(system, n)]} errors)" if errors[(system, n)] else ""
            speed = n / ttft if ttft else None
            lines.append(f"| {n} | {system}{note} | {_ms(ttft)} | {_num(speed)} | {_x(ratio(ttft, ours))} |")
    lines += ["", "Target: cold prefill of 2048 tokens, llama-server TTFT / tierserve TTFT >= 1.0:"]
    for system in config["systems"]:
        ours = _ours_for(system, 2048, grouped)
        if system in PRECISION_PAIRS and (system, 2048) in grouped and ours in grouped:
            value = ratio(median(grouped[(system, 2048)]), median(grouped[ours]))
            lines.append(f"- {system} / {ours[0]}: {_x(value)}, {_verdict(value, 1.0)}")
    return "\n".join(lines)


def fleet_section(payload: dict) -> str:
    """Routing (hit rate, TTFT) and disaggregation (TPOT of running decodes), medians over repeats."""
    summary = payload["summary"]
    lines = []
    if "cache_aware" in summary:
        lines += ["| routing | prompt-token hit rate | TTFT p50 (s) | TTFT p99 (s) | output tok/s |", "|---|---:|---:|---:|---:|"]
        for routing in ("cache_aware", "power_of_two"):
            row = summary.get(routing)
            if row:
                lines.append(
                    f"| {routing} | {row['hit_rate']:.3f} | {row['ttft_p50_s']:.3f} | {row['ttft_p99_s']:.3f} | {row['output_tok_s']:.1f} |"
                )
        if summary.get("hit_rate_ratio"):
            lines.append(f"\nhit rate ×{summary['hit_rate_ratio']:.2f}, TTFT p50 ×{summary['ttft_p50_ratio']:.2f} lower\n")
    if "together" in summary:
        lines += ["| prefill and decode | TPOT p50 (s) | TPOT p99 (s) | inter-token p99 (s) | long prompt TTFT p50 (s) |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        for split in ("together", "disaggregated"):
            row = summary.get(split)
            if row:
                lines.append(
                    f"| {split} | {row['tpot_p50_s']:.4f} | {row['tpot_p99_s']:.4f} | {row['itl_p99_s']:.4f} | {row['long_ttft_p50_s']:.3f} |"
                )
    return "\n".join(lines) + "\n"


def lora_section(payload: dict) -> str:
    config, summary = payload["config"], payload["summary"]
    return "\n".join([
        f"{config['requests']} requests x ({config['prompt_len']} prompt + {config['output_len']} output) tokens, greedy, "
        f"in one engine; adapters of rank {config['rank']} on {', '.join(config['modules'])}; median of {config['repeats']} "
        "alternating repeats.",
        "",
        "| run | output tokens/s |",
        "|---|---:|",
        f"| base model alone | {_num(summary['base'])} |",
        f"| {config['adapters']} adapters mixed in the batch | {_num(summary['mixed'])} |",
        f"| mixed / base | {_x(summary['mixed_over_base'])} {_verdict(summary['mixed_over_base'], 0.7)} |",
    ])


def grammar_section(payload: dict) -> str:
    lines = [
        f"A greedy walk of {payload['config']['steps']} tokens through one JSON schema on random logits; "
        "mask time per token (filling the next-token bitmask).",
        "",
        "| vocabulary | engine | compile (ms) | mask median (us) | p90 (us) | mean (us) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for vocab, engines in payload["results"].items():
        for engine, row in engines.items():
            lines.append(f"| {vocab} | {engine} | {row['compile_ms']:.1f} | {row['mask_us_median']:.0f} | "
                         f"{row['mask_us_p90']:.0f} | {row['mask_us_mean']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def responses_section(payload: dict) -> str:
    config = payload["config"]
    lines = [
        f"A {config['turns']}-turn conversation ({config['turn_len']} words of new user text and {config['output_len']} "
        f"output tokens per turn), greedy; TTFT of the last turn, median of {config['repeats']}.",
        "",
        "| turn 5 sent as | TTFT (ms) | cached tokens |",
        "|---|---:|---:|",
    ]
    for name, row in payload["summary"].items():
        lines.append(f"| {name} | {_ms(row['ttft_s'])} | {row['cached_tokens']:.0f} |")
    return "\n".join(lines)


def tier_stall_section(payload: dict) -> str:
    config = payload["config"]
    trip = config.get("redis_round_trip_ms")
    lines = [
        f"{config['streams']} streams decode while {config['arrivals']} requests arrive "
        f"({config['arrival_interval_s']} s apart), each with a {config['prefix_len']}-token prefix of its own "
        f"+ {config['suffix_len']} tokens, asking for 1 token; medians of {config['repeats']} alternating repeats. "
        f"Gaps: the streams' inter-token times while the arrivals are in flight (none: a "
        f"{config['baseline_seconds']} s window)."
        + (f" Redis through a proxy adding {config['redis_delay_ms']} ms (round trip measured: {trip:.2f} ms)."
           if trip is not None else ""),
        "",
        "| prefixes in | streams' gap p50 (ms) | gap p99 (ms) | p99 / none | p99 / L1 | arrivals' TTFT p50 (ms) "
        "| TTFT / recompute | cached tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for row in payload["summary"]:
        cached = "-" if row["arrival_cached_tokens"] is None else f"{row['arrival_cached_tokens']:.0f}"
        lines.append(
            f"| {row['case']} | {_ms(row['itl_p50_s'])} | {_ms(row['itl_p99_s'])} | {_x(row['itl_p99_vs_none'])} "
            f"| {_x(row.get('itl_p99_vs_l1'))} "
            f"| {_ms(row['arrival_ttft_p50_s'])} | {_x(row['ttft_vs_recompute'])} | {cached} |"
        )
    return "\n".join(lines)


SECTIONS = {
    "tier-stall": ("Slow tiers and the streams decoding meanwhile", tier_stall_section),
    "responses": ("Responses API: a follow-up turn from the cache", responses_section),
    "grammar": ("Constrained decoding: grammar mask cost", grammar_section),
    "lora": ("LoRA adapters mixed in one batch", lora_section),
    "fleet": ("Fleet: cache-aware routing and prefill/decode disaggregation", fleet_section),
    "throughput": ("Throughput vs concurrency", throughput_section),
    "cold-prefill": ("Cold prefill (TTFT of a long uncached prompt)", cold_prefill_section),
    "prefix": ("Shared-prefix chats by cache state", prefix_section),
    "roofline": ("Batch-1 decode vs the memory-bandwidth limit", roofline_section),
    "cache-store": ("Cache tiers and compression", cache_store_section),
    "quality": ("Reduced precisions against float32", quality_section),
    "perplexity": ("A GGUF file's perplexity per precision, against llama.cpp", perplexity_section),
    "perplexity-api": ("Perplexity through the API (echo + logprobs) against in-process", perplexity_api_section),
    "startup": ("Start-up: serve to ready on a GGUF file", startup_section),
}


def section(name: str, payload: dict) -> str:
    title, render = SECTIONS[name]
    return f"## {title}\n\n{render(payload)}"


# ---- plots ---------------------------------------------------------------------------------


def plot_throughput(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = throughput_medians(payload)
    concurrency = payload["config"]["concurrency"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in payload["config"]["systems"]:
        points = [(n, table[(system, n)]["output_tok_s"]) for n in concurrency if (system, n) in table]
        if points:
            ax.plot(*zip(*points), marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrency, [str(n) for n in concurrency])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title("Throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_prefix(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = prefix_medians(payload)
    labels, p50, first = [], [], []
    for (system, cache), row in table.items():
        if system.startswith("tierserve"):
            labels.append(f"{system}\n{cache}")
        else:
            labels.append(system.replace("transformers-serve", "transformers\nserve"))
        p50.append((row["ttft_p50_s"] or 0) * 1000)
        first.append((row["first_turn_ttft_s"] or 0) * 1000)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], p50, width=0.4, label="TTFT p50, all requests")
    ax.bar([i + 0.2 for i in x], first, width=0.4, label="TTFT, first turns")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("milliseconds (log scale)")
    ax.set_title("Time to first token by prefix-cache state")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _machine_line(payload: dict) -> str:
    m = payload.get("machine", {})
    gpu = m.get("gpu") or "no GPU"
    return (
        f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB, {gpu}; torch {m.get('torch')} "
        f"({m.get('torch_threads')} threads); commit {m.get('commit')}; {m.get('date')}"
    )


def write(results_dir: Path) -> list[Path]:
    """Write ``report.md`` (and the plots whose data exists) into ``results_dir``; returns the files written."""
    written = []
    parts = ["# tierserve benchmark report", ""]
    for name in SCENARIOS:
        path = results_dir / f"{name}.json"
        if not path.exists():
            continue
        payload = json.loads(path.read_text())
        parts += [section(name, payload), "", f"Measured on: {_machine_line(payload)}.", f"Reproduce: `{payload.get('command')}`", ""]
        if name == "throughput":
            plot = results_dir / "throughput.png"
            plot_throughput(payload, plot)
            parts += [f"![throughput vs concurrency]({plot.name})", ""]
            written.append(plot)
        if name == "prefix":
            plot = results_dir / "prefix_ttft.png"
            plot_prefix(payload, plot)
            parts += [f"![TTFT by cache state]({plot.name})", ""]
            written.append(plot)
    if len(parts) == 2:
        raise SystemExit(f"no results in {results_dir}: run a scenario first (python -m bench throughput ...)")
    report = results_dir / "report.md"
    report.write_text("\n".join(parts))
    return [report, *written]
