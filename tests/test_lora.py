"""LoRA adapters: output equal to transformers + peft, mixed batches, the cache kept apart, load/unload at run time."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.lora_helpers import ALL_MODULES, make_adapter
from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, make_engine
from tests.server_helpers import running_server
from tierserve.settings.config import load_settings
from tierserve.engine import EngineClient
from tierserve.core.errors import ConfigError
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

LONG = PROMPTS[4]  # several blocks: a prefix the cache could share if it did not key adapters apart
MAX_TOKENS = 12


def peft_greedy(checkpoint, adapter, prompt: str) -> list[int]:
    """``generate(do_sample=False)`` of the base model with the adapter applied by peft."""
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = (PeftModel.from_pretrained(base, adapter) if adapter is not None else base).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    checkpoint = build_checkpoint(root, "base", request.param)
    adapters = {
        "attn": make_adapter(checkpoint, root / "attn", 1, ["q_proj", "v_proj"], rank=8, alpha=16),
        "full": make_adapter(checkpoint, root / "full", 2, ALL_MODULES, rank=4, alpha=8, use_rslora=True),
    }
    return checkpoint, adapters


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_one_adapter_equals_peft(setup):
    checkpoint, adapters = setup
    engine = make_engine(checkpoint, backend="native", model__max_loras=1, model__lora_adapters={"attn": str(adapters["attn"])})
    try:
        for prompt in PROMPTS[:3]:
            got = engine.generate([prompt], greedy(), lora_names=["attn"])[0].token_ids
            assert got == peft_greedy(checkpoint, adapters["attn"], prompt)
        assert_pool_released(engine)
    finally:
        engine.close()


def test_mixed_batch_of_two_adapters_and_the_base_model_equals_peft(setup):
    checkpoint, adapters = setup
    engine = make_engine(checkpoint, backend="native", model__max_loras=2, model__max_lora_rank=8)
    try:
        for name, path in adapters.items():
            engine.load_lora(name, str(path))
        prompts = [LONG, PROMPTS[1], LONG, PROMPTS[3], LONG, PROMPTS[6]]
        names = ["attn", "full", None, "attn", "full", None]
        reference = {(p, n): peft_greedy(checkpoint, adapters.get(n), p) for p, n in zip(prompts, names)}
        assert reference[(LONG, "attn")] != reference[(LONG, None)] != reference[(LONG, "full")]
        got = engine.generate(prompts, greedy(), lora_names=names)
        assert [g.token_ids for g in got] == [reference[(p, n)] for p, n in zip(prompts, names)]
        # the long prompt is cached under each adapter, never across: again, each one hits only its own
        again = engine.generate([LONG, LONG, LONG], greedy(), lora_names=["full", None, "attn"])
        assert [g.token_ids for g in again] == [reference[(LONG, n)] for n in ("full", None, "attn")]
        assert all(g.cached_tokens > 0 for g in again)
        assert_pool_released(engine)
    finally:
        engine.close()


def test_unknown_adapter_and_bad_settings_are_clear_errors(setup, tmp_path):
    checkpoint, adapters = setup
    engine = make_engine(checkpoint, backend="native", model__max_loras=1, model__max_lora_rank=4)
    try:
        with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
            engine.generate(["x"], greedy(), lora_names=["nope"])
        with pytest.raises(ValueError, match=r"rank r = 8 is above model.max_lora_rank \(4\)"):
            engine.load_lora("attn", str(adapters["attn"]))
        with pytest.raises(ValueError, match="holds no adapter_config.json"):
            engine.load_lora("x", str(tmp_path))
        engine.load_lora("full", str(adapters["full"]))
        with pytest.raises(ValueError, match=r"all 1 adapter slots are in use"):
            engine.load_lora("full2", str(adapters["full"]))
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="runs no LoRA adapters"):
        make_engine(checkpoint, backend="transformers", model__max_loras=1)
    with pytest.raises(ConfigError, match="raise model.max_loras"):
        make_engine(checkpoint, backend="native", model__lora_adapters={"attn": str(adapters["attn"])})


def test_adapter_loaded_and_unloaded_at_run_time_over_http(setup):
    checkpoint, adapters = setup
    reference = peft_greedy(checkpoint, adapters["attn"], PROMPTS[1])
    overrides = {
        ("model", "path"): str(checkpoint), ("model", "device"): "cpu", ("model", "max_loras"): 2,
        ("server", "engine_process"): False, ("logging", "level"): "warning",
    }  # fmt: skip
    loaded = load_settings(None, environ={}, overrides=overrides)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        body = {"lora_name": "attn", "lora_path": str(adapters["attn"])}
        loaded = httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=60)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["rank"] == 8
        listed = {m["id"]: m for m in httpx.get(f"{base}/v1/models").json()["data"]}
        assert listed["attn"]["parent"] == str(checkpoint) and listed["attn"]["lora_rank"] == 8
        ask = {"model": "attn", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        answer = httpx.post(f"{base}/v1/completions", json=ask, timeout=60).json()
        assert answer["model"] == "attn"
        assert answer["choices"][0]["text"] == tokenizer.decode(reference)
        again = httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=60)
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        missing = httpx.post(f"{base}/v1/load_lora_adapter", json={**body, "lora_name": "b", "lora_path": "/nonexistent"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        unloaded = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "attn"}, timeout=60)
        assert unloaded.status_code == 200 and unloaded.json()["unloaded"] is True
        gone = httpx.post(f"{base}/v1/completions", json=ask, timeout=60)
        assert gone.status_code == 404 and "attn" in gone.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 404
        # the slot is free again: load it back under a new name
        reloaded = httpx.post(f"{base}/v1/load_lora_adapter", json={**body, "lora_name": "attn2"}, timeout=60)
        assert reloaded.status_code == 200, reloaded.text
        answer = httpx.post(f"{base}/v1/completions", json={**ask, "model": "attn2"}, timeout=60).json()
        assert answer["choices"][0]["text"] == tokenizer.decode(reference)


def test_adapter_files_refused_with_the_feature_named(setup, tmp_path):
    checkpoint, adapters = setup
    bad = tmp_path / "dora"
    bad.mkdir()
    config = json.loads((adapters["attn"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes((adapters["attn"] / "adapter_model.safetensors").read_bytes())
    engine = make_engine(checkpoint, backend="native", model__max_loras=1)
    try:
        with pytest.raises(ValueError, match="use_dora"):
            engine.load_lora("dora", str(bad))
        (bad / "adapter_config.json").write_text(json.dumps(config))
        (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
        with pytest.raises(ValueError, match="not a readable safetensors file"):
            engine.load_lora("dora", str(bad))
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"r": None}, "r must be a positive integer"),
        ({"r": "abc"}, "r must be a positive integer"),
        ({"r": 2.5}, "r must be a positive integer"),
        ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number"),
        ({"lora_alpha": "16"}, "lora_alpha must be a finite number"),
        ("a list", "holds a JSON list"),
        ("nan weights", "NaN or infinite"),
        ("1-D weights", "1-D"),
    ],
)  # fmt: skip
def test_malformed_adapters_are_refused_naming_what_is_wrong(setup, tmp_path, change, says):
    """Settings of the wrong type, a config that is no object, 1-D or non-finite weights: a clear refusal (a 400
    over HTTP), where they were a 500 or loaded and then generated nothing."""
    from safetensors.torch import load_file, save_file

    checkpoint, adapters = setup
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((adapters["attn"] / "adapter_config.json").read_text())
    tensors = load_file(str(adapters["attn"] / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    if change == "a list":
        config = [config]
    elif change == "nan weights":
        tensors[first] = tensors[first].clone().fill_(float("nan"))
    elif change == "1-D weights":
        tensors[first] = tensors[first].flatten()
    else:
        config = {**config, **change}
    (bad / "adapter_config.json").write_text(json.dumps(config))  # NaN is written as NaN: Python reads it back
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    engine = make_engine(checkpoint, backend="native", model__max_loras=1)
    try:
        with pytest.raises(ValueError, match=re.escape(says)):
            engine.load_lora("bad", str(bad))
    finally:
        engine.close()


def test_adapters_in_an_engine_core_process(setup):
    """The core in its own process: load errors keep their field, and output equals the in-process engine's."""
    checkpoint, adapters = setup
    if "qwen2" in str(checkpoint):
        pytest.skip("one architecture is enough for the process boundary")
    overrides = {("model", "path"): str(checkpoint), ("model", "device"): "cpu", ("model", "max_loras"): 1}
    loaded = load_settings(None, environ={}, overrides=overrides)
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=True)
    try:
        with pytest.raises(ValueError, match="holds no adapter_config.json") as failure:
            engine.load_lora("x", "/nonexistent")
        assert failure.value.param == "lora_path"
        engine.load_lora("attn", str(adapters["attn"]))
        engine.start()
        got = engine.generate([PROMPTS[2]], greedy(), lora_names=["attn"])[0].token_ids
        assert got == peft_greedy(checkpoint, adapters["attn"], PROMPTS[2])
        assert engine.unload_lora("attn") == 0
        with pytest.raises(ValueError, match="no LoRA adapter named 'attn'"):
            engine.generate([PROMPTS[2]], greedy(), lora_names=["attn"])
    finally:
        engine.close()
