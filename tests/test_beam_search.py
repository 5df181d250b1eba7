"""Beam search equals transformers' ``generate(num_beams=k)`` token for token, on beams that share KV blocks."""

from __future__ import annotations

import itertools
import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, hf_greedy, make_engine
from tests.waiting import wait_until
from tierserve.engine.beam_search import BeamSearch, BeamSearchParams, beam_search_blocks
from tierserve.engine import RequestError
from tierserve.models.builtin_models import ensure_builtin_checkpoint
from tierserve.testing import http_client
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.scheduler import QueueFullError

pytestmark = pytest.mark.unit

NEW_TOKENS = 8
BEAM_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[6]]  # 2, 11 and 11 tokens: partial last blocks at block_size 4


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gpt_neox"])  # gpt_neox: the paged transformers backend
def checkpoint(request, tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("beam"), request.param, request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def engine(checkpoint):
    # 4-token blocks: every prompt here ends in a partial block that the beams must copy before writing
    return make_engine(checkpoint[0], kv_cache__block_size=4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("beam-llama"), "llama", "llama")


def hf_beams(model, tokenizer, ids: list[int], params: BeamSearchParams, eos: list[int] | None = None):
    """``generate(num_beams=...)``'s returned sequences (padding stripped) and their scores, best first, and how
    many steps it ran (one recorded score each)."""
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            num_beams=params.beam_width,
            max_new_tokens=params.max_tokens,
            min_new_tokens=params.min_tokens or None,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            num_return_sequences=params.num_return_sequences,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,
        )
    # a row's generated length is how many steps recorded a beam index; shorter rows end in padding
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    sequences = [row[len(ids) : len(ids) + n].tolist() for row, n in zip(out.sequences, lengths)]
    return sequences, out.sequences_scores.tolist(), len(out.scores)


def beams_with_eos(engine, ids, params, eos):
    """Beam search on the engine's own core, with ``eos`` as the tokens that end a hypothesis."""
    core = engine.driver.core
    budget = core.settings.scheduler.max_num_batched_tokens
    return BeamSearch(core.backend, core.kv, ids, params, eos, prefill_budget=budget, new_seq_id=core.next_seq_id).run()


def assert_same(results, expected) -> None:
    sequences, scores, _ = expected
    assert [r.token_ids for r in results] == sequences
    assert [r.score for r in results] == pytest.approx(scores, abs=1e-4)


def test_matches_transformers(checkpoint, engine):
    """Also once the prompt's blocks are cached: a repeated prompt's search reads them and computes the rest."""
    _, model, tokenizer = checkpoint
    free = engine.stats().kv_blocks_free
    searched: set[str] = set()
    for prompt, width, length_penalty, early_stopping in itertools.product(
        BEAM_PROMPTS, [2, 4], [1.0, 0.5], [False, True]
    ):
        ids = tokenizer(prompt)["input_ids"]
        params = BeamSearchParams(width, NEW_TOKENS, length_penalty, early_stopping, num_return_sequences=width)
        output = engine.beam_search(prompt, params)
        assert_same(output.hypotheses, hf_beams(model, tokenizer, ids, params))
        assert all(len(r.token_ids) == NEW_TOKENS and r.finish_reason == "length" for r in output.hypotheses)
        if prompt in searched:  # every full block but the one holding the last token (its logits are needed)
            assert output.cache.cached_tokens >= (len(ids) - 1) // 4 * 4
        searched.add(prompt)
    engine.check_integrity()
    assert engine.stats().kv_blocks_free == free


