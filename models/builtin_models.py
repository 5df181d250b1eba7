"""The embedded models: a deterministic tokenizer and seeded random-weight checkpoints.

Everything here is generated locally, so tierserve runs (and its tests pass)
without a network. ``write_checkpoint`` writes a complete Hugging Face
checkpoint directory — tokenizer, config.json, safetensors weights,
generation_config.json — that every loader reads exactly like a real model.
The weights are random: the text these models produce is gibberish. To serve
a real model, point ``model.path`` at a local Hugging Face checkpoint
directory instead of ``builtin:tiny``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import structlog

from tierserve.models.builtin_tokenizer import (  # noqa: F401  (re-exported: the tokenizer's names are part of this module's API)
    BOS_TOKEN,
    EOS_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TARGET_VOCAB_SIZE,
    CHAT_TEMPLATE,
    CORPUS,
    PRETOKENIZE_REGEX,
    _trained_bpe_json,
    build_tokenizer,
)

log = structlog.get_logger(__name__)

# Seeding is process-global: two threads initialising models at once would
# interleave their random draws.
_INIT_LOCK = threading.Lock()

#: Bump when the bytes a spec produces change for a reason the spec does not
#: show (file layout, template, init scheme); cached builtins are then rebuilt.
FORMAT_VERSION = 1

# -- configs -----------------------------------------------------------------

_LLAMA_FAMILY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    # HF's 0.02 makes a tiny random model's logits nearly uniform, so greedy
    # decoding is decided by near-ties that flip with any numerical noise
    # (batching, kernels). 0.2 spreads the logits (std ~1.6 at hidden 64)
    # while keeping the activations finite.
    "initializer_range": 0.2,
}

#: architecture -> (transformers model class name, default config kwargs).
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", dict(_LLAMA_FAMILY_DEFAULTS)),
    "mistral": ("MistralForCausalLM", {**_LLAMA_FAMILY_DEFAULTS, "sliding_window": 128}),
    # Qwen2 always has q/k/v projection biases.
    "qwen2": ("Qwen2ForCausalLM", dict(_LLAMA_FAMILY_DEFAULTS)),
    # head_dim deliberately differs from hidden_size / num_attention_heads
    # (16), as in the real Qwen3 models, so loaders cannot assume they match.
    "qwen3": ("Qwen3ForCausalLM", {**_LLAMA_FAMILY_DEFAULTS, "head_dim": 32}),
    "gpt2": (
        "GPT2LMHeadModel",
        {
            "n_embd": 64,
            "n_inner": 128,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 512,
            "tie_word_embeddings": True,
            "initializer_range": 0.2,
        },
    ),
    # the architectures below run on the paged ``transformers`` backend (bloom: on the unpaged one)
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            **_LLAMA_FAMILY_DEFAULTS,
            "num_hidden_layers": 4,  # sliding and global layers alternate
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 16,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "phi3": ("Phi3ForCausalLM", dict(_LLAMA_FAMILY_DEFAULTS)),  # fused qkv and gate/up projections
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "rotary_pct": 0.25,  # rotary on a quarter of each head
            "max_position_embeddings": 512,
            "initializer_range": 0.2,
        },
    ),
    "bloom": ("BloomForCausalLM", {"hidden_size": 64, "n_layer": 2, "n_head": 4, "initializer_range": 0.2}),  # ALiBi
}


def _architecture(architecture: str) -> tuple[str, dict[str, Any]]:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"unknown architecture {architecture!r}; available: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def _special_token_ids() -> dict[str, int]:
    # The trainer assigns special tokens the first ids, in SPECIAL_TOKENS order.
    return {token: index for index, token in enumerate(SPECIAL_TOKENS)}


def checkpoint_config(architecture: str = "llama", **config_overrides: Any) -> Any:
    """Return the transformers config ``write_checkpoint`` would write.

    Defaults come from ``ARCHITECTURES``; ``vocab_size`` and the bos/eos/pad
    ids come from the builtin tokenizer; ``config_overrides`` win over both.
    Useful on its own to inspect a model (e.g. count parameters on the meta
    device) without materialising weights.
    """
    import transformers

    class_name, defaults = _architecture(architecture)
    model_class = getattr(transformers, class_name)
    ids = _special_token_ids()
    kwargs: dict[str, Any] = {
        **defaults,
        "vocab_size": len(build_tokenizer()),
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        **config_overrides,
    }
    return model_class.config_class(**kwargs)


def _generation_config() -> Any:
    from transformers import GenerationConfig

    ids = _special_token_ids()
    return GenerationConfig(
        bos_token_id=ids[BOS_TOKEN],
        # Base-model text ends with <|end_of_text|>, chat turns with <|im_end|>.
        eos_token_id=[ids[EOS_TOKEN], ids[IM_END_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
    )


# -- writing -------------------------------------------------------------------


def write_checkpoint(
    directory: str | os.PathLike[str],
    architecture: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: int | str | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a complete Hugging Face checkpoint of a seeded random model.

    The directory gets the tokenizer files (``tokenizer.json``,
    ``tokenizer_config.json``, chat template), ``config.json``, the weights as
    safetensors (sharded with ``model.safetensors.index.json`` when
    ``max_shard_size`` is given and exceeded) and ``generation_config.json``
    whose ``eos_token_id`` is ``[<|end_of_text|>, <|im_end|>]``. A qwen2
    checkpoint's tokenizer NFC-normalises its input, because the tokenizer
    class ``AutoTokenizer`` picks for qwen2 always does.

    Weights are transformers' own initialisation under ``torch.manual_seed(seed)``
    (float32), so one seed gives the same weights with the same transformers
    version. The file set appears atomically: it is written into a hidden
    sibling directory, flushed to disk, then renamed into place, so a crash
    never leaves a half-written checkpoint at ``directory``. When another
    writer wins the race to the same path, its (complete) checkpoint is kept.

    Args:
        directory: the checkpoint directory to create; it must not exist or be empty.
        architecture: one of ``ARCHITECTURES`` (llama, mistral, qwen2, qwen3, gpt2, gemma2, phi3, gpt_neox, bloom).
        seed: the torch seed for weight initialisation.
        max_shard_size: passed to ``save_pretrained`` (e.g. ``"200KB"``).
        **config_overrides: config keys that win over the defaults, e.g.
            ``num_hidden_layers=3``, ``tie_word_embeddings=True``,
            ``rope_scaling={"rope_type": "linear", "factor": 2.0}``.

    Returns:
        The absolute checkpoint directory.

    Raises:
        ValueError: unknown architecture.
        FileExistsError: ``directory`` exists and is not an empty directory.
    """
    target = Path(directory).expanduser().absolute()
    if target.exists() and not _is_empty_dir(target):
        raise FileExistsError(
            f"{target} already exists and is not an empty directory; remove it or choose another path"
        )
    config = checkpoint_config(architecture, **config_overrides)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(target)
    staging = target.parent / f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _write_files(staging, architecture, config, seed, max_shard_size)
        _fsync_tree(staging)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_files(
    directory: Path, architecture: str, config: Any, seed: int, max_shard_size: int | str | None
) -> None:
    import torch
    import transformers

    model_class = getattr(transformers, _architecture(architecture)[0])
    # fork_rng leaves the caller's global RNG state as it was.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32).eval()
    model.generation_config = _generation_config()
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(directory, **save_kwargs)
    tokenizer = build_tokenizer(nfc=architecture == "qwen2")
    # ALiBi models (bloom) have no position table, so no length limit of their own
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
    tokenizer.save_pretrained(directory)
    # Tokenizer classes that rebuild from vocab + merges (Qwen2's, which
    # AutoTokenizer picks for model_type qwen2) otherwise add their default
    # unk token, making the vocabulary one larger than the embedding.
    tokenizer_config = directory / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    settings["unk_token"] = None
    tokenizer_config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _move_into_place(staging: Path, target: Path) -> None:
    if target.is_dir() and _is_empty_dir(target):
        # POSIX rename replaces an empty directory, Windows does not; and a
        # concurrent writer may fill it first, in which case rmdir fails.
        try:
            target.rmdir()
        except OSError:
            pass
    try:
        os.rename(staging, target)
    except OSError:
        if not is_complete_checkpoint(target):
            raise
        log.info("checkpoint written concurrently by another process; keeping it", path=str(target))
        return
    _fsync_dir(target.parent)


