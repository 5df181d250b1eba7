"""The embedded tokenizer and seeded checkpoints, and how model.path resolves to a directory."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tierserve.models import builtin_models
from tierserve.models.builtin_models import (
    BUILTIN_MODELS,
    build_tokenizer,
    builtin_checkpoint_dir,
    checkpoint_config,
    ensure_builtin_checkpoint,
    write_checkpoint,
)
from tierserve.models.checkpoints import load_generation_eos_ids, resolve_model_path
from tierserve.core.errors import ConfigError

pytestmark = pytest.mark.integration

TEXTS = [
    "The lighthouse keeper climbed the ninety-nine steps.",
    "  two leading spaces,\ttabs\nand\r\nnewlines  \n",
    "café, naïve, crème brûlée, São Paulo, Zürich, Москва",
    "日本語 and 東京駅 are not in ASCII; neither is 🚀 or 👍🏽 or ❤️.",
    "def f(x: int) -> int:\n    return x ** 2  # 12345.678",
    "unseen words: xylophone quizzical Ωμέγα",
    "decomposed (not NFC): cafe\u0301 nai\u0308ve",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(root))
    return root


def weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


# -- tokenizer -------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert max(ids) < len(tokenizer)


def test_tokenizer_round_trips_arbitrary_unicode(tokenizer):
    text = "".join(chr(c) for c in range(1, 0x250)) + "\u0301e\u0301 \U0001f600"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == builtin_models.TARGET_VOCAB_SIZE == 2048
    assert tokenizer.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    ) == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 4)
    # Special-token strings in the text become their single ids.
    assert tokenizer.encode("a<|im_end|>b")[1] == 3


def test_tokenizer_adds_no_bos_or_eos(tokenizer):
    plain = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.encode("Hello world") == plain
    assert tokenizer("Hello world")["input_ids"] == plain
    assert not {0, 1} & set(plain)


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi to the café."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nSay hi to the café.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.encode(text)
    assert ids[0] == 2 and ids.count(2) == 3 and ids.count(3) == 2
    assert tokenizer.decode(ids) == text


def test_chat_template_joins_text_parts(tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_tokenizer_is_deterministic(tmp_path):
    build_tokenizer().save_pretrained(tmp_path / "a")
    builtin_models._trained_bpe_json.cache_clear()  # train again, not from the cache
    build_tokenizer().save_pretrained(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


# -- checkpoints -----------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_each_architecture_loads_back_and_generates(tmp_path, architecture):
    directory = write_checkpoint(tmp_path / architecture, architecture)
    expected_class = builtin_models.ARCHITECTURES[architecture][0]

    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert type(model).__name__ == expected_class
    assert model.dtype == torch.float32
    assert len(tokenizer) == model.config.vocab_size == 2048

    # Whatever tokenizer class AutoTokenizer picks (Qwen2's rebuilds from vocab
    # and merges) encodes exactly like ours and like the raw tokenizer.json.
    reference = build_tokenizer(nfc=architecture == "qwen2")
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text) == raw.encode(text).ids

    generation = GenerationConfig.from_pretrained(directory)
    assert generation.eos_token_id == [1, 3] and generation.bos_token_id == 0

    prompt = tokenizer("The morning train", return_tensors="pt")
    out = model.generate(**prompt, min_new_tokens=4, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt.input_ids.shape[1] + 4)
    assert tokenizer.decode(out[0]).startswith("The morning train")


def test_architecture_specifics_reach_the_config(tmp_path):
    mistral = write_checkpoint(tmp_path / "mistral", "mistral")
    assert json.loads((mistral / "config.json").read_text())["sliding_window"] == 128

    qwen2 = weights(write_checkpoint(tmp_path / "qwen2", "qwen2"))
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2

    qwen3_dir = write_checkpoint(tmp_path / "qwen3", "qwen3")
    config = json.loads((qwen3_dir / "config.json").read_text())
    assert config["head_dim"] == 32 != config["hidden_size"] // config["num_attention_heads"]
    qwen3 = weights(qwen3_dir)
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3

    llama = json.loads((write_checkpoint(tmp_path / "llama") / "config.json").read_text())
    assert llama["num_key_value_heads"] == 2 and llama["tie_word_embeddings"] is False
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["intermediate_size"]) == (64, 2, 128)


def test_config_overrides_pass_through(tmp_path):
    directory = write_checkpoint(
        tmp_path / "custom",
        num_hidden_layers=3,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.config.num_hidden_layers == 3
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    rope = getattr(model.config, "rope_parameters", None) or model.config.rope_scaling
    assert rope["rope_type"] == "linear" and rope["factor"] == 2.0


def test_unknown_architecture_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="available: bloom, gemma2, gpt2, gpt_neox, llama, mistral, phi3, qwen2, qwen3"):
        write_checkpoint(tmp_path / "x", "falcon")
    assert not (tmp_path / "x").exists()


def test_sharded_checkpoint_has_index_and_loads_back(tmp_path, tiny_dir):
    directory = write_checkpoint(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert set(index["weight_map"].values()) == {shard.name for shard in shards}

    sharded = AutoModelForCausalLM.from_pretrained(directory)
    single = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ids = torch.tensor([[5, 300, 1000, 42]])
    with torch.no_grad():
        assert torch.equal(sharded(ids).logits, single(ids).logits)


def test_seed_decides_the_weights(tmp_path, tiny_dir):
    same = weights(write_checkpoint(tmp_path / "same", seed=0))
    other = weights(write_checkpoint(tmp_path / "other", seed=1))
    reference = weights(tiny_dir)
    assert same.keys() == reference.keys() == other.keys()
    assert all(torch.equal(same[name], reference[name]) for name in reference)
    assert not torch.equal(other["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])
    assert not torch.equal(other["lm_head.weight"], reference["lm_head.weight"])


def test_writing_refuses_a_non_empty_directory_and_accepts_an_empty_one(tmp_path):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        write_checkpoint(occupied)
    assert [p.name for p in occupied.iterdir()] == ["notes.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert (write_checkpoint(empty) / "config.json").is_file()


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(type(build_tokenizer()), "save_pretrained", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        write_checkpoint(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_tiny_greedy_generation_is_not_degenerate(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = ["The morning train", "Hello, how are you?", "def fibonacci(n):", "日本語", "Once upon a time"]
    distinct = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
        distinct.append(len(set(out[0, ids.input_ids.shape[1] :].tolist())))
    assert sum(count >= 3 for count in distinct) >= 4, distinct


# -- builtins ----------------------------------------------------------------------


def test_builtin_tiny_is_written_once_and_cached(cache_root):
    first = ensure_builtin_checkpoint("tiny")
    assert first.parent == cache_root / "models"
    assert first.name.startswith("tiny-")
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= stamps.keys()

    second = ensure_builtin_checkpoint("tiny")
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == stamps
    assert [p.name for p in (cache_root / "models").iterdir()] == [first.name]  # no partial dirs
    assert resolve_model_path("builtin:tiny") == first
    assert load_generation_eos_ids(first) == {1, 3}


def test_cache_dir_argument_wins_over_the_environment(cache_root, tmp_path):
    directory = ensure_builtin_checkpoint("tiny", cache_dir=tmp_path / "elsewhere")
    assert directory.parent == tmp_path / "elsewhere" / "models"
    assert not cache_root.exists()


def test_a_changed_spec_gets_a_new_directory(cache_root, monkeypatch):
    before = builtin_checkpoint_dir("tiny")
    monkeypatch.setitem(BUILTIN_MODELS, "tiny", {**BUILTIN_MODELS["tiny"], "seed": 1})
    assert builtin_checkpoint_dir("tiny") != before
    assert builtin_checkpoint_dir("tiny").parent == before.parent == cache_root / "models"


def test_unknown_builtin_lists_the_available_ones(cache_root):
    with pytest.raises(ValueError, match="unknown builtin model 'huge'; available: bench, bench-gpt2, bench-qwen, fleet, tiny"):
        ensure_builtin_checkpoint("huge")
    with pytest.raises(ConfigError, match="available: bench, bench-gpt2, bench-qwen, fleet, tiny"):
        resolve_model_path("builtin:huge")


def test_concurrent_writers_leave_one_valid_checkpoint(cache_root):
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = set(pool.map(lambda _: ensure_builtin_checkpoint("tiny"), range(3)))
    (directory,) = paths
    assert [p.name for p in (cache_root / "models").iterdir()] == [directory.name]
    assert AutoModelForCausalLM.from_pretrained(directory).config.vocab_size == 2048


def test_a_writer_that_loses_the_race_keeps_the_winners_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "model"
    write_files = builtin_models._write_files

    def slow_writer(*args):
        monkeypatch.setattr(builtin_models, "_write_files", write_files)
        write_checkpoint(target, seed=1)  # another writer finishes first
        write_files(*args)

    monkeypatch.setattr(builtin_models, "_write_files", slow_writer)
    assert write_checkpoint(target, seed=0) == target
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    winner = weights(write_checkpoint(tmp_path / "seed1", seed=1))
    kept = weights(target)
    assert all(torch.equal(kept[name], winner[name]) for name in winner)


def test_writing_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    write_checkpoint(tmp_path / "model", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_is_identical_in_another_process(tokenizer):
    script = (
        "import hashlib\n"
        "from tierserve.models.builtin_models import build_tokenizer\n"
        "print('sha=' + hashlib.sha256(build_tokenizer()._tokenizer.to_str().encode()).hexdigest())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("sha="))
    assert line == "sha=" + hashlib.sha256(tokenizer._tokenizer.to_str().encode()).hexdigest()


def test_bench_model_has_about_100m_parameters():
    spec = BUILTIN_MODELS["bench"]
    config = checkpoint_config(spec["architecture"], **spec["config"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 106_973_952


# -- resolve_model_path / load_generation_eos_ids ---------------------------------


def test_resolve_rejects_a_missing_directory(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_model_path(str(tmp_path / "nope"))
    message = str(info.value)
    assert "does not exist" in message and "builtin:tiny" in message and "smollm2" in message and "org/name" in message


def test_resolve_rejects_a_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="has no config.json") as info:
        resolve_model_path(str(tmp_path))
    assert "local Hugging Face checkpoint directory" in str(info.value)


def test_resolve_rejects_a_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a directory"):
        resolve_model_path(str(tmp_path / "config.json"))


def test_resolve_accepts_a_checkpoint_directory_and_expands_home(tiny_dir, monkeypatch):
    assert resolve_model_path(str(tiny_dir)) == tiny_dir
    monkeypatch.setenv("HOME", str(tiny_dir.parent))
    assert resolve_model_path("~/tiny") == tiny_dir


@pytest.mark.parametrize(
    ("generation", "config", "expected"),
    [
        ({"eos_token_id": [7, 9]}, {"eos_token_id": 2}, {2, 7, 9}),
        ({"eos_token_id": 5}, {}, {5}),
        (None, {"eos_token_id": [3]}, {3}),
        (None, {"text_config": {"eos_token_id": 11}}, {11}),
        (None, None, set()),
    ],
)
def test_eos_ids_merge_generation_config_and_config(tmp_path, generation, config, expected):
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_generation_eos_ids(tmp_path) == expected


def test_eos_ids_reject_a_malformed_value(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ConfigError, match="eos_token_id must be an int or a list of ints"):
        load_generation_eos_ids(tmp_path)