def test_eos_finishes_hypotheses_as_transformers_does(checkpoint, engine):
    """An eos the model often emits ends hypotheses early; min_tokens holds it back as min_new_tokens does."""
    _, model, tokenizer = checkpoint
    finished_early = 0
    for prompt in BEAM_PROMPTS[:2]:
        ids = tokenizer(prompt)["input_ids"]
        [best], _, _ = hf_beams(model, tokenizer, ids, BeamSearchParams(4, NEW_TOKENS))
        for eos, width, length_penalty, early_stopping, min_tokens in itertools.product(
            [[best[2]], [best[1], best[4]]], [2, 4], [1.0, 0.5], [False, True, "never"], [0, 3]
        ):
            params = BeamSearchParams(width, NEW_TOKENS, length_penalty, early_stopping, width, min_tokens)
            output = beams_with_eos(engine, ids, params, eos)
            expected = hf_beams(model, tokenizer, ids, params, eos)
            assert_same(output.hypotheses, expected)
            # the steps it ran, and so whether it stopped early (the statistics count it), are generate's
            assert output.steps == expected[2] and output.stopped_early == (expected[2] < NEW_TOKENS)
            for result in output.hypotheses:
                assert len(result.token_ids) >= min_tokens
                stopped = result.token_ids[-1] in eos
                assert result.finish_reason == ("stop" if stopped else "length")
                finished_early += len(result.token_ids) < NEW_TOKENS
    assert finished_early > 0
    # the three likeliest first tokens end a hypothesis: both beams finish at the first step, where it stops
    with torch.inference_mode():
        first = model(torch.tensor([ids])).logits[0, -1].topk(3).indices.tolist()
    params = BeamSearchParams(2, NEW_TOKENS, num_return_sequences=2)
    output = beams_with_eos(engine, ids, params, first)
    expected = hf_beams(model, tokenizer, ids, params, first)
    assert_same(output.hypotheses, expected)
    assert output.steps == expected[2] == 1 and output.stopped_early
    assert_pool_released(engine)


def test_fewer_returned_sequences_and_one_beam(checkpoint, engine):
    _, model, tokenizer = checkpoint
    ids = tokenizer(PROMPTS[3])["input_ids"]
    params = BeamSearchParams(4, NEW_TOKENS, num_return_sequences=2)
    assert_same(beams_with_eos(engine, ids, params, [1, 3]).hypotheses, hf_beams(model, tokenizer, ids, params, [1, 3]))
    # num_beams=1 is greedy search in generate, whatever early_stopping says
    [result] = engine.beam_search(ids, BeamSearchParams(1, NEW_TOKENS, early_stopping="never")).hypotheses
    assert result.token_ids == hf_greedy(checkpoint[0], [PROMPTS[3]], NEW_TOKENS)[0]


def test_beams_share_prompt_blocks_and_copy_partial_ones(llama, monkeypatch):
    engine = make_engine(llama, kv_cache__block_size=4)
    tokenizer = AutoTokenizer.from_pretrained(llama)
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    ids = tokenizer(PROMPTS[4])["input_ids"]  # 82 tokens: 20 full blocks and a partial one
    assert len(ids) % 4
    params = BeamSearchParams(4, 6, num_return_sequences=4)
    used: list[int] = []  # blocks in use at each forward
    copied: list[int] = []  # blocks written by a copy
    core = engine.driver.core  # white-box: count what the arena holds at each forward
    forward, write_blocks = core.backend.forward, core.backend.write_blocks

    def counting_forward(chunks):
        used.append(core.kv.pool.num_used_blocks)
        return forward(chunks)

    def counting_write_blocks(block_ids, data):
        copied.extend(block_ids)
        write_blocks(block_ids, data)

    monkeypatch.setattr(core.backend, "forward", counting_forward)
    monkeypatch.setattr(core.backend, "write_blocks", counting_write_blocks)

    results = engine.beam_search(ids, params).hypotheses

    assert_same(results, hf_beams(model, tokenizer, ids, params))
    one_copy = math.ceil((len(ids) + params.max_tokens - 1) / 4)
    assert max(used) <= beam_search_blocks(len(ids), params, 4) < params.beam_width * one_copy
    assert copied  # the prompt's partial block was copied for all but its last holder
    assert_pool_released(engine)


def test_runs_between_steps_of_running_requests(llama):
    engine = make_engine(llama, kv_cache__block_size=4)
    tokenizer = AutoTokenizer.from_pretrained(llama)
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.start()
    try:
        _, stream = engine.submit(tokenizer(PROMPTS[1])["input_ids"], greedy)
        params = BeamSearchParams(4, NEW_TOKENS, num_return_sequences=4)
        results = engine.beam_search(PROMPTS[6], params).hypotheses
        tokens: list[int] = []
        while True:
            output = stream.get(timeout=60)
            tokens += output.token_ids
            if output.finished:
                break
    finally:
        engine.shutdown()
    assert_same(results, hf_beams(model, tokenizer, tokenizer(PROMPTS[6])["input_ids"], params))
    assert tokens == hf_greedy(llama, [PROMPTS[1]], 24)[0]
    assert_pool_released(engine)


LONG_SEARCH = BeamSearchParams(16, 300, num_return_sequences=16, min_tokens=300)  # ~seconds on the tiny model


