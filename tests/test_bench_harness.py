"""The benchmark harness's parts: exact-length workloads, the load generator against a real server, the report.

No benchmark runs here: the server test drives a tiny checkpoint for a few
tokens to check what the harness measures, not how fast anything is.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from bench import report
from bench.client import drive
from bench.servers import start_tierserve
from bench.stats import percentile
from bench.workloads import shared_prefix_conversations, text_with_tokens, throughput_requests
from tests.engine_helpers import build_checkpoint

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("bench"), "llama", "llama")


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


def test_prompts_have_exactly_the_asked_token_count(tokenizer):
    import random

    rng = random.Random(3)
    for length in (1, 16, 128, 333):
        text = text_with_tokens(tokenizer, length, rng)
        assert len(tokenizer(text)["input_ids"]) == length
    requests = throughput_requests(tokenizer, 5, 64, 7, seed=1)
    assert len({r.prompt for r in requests}) == 5
    assert all(len(tokenizer(r.prompt)["input_ids"]) == 64 and r.max_tokens == 7 for r in requests)
    assert throughput_requests(tokenizer, 5, 64, 7, seed=1) == requests  # same seed, same workload


def test_conversations_share_the_system_prompt_and_grow_turn_by_turn(tokenizer):
    system, chats = shared_prefix_conversations(tokenizer, conversations=3, turns=4, prefix_len=200, turn_len=10)
    assert len(tokenizer(system)["input_ids"]) == 200
    for chat in chats:
        prompts = [chat.prompt(t) for t in range(4)]
        assert all(p.startswith(system) for p in prompts)
        for earlier, later in zip(prompts, prompts[1:]):
            assert later.startswith(earlier)  # the next turn extends the previous prompt
    assert len({chat.prompt(0) for chat in chats}) == 3


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([4, 1, 3, 2], 0) == 1


@pytest.mark.slow  # ~8 s: a real server under the bench's own load generator
def test_load_generator_measures_a_real_server(checkpoint, tokenizer, tmp_path):
    server = start_tierserve(checkpoint, tmp_path / "logs", tmp_path / "l3")
    try:
        requests = throughput_requests(tokenizer, 6, 16, 8, seed=2)
        sessions = [[server.completion_body(r.prompt, r.max_tokens) for r in requests[i : i + 2]] for i in (0, 2, 4)]
        done = []
        result = drive(server, sessions, on_done=lambda: done.append(1))
        summary = result.summary()
        assert len(done) == 6 and summary["requests"] == 6 and summary["errors"] == 0, summary
        assert summary["output_tokens"] == 48 and summary["prompt_tokens"] == 96
        assert sorted(r.turn for r in result.requests) == [0, 0, 0, 1, 1, 1]
        for request in result.requests:
            assert 0 < request.ttft <= request.latency <= result.wall_seconds
            assert request.tpot is not None and request.tpot > 0
        assert summary["output_tok_s"] == pytest.approx(48 / result.wall_seconds)

        # a rejected request is recorded with the server's message, and the run goes on
        bad = server.completion_body("hello", 4, temperature=-1)
        failed = drive(server, [[bad], [server.completion_body("hello there", 4)]])
        assert failed.errors == 1 and "HTTP 400" in failed.summary()["first_error"]
        assert "temperature" in failed.summary()["first_error"]
        assert failed.output_tokens == 4
    finally:
        server.stop()
    assert server.process.returncode == 0
    assert (tmp_path / "logs" / "tierserve.log").stat().st_size > 0


def _throughput_payload(ours_at_32: float) -> dict:
    runs = []
    for repeat in range(2):
        for system, rates in (
            ("tierserve", {1: 60.0, 32: ours_at_32}),
            ("transformers-serve-cb", {1: 20.0, 32: 50.0}),
            ("hf-generate", {1: 30.0, 32: 250.0}),
        ):
            for n, rate in rates.items():
                runs.append({
                    "system": system, "concurrency": n, "repeat": repeat, "errors": 0, "short_outputs": 0,
                    "output_tok_s": rate + repeat, "ttft_p50_s": 0.2, "ttft_p99_s": 0.4,
                    "tpot_p50_s": 0.02, "tpot_p99_s": 0.03,
                })  # fmt: skip
    config = {"concurrency": [1, 32], "prompt_len": 128, "output_len": 128, "repeats": 2,
              "systems": ["tierserve", "transformers-serve-cb", "hf-generate"]}  # fmt: skip
    return {"scenario": "throughput", "machine": {"cpu": "test cpu", "cores": 2}, "command": "python -m bench throughput",
            "config": config, "runs": runs}  # fmt: skip


def _prefix_payload() -> dict:
    def run(system, cache, ttft):
        return {"system": system, "cache": cache, "repeat": 0, "errors": 0, "ttft_p50_s": ttft, "ttft_p99_s": 2 * ttft,
                "first_turn_ttft_s": ttft, "output_tok_s": 100.0, "cached_tokens": 50, "prompt_tokens": 100}  # fmt: skip

    runs = [
        run("tierserve", "cold", 2.0),
        run("tierserve", "fresh", 1.5),
        run("tierserve", "L1", 0.1),
        run("tierserve", "L2", 0.12),
        run("tierserve", "L3", 0.5),
        run("transformers-serve-cb", "none", 3.0),
        run("llama-server", "slot prompt cache", 0.25),
        run("tierserve-bf16", "L1", 0.05),
        run("llama-server-bf16", "slot prompt cache", 0.2),
        run("tierserve-kvbf16", "L1", 0.08),
    ]
    config = {"conversations": 8, "turns": 8, "prefix_len": 2048, "turn_len": 32, "output_len": 32, "repeats": 1}
    return {"scenario": "prefix", "machine": {}, "command": "python -m bench prefix", "config": config, "runs": runs}


def test_report_tables_targets_and_plots(tmp_path):
    (tmp_path / "throughput.json").write_text(json.dumps(_throughput_payload(ours_at_32=200.0)))
    (tmp_path / "prefix.json").write_text(json.dumps(_prefix_payload()))
    written = report.write(tmp_path)
    assert {p.name for p in written} == {"report.md", "throughput.png", "prefix_ttft.png"}
    for plot in written[1:]:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "report.md").read_text()
    # medians over the two repeats: 200.5 vs 50.5 and 250.5
    assert "| 32 | tierserve | 200.5 |" in text and "| 32 | transformers-serve-cb | 50.5 |" in text
    assert "tierserve / transformers-serve-cb >= 3.0: 3.97x, met" in text
    assert "32 clients, tierserve / hf-generate >= 0.9: 0.80x, **missed**" in text
    assert "L1 TTFT p50 / cold <= 0.1: 0.050, met" in text
    assert "L3 TTFT p50 / cold <= 0.2: 0.250, **missed**" in text
    assert "transformers-serve-cb TTFT p50 / tierserve L1 TTFT p50 >= 5: 30.00x, met" in text
    assert "transformers-serve-cb TTFT p50 / tierserve fresh TTFT p50 = 2.00x (not a target)" in text
    # each precision against its own peer; a precision not run gets no line
    assert "llama-server TTFT p50 / tierserve L1 TTFT p50 >= 3: 2.50x, **missed**" in text
    assert "llama-server-bf16 TTFT p50 / tierserve-bf16 L1 TTFT p50 >= 3: 4.00x, met" in text
    # float32 weights on bfloat16 KV (llama-server's F16 cache) are the float32 peer's too
    assert "llama-server TTFT p50 / tierserve-kvbf16 L1 TTFT p50 >= 3: 3.12x, met" in text
    assert "llama-server-q8_0" not in text and "tierserve-bf16 L3" not in text
    assert "Measured on: test cpu, 2 cores" in text and "Reproduce: `python -m bench throughput`" in text


def test_cold_prefill_report_pairs_each_precision_with_its_llama_server():
    runs = [
        {"system": system, "prompt_len": n, "repeat": 0, "request": 0, "ttft_s": ttft, "errors": 0}
        for system, n, ttft in [
            ("tierserve", 2048, 2.0), ("llama-server", 2048, 3.0),
            ("tierserve-bf16", 2048, 1.0), ("llama-server-bf16", 2048, 0.8),
            ("tierserve", 512, 0.5), ("tierserve-bf16", 512, 0.25), ("llama-server-bf16", 512, 0.5),
        ]
    ]  # fmt: skip
    config = {"prompt_lens": [512, 2048], "requests": 1, "repeats": 1,
              "systems": ["tierserve", "llama-server", "tierserve-bf16", "llama-server-bf16"]}  # fmt: skip
    text = report.cold_prefill_section({"config": config, "runs": runs})
    assert "- llama-server / tierserve: 1.50x, met" in text
    assert "- llama-server-bf16 / tierserve-bf16: 0.80x, **missed**" in text
    assert "| 512 | llama-server-bf16 | 500 | 1024.0 | 2.00x |" in text  # against tierserve-bf16's 250 ms


def test_report_without_results_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit, match="run a scenario first"):
        report.write(tmp_path)


def test_cli_names_the_bad_option_and_the_allowed_values(capsys):
    from bench.__main__ import main  # the parser `python -m bench` runs, without a new interpreter per case

    with pytest.raises(SystemExit) as exit_info:
        main(["throughput", "--systems", "tierserve,vllm"])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "--systems" in stderr and "vllm" in stderr and "transformers-serve-cb" in stderr
    with pytest.raises(SystemExit) as exit_info:
        main(["throughput", "--concurrency", "8,zero"])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--concurrency" in stderr and "integers" in stderr


def test_perplexity_windows_are_llama_perplexitys():
    from bench.perplexity import chunks, ppl

    ids = list(range(1100))
    windows = chunks(ids, 512, bos=None)
    assert [w[0] for w in windows] == [0, 512] and all(len(w) == 512 for w in windows)  # the partial tail is dropped
    assert [w[0] for w in chunks(ids, 512, bos=7)] == [7, 7] and chunks(ids, 512, bos=7)[1][1] == 513
    value, error = ppl([1.0, 1.0, 1.0])
    assert abs(value - 2.718281828) < 1e-6 and error == 0.0


def test_the_fleet_bench_hit_rate_ceiling_counts_what_earlier_prompts_share():
    """A conversation's first turn can reuse its tenant's system prompt once an earlier conversation sent it, a
    later turn its own history; nothing can reuse a prompt's last token."""
    from bench.fleet import hit_rate_ceiling
    from bench.workloads import Conversation

    def words(text: str) -> dict[str, list[int]]:  # one id per word: prefixes are easy to count by hand
        return {"input_ids": [hash(word) % 10_000 for word in text.split()]}

    first = Conversation("sys a b", ("u1", "u2"), ("r1", "r2"))
    second = Conversation("sys a b", ("v1", "v2"), ("s1", "s2"))
    # prompts (words): "sys a b User: u1 Assistant:" (6), then "... Assistant: r1 User: u2 Assistant:" (10), which
    # starts with all 6; the second conversation's first prompt shares "sys a b User:" (4) with the first's, and
    # its second prompt all 6 of its own first
    assert hit_rate_ceiling(words, [first], 2) == (0 + 6) / (6 + 10)
    assert hit_rate_ceiling(words, [first, second], 2) == (0 + 6 + 4 + 6) / (6 + 10 + 6 + 10)
