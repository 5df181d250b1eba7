"""Embeddings: the engine's vectors equal Hugging Face's pooled hidden states, and /v1/embeddings serves them."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, hf_greedy, make_engine
from tests.server_helpers import running_server
from tierserve.settings.config import load_settings
from tierserve.engine import RequestError
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def hf_embeddings(path, texts: list[str], *, base_model: bool = False) -> torch.Tensor:
    """Reference: each text alone through transformers, final hidden states mean-pooled and normalised."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model_class = AutoModel if base_model else AutoModelForCausalLM
    model = model_class.from_pretrained(path, dtype=torch.float32).eval()
    vectors = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            out = model(input_ids=ids, output_hidden_states=True)
            hidden = out.last_hidden_state if base_model else out.hidden_states[-1]
            vectors.append(F.normalize(hidden[0].mean(0), dim=-1))
    return torch.stack(vectors)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


@pytest.fixture(scope="module")
def engine(llama):
    return make_engine(llama)


# ---- engine and backends -------------------------------------------------------------------


@pytest.mark.parametrize(
    "architecture, overrides",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 8}),  # shorter than most prompts: the window mask matters
    ],
)
def test_native_equals_hf_reference(tmp_path, architecture, overrides):
    path = build_checkpoint(tmp_path, architecture, architecture, **overrides)
    engine = make_engine(path)
    vectors, tokens = engine.embed(PROMPTS)
    reference = hf_embeddings(path, PROMPTS)
    assert vectors.dtype == torch.float32
    assert vectors.shape == reference.shape == (len(PROMPTS), 64)
    torch.testing.assert_close(vectors, reference, atol=1e-5, rtol=0)
    assert tokens == sum(len(engine.encode_prompt(p)) for p in PROMPTS)


def test_batch_equals_single_and_token_ids_equal_text(llama, engine):
    batch, _ = engine.embed(PROMPTS)
    single = torch.cat([engine.embed([p])[0] for p in PROMPTS])
    torch.testing.assert_close(batch, single, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.linalg.vector_norm(batch, dim=-1), torch.ones(len(PROMPTS)))
    from_ids, _ = engine.embed([engine.encode_prompt(p) for p in PROMPTS])
    torch.testing.assert_close(from_ids, batch, atol=0, rtol=0)
    # A 16-token budget splits the request into many backend calls; the vectors stay the same.
    small_batches = make_engine(llama, scheduler__max_num_batched_tokens=16)
    torch.testing.assert_close(small_batches.embed(PROMPTS)[0], batch, atol=1e-6, rtol=0)
    assert not torch.allclose(batch[0], batch[1])


def test_embedding_leaves_the_kv_arena_untouched(llama):
    engine = make_engine(llama)
    first = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in first] == hf_greedy(llama, PROMPTS, 8)
    backend = engine.driver.core.backend  # white-box: the arena's bytes before and after
    blocks = list(range(engine.info.kv_blocks))
    arena = backend.read_blocks(blocks)
    engine.embed(PROMPTS)
    assert_pool_released(engine)
    assert torch.equal(backend.read_blocks(blocks), arena)
    again = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert any(r.cached_tokens > 0 for r in again)  # the cached prefixes were reused, and still correct


def test_embed_runs_between_steps_while_generating(llama, engine):
    expected, _ = engine.embed(PROMPTS)
    running = make_engine(llama)
    running.start()
    try:
        streams = [running.submit(running.encode_prompt(p), GREEDY)[1] for p in PROMPTS]
        vectors, _ = running.embed(PROMPTS)
        for stream in streams:
            while not stream.get(timeout=30).finished:
                pass
    finally:
        running.shutdown()
    torch.testing.assert_close(vectors, expected, atol=1e-6, rtol=0)
    assert_pool_released(running)


def test_invalid_inputs_are_request_errors(llama):
    engine = make_engine(llama, model__max_model_len=16)
    with pytest.raises(RequestError, match=r"^input: item 1 has \d+ tokens, which exceeds the model's context length 16"):
        engine.embed(["short", PROMPTS[4]])
    with pytest.raises(RequestError, match=r"^input: item 0: token ids must be integers"):
        engine.embed([[1, 10**6]])
    with pytest.raises(RequestError, match=r"^input: item 0 is empty"):
        engine.embed([[]])
    with pytest.raises(RequestError, match=r"^input: must hold at least one"):
        engine.embed([])