def test_a_long_search_does_not_hold_back_other_requests(llama):
    """16 beams of 300 tokens run between the engine's steps: a 4-token request sent after the search started
    is answered while the search still runs (it used to wait for the whole search, seconds)."""
    import threading

    engine = make_engine(llama)
    engine.start()
    try:
        found: list = []
        search = threading.Thread(target=lambda: found.append(engine.beam_search(PROMPTS[6], LONG_SEARCH)))
        search.start()
        wait_until(lambda: engine.stats().kv_blocks_free < engine.stats().kv_blocks_total, timeout=30,
                   interval=0.005, what="the search to hold blocks")  # fmt: skip
        quick = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        [answer] = engine.generate([PROMPTS[1]], quick)
        assert len(answer.token_ids) == 4 and search.is_alive()  # answered while the search runs
        search.join(timeout=300)
        assert len(found[0].hypotheses) == 16 and all(len(h.token_ids) == 300 for h in found[0].hypotheses)
        wait_until(lambda: engine.stats().counters.beam_searches == 1, timeout=10, what="the count published")
    finally:
        engine.shutdown()
    assert_pool_released(engine)


def test_a_search_whose_client_left_is_stopped_and_frees_its_blocks(llama):
    """Over HTTP: a beam request whose client leaves while its search runs is cancelled at the next slice, its
    blocks freed, and it is never completed (a search used to run to its end for nobody)."""
    import json
    import socket
    from urllib.parse import urlparse

    import httpx

    from tests.server_helpers import server_starter

    from structlog.testing import capture_logs

    with server_starter(llama) as start, start() as base, capture_logs() as logs:
        def blocks() -> tuple[int, int]:
            memory = httpx.get(f"{base}/health").json()["memory"]
            return memory["kv_blocks_free"], memory["kv_blocks_total"]

        address = urlparse(base)
        body = json.dumps({"prompt": PROMPTS[6], "max_tokens": 480, "min_tokens": 480, "beam_width": 16}).encode()
        client = socket.create_connection((address.hostname, address.port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        wait_until(lambda: blocks()[0] < blocks()[1], timeout=30, interval=0.01, what="the search to hold blocks")
        client.close()  # the client leaves mid-search
        wait_until(lambda: any(e["event"] == "beam_search_cancelled" for e in logs), timeout=10, what="the cancel")
        wait_until(lambda: blocks()[0] == blocks()[1], timeout=10, interval=0.02, what="its blocks freed")
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60).status_code == 200


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_width": 20}, "beam_width: got 20, allowed: 1 to 16"),
        ({"beam_width": 0}, "beam_width: got 0, allowed: 1 to 16"),
        ({"max_tokens": 0}, "max_tokens: got 0, allowed: an integer >= 1"),
        ({"num_return_sequences": 5}, "num_return_sequences: got 5, allowed: 1 to beam_width (4)"),
        ({"early_stopping": "sometimes"}, "early_stopping: got 'sometimes', allowed: true, false or \"never\""),
        ({"min_tokens": 9}, "min_tokens: got 9, allowed: 0 to max_tokens (8)"),
        ({"length_penalty": float("nan")}, "length_penalty: got nan"),
        ({"length_penalty": 6.2e16}, "length_penalty: got 6.2e+16, allowed: -10.0 to 10.0"),  # overflowed to a 500
    ],
)
def test_params_name_the_bad_field(kwargs, message):
    with pytest.raises(ValueError) as error:
        BeamSearchParams(**{"beam_width": 4, "max_tokens": 8, **kwargs})
    assert str(error.value).startswith(message)


def test_requests_the_engine_cannot_serve(llama):
    params = BeamSearchParams(4, 20)
    small = make_engine(llama, kv_cache__block_size=4, kv_cache__l1_capacity=16)
    with pytest.raises(RequestError, match=r"^max_tokens: .* may need 24 KV blocks, more than the cache holds \(16\)"):
        small.beam_search(PROMPTS[0], params)
    with pytest.raises(RequestError, match=r"^max_tokens: .* exceeds the model's context length \(512\)"):
        small.beam_search(PROMPTS[0], BeamSearchParams(2, 511))
    with pytest.raises(RequestError, match=r"^prompt: "):
        small.beam_search([], params)

    # blocks held by running requests: refused for now, served once they are free
    engine = make_engine(llama, kv_cache__block_size=4, kv_cache__l1_capacity=32)
    pool = engine.driver.core.kv.pool  # white-box: blocks held as running requests would hold them
    held = pool.allocate(20)
    with pytest.raises(QueueFullError, match=r"^beam_width: .* may need 24 KV blocks and 12 are free now; retry later"):
        engine.beam_search(PROMPTS[0], params).hypotheses
    pool.free(held)
    assert len(engine.beam_search(PROMPTS[0], params).hypotheses[0].token_ids) == 20
    assert_pool_released(engine)

    unpaged = make_engine(llama, backend="transformers-unpaged")
    with pytest.raises(RequestError, match=r'^beam_width: .* needs a paged KV arena.*model.backend = "auto"'):
        unpaged.beam_search(PROMPTS[0], params)