def is_complete_checkpoint(directory: Path) -> bool:
    """True when ``directory`` holds config, weights and tokenizer files."""
    has_weights = (directory / "model.safetensors").is_file() or (
        directory / "model.safetensors.index.json"
    ).is_file()
    return has_weights and all(
        (directory / name).is_file() for name in ("config.json", "tokenizer.json", "generation_config.json")
    )


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _remove_stale_partials(target: Path, max_age_seconds: float = 24 * 3600) -> None:
    # Left behind by a writer that crashed; a live writer finishes in far less.
    cutoff = time.time() - max_age_seconds
    for partial in target.parent.glob(f".{target.name}.partial-*"):
        try:
            if partial.stat().st_mtime < cutoff:
                shutil.rmtree(partial, ignore_errors=True)
        except OSError:
            pass


def _fsync_tree(root: Path) -> None:
    # Without this a power loss after the rename can leave the renamed
    # directory with empty or truncated files.
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # directories cannot be opened on Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- builtins ------------------------------------------------------------------

#: name -> spec: ``architecture``, ``seed`` and ``config`` overrides on top of
#: the architecture defaults.
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    # Llama, hidden 64, 2 layers, 4 heads / 2 kv heads: 336,192 parameters.
    "tiny": {"architecture": "llama", "seed": 0, "config": {}},
    # Llama with 106,973,952 parameters (vocab 2048, untied embeddings):
    # 12 layers x 8,652,288 (attention 1,572,864 + MLP 7,077,888 + norms 1,536)
    # + 2 x 2048 x 768 embedding/lm_head + 768 final norm. ~428 MB in float32.
    "bench": {
        "architecture": "llama",
        "seed": 0,
        "config": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "max_position_embeddings": 4096,
            "initializer_range": 0.02,
        },
    },
    # The fleet bench's checkpoint: Llama, hidden 256, 4 layers, 4 heads / 2 kv
    # heads of 64, MLP 1024; 4,983,040 parameters. A 1,024-token prompt costs
    # about a tenth of a second on one core: on 2 cores shared by 4 replicas a
    # miss shows in TTFT while the machine stays short of saturation.
    "fleet": {
        "architecture": "llama",
        "seed": 0,
        "config": {
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "initializer_range": 0.02,
        },
    },
    # GPT-2 small's shape with the builtin tokenizer's vocabulary: 12 layers,
    # hidden 768, 12 heads, 1024 positions; 87,415,296 parameters (tied
    # embeddings). It runs on the paged transformers backend (no native layers).
    "bench-gpt2": {
        "architecture": "gpt2",
        "seed": 0,
        "config": {
            "n_embd": 768,
            "n_inner": 3072,
            "n_layer": 12,
            "n_head": 12,
            "n_positions": 1024,
            "initializer_range": 0.02,
        },
    },
    # The shape of Qwen2.5-0.5B (random weights): vocab 151,936 tied to the
    # embedding, 24 layers, hidden 896, MLP 4864, GQA 14/2 heads of 64, qkv
    # biases. 494,032,768 parameters, ~2 GB in float32; at this size the vocab
    # projection and memory bandwidth dominate a step, not Python.
    "bench-qwen": {
        "architecture": "qwen2",
        "seed": 0,
        "config": {
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "initializer_range": 0.02,
        },
    },
}