def test_transformers_backend_on_gpt2(tmp_path):
    path = build_checkpoint(tmp_path, "g", "gpt2")
    engine = make_engine(path, backend="transformers")
    vectors, _ = engine.embed(PROMPTS)
    assert vectors.shape == (len(PROMPTS), 64)
    torch.testing.assert_close(torch.linalg.vector_norm(vectors, dim=-1), torch.ones(len(PROMPTS)))
    # GPT2Model's last_hidden_state is after ln_f: hidden_states[-1] must be the same thing.
    torch.testing.assert_close(vectors, hf_embeddings(path, PROMPTS, base_model=True), atol=1e-5, rtol=0)
    torch.testing.assert_close(engine.embed(PROMPTS[:1])[0], vectors[:1], atol=1e-6, rtol=0)


def test_transformers_backend_equals_native_on_llama(llama, engine):
    transformers_engine = make_engine(llama, backend="transformers")
    torch.testing.assert_close(transformers_engine.embed(PROMPTS)[0], engine.embed(PROMPTS)[0], atol=1e-5, rtol=0)


# ---- /v1/embeddings ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama):
    overrides = {("model", "path"): str(llama), ("server", "served_model_name"): "tiny-embed"}
    settings = load_settings(None, environ={}, overrides=overrides)
    engine = make_engine(llama)
    with running_server(settings, engine=engine) as base:
        yield base, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def test_openai_client_float_and_base64(server, client):
    _, engine = server
    expected, tokens = engine.embed(["a", "b"])
    result = client.embeddings.create(model="tiny-embed", input=["a", "b"], encoding_format="float")
    assert result.model == "tiny-embed"
    assert [d.index for d in result.data] == [0, 1]
    floats = torch.tensor([d.embedding for d in result.data])
    assert floats.shape == (2, 64)
    torch.testing.assert_close(torch.linalg.vector_norm(floats, dim=-1), torch.ones(2))
    torch.testing.assert_close(floats, expected, atol=0, rtol=0)
    assert result.usage.prompt_tokens == result.usage.total_tokens == tokens
    # The client asks for base64 by default and decodes it itself.
    default = client.embeddings.create(model="tiny-embed", input=["a", "b"])
    assert [d.embedding for d in default.data] == [d.embedding for d in result.data]


def test_base64_is_little_endian_float32(server):
    base, engine = server
    body = {"model": "tiny-embed", "input": [[5, 6, 7]], "encoding_format": "base64", "user": "u", "extra": 1}
    response = httpx.post(f"{base}/v1/embeddings", json=body, timeout=30)
    assert response.status_code == 200
    payload = response.json()
    assert payload["object"] == "list" and payload["data"][0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(payload["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, engine.embed([[5, 6, 7]])[0][0].numpy())
    assert payload["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


def test_model_path_and_single_string_are_accepted(server, llama):
    base, _ = server
    response = httpx.post(f"{base}/v1/embeddings", json={"model": str(llama), "input": "hello", "dimensions": 64}, timeout=30)
    assert response.status_code == 200
    assert len(response.json()["data"]) == 1 and len(response.json()["data"][0]["embedding"]) == 64


def test_wrong_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="gpt-4", input="a")
    error = caught.value.body
    assert caught.value.status_code == 404
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "tiny-embed" in error["message"]


@pytest.mark.parametrize("bad_input", ["", [], [""], [[]]])
def test_empty_input_is_400(client, bad_input):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="tiny-embed", input=bad_input, encoding_format="float")
    assert caught.value.body["param"] == "input"


def test_bad_dimensions_format_and_length_are_400(server):
    base, _ = server
    cases = [
        ({"input": "a", "dimensions": 32}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": PROMPTS[4] * 20}, "input"),  # beyond the 512-token context
    ]
    for body, param in cases:
        response = httpx.post(f"{base}/v1/embeddings", json=body, timeout=30)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