def test_a_beam_request_reuses_and_publishes_cached_prompt_blocks(tmp_path):
    """Over HTTP: a beam request's prompt finds the blocks an earlier request cached (80 of its 82 tokens; it
    used to find none) and publishes the blocks it computes; its beams are exactly those of the same search
    without the cache, and ``/v1/cache/stats`` counts the searches, their beams, tokens and early stops."""
    prompt = PROMPTS[4]
    tiny = ensure_builtin_checkpoint("tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()(torch.tensor([ids])).logits
    # builtin:tiny, with its three likeliest first tokens after the prompt declared eos: two beams without
    # min_tokens both finish at the first step (an early stop); with min_tokens = max_tokens they run to the end
    model = shutil.copytree(tiny, tmp_path / "tiny-eos")
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] += logits[0, -1].topk(3).indices.tolist()
    (model / "generation_config.json").write_text(json.dumps(generation))
    full = (len(ids) - 1) // 16 * 16  # the last token's block is never served: its logits are needed

    with http_client({"model.path": str(model), "speculative.beam_width": 2}) as client:
        usages: list[dict] = []

        def post(path: str, **body) -> dict:
            reply = client.post(path, json=body)
            assert reply.status_code == 200, reply.text
            usages.append(reply.json()["usage"])
            return reply.json()

        beams = {"prompt": prompt, "max_tokens": 8, "min_tokens": 8, "n": 2, "use_beam_search": True}
        uncached = post("/v1/cached/completions", **beams, enable_caching=False)
        assert uncached["usage"]["cached_tokens"] == 0 and uncached["cache_stats"]["cache_used"] is False
        # enable_caching false published nothing; this request does
        plain = post("/v1/completions", prompt=prompt, max_tokens=1)
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        cached = post("/v1/cached/completions", **beams)
        assert [c["text"] for c in cached["choices"]] == [c["text"] for c in uncached["choices"]]
        usage = cached["usage"]
        assert full <= usage["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] < len(ids)
        stats = cached["cache_stats"]
        assert stats["cache_used"] is True and stats["prefix_matches"] == 1
        assert stats["cache_hits"] == stats["tier_hits"]["l1"] == full // 16 and stats["cache_misses"] == 0
        salted = post("/v1/cached/completions", **beams, cache_salt="another scope")  # reads no other scope's blocks
        assert salted["usage"]["cached_tokens"] == 0 and salted["choices"] == uncached["choices"]

        # a prompt seen first by a beam search: its blocks are there for the next request
        other = "A different opening, then the same story. " + prompt
        first = post("/v1/completions", prompt=other, max_tokens=8, min_tokens=8, beam_width=2)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        after = post("/v1/completions", prompt=other, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert after >= (first["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0

        stopped = post("/v1/completions", prompt=prompt, max_tokens=8, min_tokens=0, beam_width=2, n=2)
        assert [c["finish_reason"] for c in stopped["choices"]] == ["stop", "stop"]
        assert stopped["usage"]["completion_tokens"] == 2  # each hypothesis is its one eos token

        doc = client.get("/v1/cache/stats").json()
        metrics = client.get("/metrics").text
    # the engine's prompt and cached tokens are the responses' (a beam prompt's too: the hit rate stays a rate)
    assert doc["overall"]["prompt_tokens"] == sum(usage["prompt_tokens"] for usage in usages)
    cached_tokens = sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in usages)
    assert doc["overall"]["cached_tokens"] == cached_tokens
    assert f"tierserve_cached_prompt_tokens_total {float(cached_tokens)}" in metrics
    speculation = doc["cache_manager"]["speculation"]
    # five searches of two beams: four ran 8 steps, the last stopped after 1; no drafts ran
    assert speculation["beam_searches"] == 5 and speculation["beams"] == 10
    assert speculation["beam_tokens_generated"] == speculation["tokens_generated"] == 4 * 2 * 8 + 2 * 1
    assert speculation["beam_early_stops"] == speculation["early_stops"] == 1
