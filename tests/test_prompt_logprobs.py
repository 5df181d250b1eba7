"""Prompt logprobs (``SamplingParams.prompt_logprobs``; ``echo`` + ``logprobs`` and vLLM's ``prompt_logprobs`` over
HTTP) equal ``transformers``' log-softmax of the same checkpoint's logits, however the prompt is computed: fresh,
after its prefix was cached, in chunks, preempted, long, or in the engine core's own process."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, hf_greedy, make_engine
from tests.server_helpers import running_server
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.scheduler import PROMPT_LOGITS_PER_STEP
from tierserve.engine import EngineClient
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
TOP = 3
SCORE = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=TOP)
LONG = " ".join(f"{PROMPTS[4]} {i}" for i in range(4))  # about 330 tokens (the checkpoint's context: 512)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


@pytest.fixture(scope="module")
def reference(llama):
    """``log_softmax`` (float32) of transformers' logits at every position of a prompt, by token ids."""
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    rows: dict[tuple[int, ...], torch.Tensor] = {}

    def of(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in rows:
            with torch.inference_mode():
                rows[tuple(ids)] = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return rows[tuple(ids)]

    return of


def assert_exact(scored, ids: list[int], table: torch.Tensor, top_n: int = TOP) -> None:
    """Every prompt token after the first: its logprob, rank and top alternatives as transformers has them."""
    assert scored is not None and len(scored) == len(ids) - 1
    for position, item in enumerate(scored):
        row, token = table[position], ids[position + 1]
        assert item.token_id == token
        assert item.logprob == pytest.approx(float(row[token]), abs=TOLERANCE), position
        above = int((row > row[token] + TOLERANCE).sum())  # the rank, give or take near-ties
        assert above + 1 <= item.rank <= int((row >= row[token] - TOLERANCE).sum()), position
        assert [lp for _, lp in item.top_logprobs] == pytest.approx(row.topk(top_n).values.tolist(), abs=TOLERANCE)
        assert all(float(row[t]) == pytest.approx(lp, abs=TOLERANCE) for t, lp in item.top_logprobs)


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_prompt_logprobs_equal_transformers_fresh_and_after_the_prefix_was_cached(llama, reference, backend):
    engine = make_engine(llama, backend=backend)
    assert engine.info.backend == backend and engine.info.paged
    for prompt in (PROMPTS[1], PROMPTS[4], LONG):
        [scored] = engine.generate([prompt], SCORE)
        assert scored.token_ids == [] and scored.finish_reason == "length"
        assert_exact(scored.prompt_logprobs, scored.prompt_token_ids, reference(scored.prompt_token_ids))

    # four long prompts fit one step's token budget (2048), but each scored position returns a logits row: a
    # step scores at most PROMPT_LOGITS_PER_STEP of them, so the logits of a step take bounded memory
    steps = engine.stats().counters.steps
    results = engine.generate([f"{i} {LONG}" for i in range(4)], SCORE)
    positions = sum(len(r.prompt_token_ids) - 1 for r in results)
    assert sum(len(r.prompt_token_ids) for r in results) <= 2048 and positions > 2 * PROMPT_LOGITS_PER_STEP
    assert engine.stats().counters.steps - steps == -(-positions // PROMPT_LOGITS_PER_STEP)
    for result in results:
        assert_exact(result.prompt_logprobs, result.prompt_token_ids, reference(result.prompt_token_ids))

    prompt = PROMPTS[3]
    [plain] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    [again] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert again.cached_tokens > 0  # the prefix is cached now
    asked = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
    [scored] = engine.generate([prompt], asked)
    assert scored.cached_tokens == 0  # cached blocks keep no logits: the prompt is recomputed
    assert_exact(scored.prompt_logprobs, scored.prompt_token_ids, reference(scored.prompt_token_ids))
    assert scored.token_ids == plain.token_ids  # the output after the prompt is unchanged
    [after] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert after.cached_tokens > 0 and after.prompt_logprobs is None
    assert_pool_released(engine)
    engine.close()


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_chunked_prefill_and_preemption_keep_them_exact(llama, reference, backend):
    # 24 blocks of 4 tokens cannot hold all eight prompts at once: the scheduler preempts, and the
    # 16-token budget splits every long prompt into chunks
    engine = make_engine(
        llama, backend=backend, kv_cache__block_size=4, kv_cache__l1_capacity=24, scheduler__max_num_batched_tokens=16
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)
    results = engine.generate(PROMPTS, greedy)
    assert engine.stats().counters.preemptions > 0
    assert [r.token_ids for r in results] == hf_greedy(llama, PROMPTS, 12)
    for result in results:
        assert_exact(result.prompt_logprobs, result.prompt_token_ids, reference(result.prompt_token_ids))
    assert_pool_released(engine)
    engine.close()


def test_sampled_output_is_the_same_with_prompt_logprobs(llama):
    engine = make_engine(llama)
    sampled = dict(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    [plain] = engine.generate([PROMPTS[6]], SamplingParams(**sampled))
    [scored] = engine.generate([PROMPTS[6]], SamplingParams(**sampled, prompt_logprobs=0, logprobs=2))
    assert scored.token_ids == plain.token_ids
    assert all(item.top_logprobs == [] for item in scored.prompt_logprobs)  # 0: the prompt token's own only
    assert len(scored.logprobs) == 10
    [one] = engine.generate(["x"], SamplingParams(max_tokens=0, prompt_logprobs=2))  # one token: nothing to score
    assert one.prompt_logprobs == [] and one.token_ids == []
    engine.close()


def test_the_engine_core_in_its_own_process(llama, reference):
    overrides = {("model", "path"): str(llama), ("model", "device"): "cpu"}
    loaded = load_settings(None, environ={}, overrides=overrides)
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=True)
    try:
        results = engine.generate([PROMPTS[4], PROMPTS[1]], [SCORE, SamplingParams(max_tokens=3, prompt_logprobs=1)])
        for result, top_n in zip(results, (TOP, 1)):
            assert_exact(result.prompt_logprobs, result.prompt_token_ids, reference(result.prompt_token_ids), top_n)
        assert results[1].token_ids and len(results[1].token_ids) <= 3
    finally:
        engine.close()


# ---- over HTTP ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama):
    overrides = {("model", "path"): str(llama), ("model", "device"): "cpu", ("logging", "level"): "warning"}
    loaded = load_settings(None, environ={}, overrides=overrides)
    engine = make_engine(llama)
    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
        yield base, engine
    engine.close()


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=120)


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(server, reference):
    base, engine = server
    prompt = PROMPTS[6]
    ids = engine.encode_prompt(prompt)
    reply = post(base, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert reply.status_code == 200, reply.text
    [choice] = reply.json()["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert reply.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                                     "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [engine.token_text(t) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    table = reference(ids)
    for position, (value, top) in enumerate(zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:])):
        assert value == pytest.approx(float(table[position][ids[position + 1]]), abs=TOLERANCE)
        assert sorted(top.values(), reverse=True) == pytest.approx(table[position].topk(2).values.tolist(), abs=TOLERANCE)
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for start, end, token in zip(offsets, [*offsets[1:], len(choice["text"])], logprobs["tokens"]):
        assert choice["text"][start:end] == token


def test_echo_with_logprobs_and_generation(server):
    base, engine = server
    prompt = "Q: What is the capital of France?\nA:"
    body = {"prompt": prompt, "logprobs": 1, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post(base, "/v1/completions", body).json()["choices"][0]
    echoed = post(base, "/v1/completions", {**body, "echo": True}).json()["choices"][0]
    prompt_tokens = len(engine.encode_prompt(prompt))
    assert echoed["text"] == prompt + plain["text"]
    logprobs = echoed["logprobs"]
    assert len(logprobs["tokens"]) == prompt_tokens + 4
    assert logprobs["token_logprobs"][0] is None and None not in logprobs["token_logprobs"][1:]
    assert logprobs["tokens"][prompt_tokens:] == plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][prompt_tokens:] == plain["logprobs"]["token_logprobs"]
    assert logprobs["top_logprobs"][prompt_tokens:] == plain["logprobs"]["top_logprobs"]
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[prompt_tokens] == len(prompt)  # the output's follow the prompt's
    for start, token in zip(offsets[:prompt_tokens], logprobs["tokens"]):
        assert echoed["text"][start : start + len(token)] == token

    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "echo": True, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [event["choices"][0] for event in events if event["choices"]]
    assert "".join(c["text"] for c in streamed) == echoed["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert [x for c in streamed for x in c["logprobs"][key]] == logprobs[key], key
    assert streamed[0]["logprobs"]["text_offset"] == offsets[:prompt_tokens]  # the echo's event: the prompt's


def test_lm_eval_style_batches_of_token_ids(server, reference):
    """lm-evaluation-harness's ``local-completions`` loglikelihood request: token-id prompts, one generated token,
    the continuation's logprobs summed from ``token_logprobs[context:-1]``."""
    base, engine = server
    contexts = [engine.encode_prompt("The capital of France is"), engine.encode_prompt("1 2 3 4")]
    prompts = [engine.encode_prompt("The capital of France is Paris"), engine.encode_prompt("1 2 3 4 5 6")]
    assert all(ids[: len(context)] == context for ids, context in zip(prompts, contexts))
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    reply = post(base, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    for choice, context, ids in zip(choices, contexts, prompts):
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == len(ids) + 1
        table = reference(ids)
        expected = sum(float(table[p - 1][ids[p]]) for p in range(len(context), len(ids)))
        assert sum(token_logprobs[len(context) : -1]) == pytest.approx(expected, abs=TOLERANCE * len(ids))
        for value, top in zip(token_logprobs[len(context) : -1], choice["logprobs"]["top_logprobs"][len(context) : -1]):
            assert len(top) == 1 and max(top.values()) >= value  # lm-eval's is_greedy reads this


def test_vllm_prompt_logprobs_on_completions_and_chat(server, reference):
    base, engine = server
    prompt = PROMPTS[1]
    ids = engine.encode_prompt(prompt)
    reply = post(base, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 2, "max_tokens": 2, "n": 2})
    assert reply.status_code == 200, reply.text
    table = reference(ids)
    for choice in reply.json()["choices"]:
        scored = choice["prompt_logprobs"]
        assert choice["logprobs"] is None and len(scored) == len(ids) and scored[0] is None
        for position, entry in enumerate(scored[1:]):
            token = ids[position + 1]
            own = entry[str(token)]
            assert own["logprob"] == pytest.approx(float(table[position][token]), abs=TOLERANCE)
            assert own["decoded_token"] == engine.token_text(token) and own["rank"] >= 1
            assert len(entry) in (2, 3)  # the prompt's token and the top 2 (it may be one of them)
            values = sorted((v["logprob"] for v in entry.values()), reverse=True)
            for best in table[position].topk(2).values.tolist():
                assert any(v == pytest.approx(best, abs=TOLERANCE) for v in values)
            ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token))
            assert set(ranks) <= {1, 2}

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = post(base, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0, "max_tokens": 0})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    chat_ids = engine.encode_prompt(messages=messages)
    assert body["choices"][0]["message"]["content"] == "" and body["usage"]["completion_tokens"] == 0
    assert len(body["prompt_logprobs"]) == len(chat_ids) == body["usage"]["prompt_tokens"]
    chat_table = reference(chat_ids)
    for position, entry in enumerate(body["prompt_logprobs"][1:]):
        [(token, own)] = entry.items()
        assert int(token) == chat_ids[position + 1]
        assert own["logprob"] == pytest.approx(float(chat_table[position][int(token)]), abs=TOLERANCE)


def test_bounds(server):
    base, engine = server
    cases = [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21}, 400,
         "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 21}, 400, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 501, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "beam_width": 2}, 501, "echo"),
    ]  # fmt: skip
    for path, body, status, param in cases:
        reply = post(base, path, body)
        assert reply.status_code == status, (body, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param, (body, error)
        if status == 400 and "logprobs" in param:
            assert "0 to 20" in error["message"], error
    # the prompt may fill the whole context when nothing is generated
    context = engine.info.max_model_len
    full = [7] * context
    scored = post(base, "/v1/completions", {"prompt": full, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert scored.status_code == 200, scored.text
    assert len(scored.json()["choices"][0]["logprobs"]["token_logprobs"]) == context
    over = post(base, "/v1/completions", {"prompt": full, "echo": True, "logprobs": 0, "max_tokens": 1})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    longer = post(base, "/v1/completions", {"prompt": full + [7], "echo": True, "logprobs": 0, "max_tokens": 0})
    assert longer.status_code == 400 and longer.json()["error"]["code"] == "context_length_exceeded"
