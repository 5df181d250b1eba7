"""A real instruct model, SmolLM2-135M-Instruct (GGUF Q4_1), served by ``tierserve serve`` and asked real things.

Greedy tokens equal transformers' ``generate()`` on the same file (both dequantize it to float32); factual
questions come back right through the official OpenAI client; the file's chat template and end-of-turn token
are used (no control token leaks into text); structured outputs and required tool calls carry values taken
from the prompt; ngram speculation accepts most drafts on a copy task and changes nothing; a second turn
reuses the first one's prefix and answers the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.server_helpers import free_port, wait_ready

pytestmark = pytest.mark.real_model

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three fruits.",
]


@pytest.fixture(scope="module")
def server(real_model, tmp_path_factory):
    """``tierserve serve --model <the GGUF>`` in float32 (dequantized, as transformers runs it), ngram speculation."""
    port = free_port()
    logs = tmp_path_factory.mktemp("real-model") / "serve.log"
    command = [
        sys.executable, "-m", "tierserve.cli", "serve", "--model", str(real_model), "--port", str(port),
        "--set", 'model.dtype="float32"', "--set", 'model.quantization="none"', "--set", 'model.device="cpu"',
        "--set", 'speculative.method="ngram"', "--set", "speculative.num_speculative_tokens=4",
        "--set", 'model.served_model_name="smollm2"',
    ]  # fmt: skip
    with open(logs, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "CI": ""})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, timeout=300)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=60)
        print(logs.read_text()[-3000:])


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)


def chat(client, content: str, max_tokens: int = 48, **extra):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        **extra,
    )


@pytest.fixture(scope="module")
def transformers_model(real_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model.parent, gguf_file=real_model.name)
    model = AutoModelForCausalLM.from_pretrained(real_model.parent, gguf_file=real_model.name, dtype="float32")
    return tokenizer, model.eval()


def test_greedy_tokens_equal_transformers_generate_on_the_same_file(client, transformers_model):
    for prompt in CHAT_PROMPTS:
        got = chat(client, prompt, max_tokens=24).choices[0].message.content
        assert got == transformers_greedy(transformers_model, prompt, 24), prompt


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("What is the capital of France?", "paris"),
        ("What colour is a clear sky on a sunny day?", "blue"),
        ("How many days are there in a week?", "seven|7"),
    ],
)
def test_factual_questions_are_answered_right(client, question, answer):
    text = chat(client, question).choices[0].message.content.lower()
    assert any(option in text for option in answer.split("|")), text


def test_the_files_chat_template_and_end_of_turn_are_used(client, server):
    reply = chat(client, "Say hello.", max_tokens=64)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", text  # the file's <|im_end|> ended the turn
    assert "<|im_end|>" not in text and "<|im_start|>" not in text
    # the prompt went through the file's template: its default system prompt is in the token count
    system_only = httpx.post(
        f"{server}/v1/completions", json={"model": "smollm2", "prompt": "Say hello.", "max_tokens": 1}, timeout=60
    ).json()
    assert reply.usage.prompt_tokens > system_only["usage"]["prompt_tokens"] + 10
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=64, temperature=0,
            stream=True,
        )
        if chunk.choices
    )
    assert streamed == text


def test_structured_output_and_a_required_tool_call_carry_the_prompts_values(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    reply = chat(
        client, "Tokyo is the capital of Japan. Give the city and the country as JSON.", max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}},
    )
    place = json.loads(reply.choices[0].message.content)
    assert set(place) == {"city", "country"}
    assert "tokyo" in place["city"].lower(), place
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }]  # fmt: skip
    reply = chat(
        client, "What is the weather in Paris right now?", max_tokens=64, tools=tools, tool_choice="required",
        parallel_tool_calls=False,  # one call; left free, the 135M model calls the tool again until max_tokens
    )
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()


def transformers_greedy(transformers_model, content: str, max_new_tokens: int) -> str:
    import torch

    tokenizer, model = transformers_model
    messages = [{"role": "user", "content": content}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_ngram_speculation_accepts_most_drafts_on_a_copy_task_and_stays_exact(server, client, transformers_model):
    paragraph = (
        "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all afternoon, and the fox runs "
        "back into the green forest before the farmer comes home."
    )
    prompt = f"Repeat this text exactly:\n\n{paragraph}"
    before = httpx.get(f"{server}/v1/cache/stats", timeout=30).json()["cache_manager"]["speculation"]
    reply = chat(client, prompt, max_tokens=40)
    after = httpx.get(f"{server}/v1/cache/stats", timeout=30).json()["cache_manager"]["speculation"]
    proposed = after["proposed"] - before["proposed"]
    accepted = after["accepted"] - before["accepted"]
    text = reply.choices[0].message.content
    assert proposed > 0 and accepted / proposed > 0.5, (accepted, proposed, text)
    assert paragraph[:40] in text
    assert text == transformers_greedy(transformers_model, prompt, 40)  # drafts changed nothing


def test_a_second_turn_reuses_the_first_turns_prefix_and_answers_the_same(client):
    question = "Name a large animal that lives in the ocean, and say one fact about it."
    first = chat(client, question, max_tokens=32)
    second = chat(client, question, max_tokens=32)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    follow_up = client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Say it again in fewer words."},
        ],
        max_tokens=16,
        temperature=0,
    )
    assert follow_up.usage.prompt_tokens_details.cached_tokens >= 16


def test_the_readmes_first_command_serves_smollm2_and_it_answers(tmp_path):
    """``tierserve serve --model smollm2``, as the README's set-up command runs it, on the pulled catalogue file."""
    import signal

    from tests.conftest import require_service
    from tierserve.models.catalogue import cached_path, catalogue_entry

    if not cached_path(catalogue_entry("smollm2")).is_file():
        require_service("pulled smollm2", "run `tierserve pull smollm2` (the README's test command does)")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tierserve.cli", "serve", "--model", "smollm2", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "CI": ""},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, timeout=300)
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                  "temperature": 0},
            timeout=120,
        ).json()  # fmt: skip
        assert "Paris" in reply["choices"][0]["message"]["content"], reply
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and "Traceback" not in output, output