def _builtin_spec(name: str) -> dict[str, Any]:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown builtin model {name!r}; available: {', '.join(sorted(BUILTIN_MODELS))}"
        ) from None


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """tierserve's cache root: ``cache_dir``, else ``$TIERSERVE_CACHE_DIR``, else the user cache dir."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("TIERSERVE_CACHE_DIR"):
        return Path(os.environ["TIERSERVE_CACHE_DIR"]).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("tierserve"))


def spec_hash(name: str) -> str:
    """A short hash of everything that decides a builtin's bytes.

    Covers the spec, the architecture defaults it builds on, the tokenizer
    corpus, the chat template and ``FORMAT_VERSION``, so changing any of them
    gives the builtin a new cache directory instead of reusing stale files.
    """
    spec = _builtin_spec(name)
    identity = {
        "format": FORMAT_VERSION,
        "spec": spec,
        "defaults": _architecture(spec["architecture"])[1],
        "corpus": hashlib.sha256(CORPUS.encode()).hexdigest(),
        "special_tokens": SPECIAL_TOKENS,
        "vocab": TARGET_VOCAB_SIZE,
        "chat_template": CHAT_TEMPLATE,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def builtin_checkpoint_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where builtin ``name`` lives: ``<cache root>/models/<name>-<spec hash>``."""
    return cache_root(cache_dir) / "models" / f"{name}-{spec_hash(name)}"


def ensure_builtin_checkpoint(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the checkpoint directory of builtin ``name``, writing it on first use.

    Args:
        name: a key of ``BUILTIN_MODELS`` (``"tiny"``, ``"bench"``).
        cache_dir: the cache root; defaults to ``$TIERSERVE_CACHE_DIR`` or
            ``platformdirs.user_cache_dir("tierserve")``.

    Raises:
        ValueError: ``name`` is not a builtin; the message lists the builtins.
    """
    spec = _builtin_spec(name)
    target = builtin_checkpoint_dir(name, cache_dir)
    if is_complete_checkpoint(target):
        return target
    log.info(
        "writing builtin model with random weights (its output is gibberish); "
        "set model.path to a local Hugging Face checkpoint for a real model",
        model=name,
        path=str(target),
    )
    if "torch" not in sys.modules:
        # The HTTP server process never loads torch (it only tokenizes): a child writes the weights.
        _write_in_child(name, cache_root(cache_dir))
        if is_complete_checkpoint(target):
            return target
    try:
        return write_checkpoint(
            target, spec["architecture"], seed=spec["seed"], **spec["config"]
        )
    except FileExistsError:
        if is_complete_checkpoint(target):  # a concurrent writer finished first
            return target
        raise FileExistsError(
            f"{target} exists but is not a complete checkpoint; delete it so the builtin "
            f"model {name!r} is written again"
        ) from None


def _write_in_child(name: str, cache_dir: Path) -> None:
    """Write builtin ``name`` from a fresh interpreter, so this process does not import torch."""
    # the child imports torch first, so it writes the weights itself instead of starting a child of its own
    code = (
        "import sys, torch; from tierserve.models.builtin_models import ensure_builtin_checkpoint as e; "
        "e(sys.argv[1], sys.argv[2])"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, name, str(cache_dir)], capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        log.warning("builtin_write_in_child_failed", model=name, error="no checkpoint after 600 s")
        return
    if done.returncode != 0:
        log.warning("builtin_write_in_child_failed", model=name, error=done.stderr.strip()[-2000:])
