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
import threading
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# Seeding is process-global: two threads initialising models at once would
# interleave their random draws.
_INIT_LOCK = threading.Lock()

#: Bump when the bytes a spec produces change for a reason the spec does not
#: show (file layout, template, init scheme); cached builtins are then rebuilt.
FORMAT_VERSION = 1

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
#: In id order: the trainer gives special tokens the first ids, so bos=0,
#: eos=1, im_start=2, im_end=3, pad=4.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
TARGET_VOCAB_SIZE = 2048

#: ChatML. Content may be a string or a list of OpenAI-style parts, of which
#: the text parts are joined. No bos token is emitted (Qwen-style).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

#: The tokenizer's training text. Editing it changes every builtin's cache
#: directory (its hash is part of the spec hash).
CORPUS = """\
The morning train to the coast was late again, and nobody on the platform seemed surprised.
A woman in a green coat read the timetable twice, then folded her newspaper and sighed.
"It's always the same," she said to the man beside her. "Ten minutes, they say, and then it's forty."
"At least the coffee is good," he answered, lifting a paper cup. "The café across the street opens at six."
She laughed. "You're naïve if you think that coffee is good. It's warm, which is a different thing."

When the train finally arrived, the carriages were nearly empty. Light came through the windows in long
yellow bands, and the fields outside were covered with frost. A child counted the cows: one, two, three,
four, five, and then gave up because there were too many of them. Her father smiled and wrote the number
12 in the margin of his notebook, next to a list of things he had promised to buy: bread, milk, eggs,
batteries, string, and a birthday card for his sister, who would be thirty-seven on Thursday.

Chapter 2. The Lighthouse

The lighthouse keeper had lived alone for eleven years. Every evening he climbed the ninety-nine steps,
cleaned the lens, wound the clockwork, and wrote a single line in the logbook. Most lines were short:
"Wind from the west. Calm sea." "Fog until noon." "A gull stole my sandwich." On the last page of the
oldest book someone had written, in careful letters, a sentence he read whenever he felt tired:
"We keep the light so that others may find their way home."

Q: What is the capital of France?
A: The capital of France is Paris.
Q: How many days are there in a week?
A: There are seven days in a week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
Q: Why is the sky blue?
A: Sunlight is scattered by the molecules of the air, and blue light is scattered more than red light,
so the sky looks blue during the day and red or orange at sunrise and sunset.
Q: Can you help me write a poem?
A: Of course! Tell me the subject, the mood, and how long you would like it to be.

User: Hello! Could you summarise this article for me?
Assistant: Sure. The article explains how caching works in large language model servers. When a prompt
shares a prefix with an earlier prompt, the server can reuse the attention keys and values it already
computed, which makes the first token arrive much sooner. The author measures the speed-up and finds
that it grows with the length of the shared prefix.
User: Thanks. What are the main risks?
Assistant: The main risks are memory pressure, stale entries after a model update, and mixing up the
caches of different tenants. Each entry should therefore carry a fingerprint of the model and a salt.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


class Cache:
    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self.entries: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.entries.get(key)

    def put(self, key: str, value: bytes) -> None:
        if len(self.entries) >= self.capacity:
            oldest = next(iter(self.entries))
            del self.entries[oldest]
        self.entries[key] = value


for i in range(10):
    print(f"step {i}: loss={1.0 / (i + 1):.4f}")

SELECT name, count(*) AS total FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY total DESC;
{"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
$ pip install tierserve && tierserve serve --preset development --port 8000
if (x > 0 && y < 10) { return x * y; } else { return -1; }

A short history of numbers: people counted on their fingers, then with pebbles, then with marks on
clay tablets. The Babylonians used base sixty, which is why an hour has sixty minutes and a circle has
360 degrees. Zero arrived much later. Today a computer stores every number as bits, ones and zeros,
and a single modern chip performs billions of additions every second.

Recipe: Simple tomato soup (serves 4)
- 1 kg ripe tomatoes, chopped
- 2 onions and 3 cloves of garlic
- 500 ml vegetable stock, a pinch of salt, black pepper, and fresh basil
Fry the onions gently for ten minutes. Add the garlic, then the tomatoes and the stock. Simmer for
twenty-five minutes, blend until smooth, and season to taste. Serve with crusty bread.

Dear Sam,
Thank you for your letter. I was glad to hear that the new job is going well and that the office is
close to the river. We are all fine here. The garden is full of roses this year, and the old apple
tree has finally produced more than three apples. Write again soon!
Best wishes,
Alex

Travel notes. In Tokyo the signs say 日本語 and 東京駅, and the trains run exactly on time. In Paris we
ate crêpes and crème brûlée at a tiny café near the Seine; the waiter called everyone "monsieur" or
"madame". In München the beer gardens were crowded; in Zürich the lake was cold and clear. In Москва
the winter was long. Our friend José from São Paulo sent a photo 📷 of the beach 🏖️ and a message:
"Saudações! 😊" The résumé I wrote last week still needs a better introduction. Prices: €12.50, £9,
¥1200, and $15 — roughly the same, more or less. The temperature was −3 °C; the distance was ½ mile.
Emoji are fun: 🚀 ✨ 🎉 👍 ❤️ 🙂.

Why do we dream? Scientists are not entirely sure. Some believe dreams help us sort memories, keeping
what matters and forgetting what does not. Others think they are simply noise from a brain that never
quite switches off. Either way, most people forget their dreams within minutes of waking, unless they
write them down immediately.

"Are you coming?" asked Maria.
"In a minute," said Tom. "I can't find my keys."
"They're on the table, next to your phone."
"Oh. Right. Thank you!"
"You would lose your head if it weren't attached to your shoulders."

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick
daft zebras jump! Sphinx of black quartz, judge my vow. These sentences use every letter of the alphabet,
which makes them useful for testing fonts, keyboards and, apparently, tokenizers.

Rules of the game: each player starts with seven cards. On your turn, draw one card, then either play a
card that matches the colour or the number of the top card, or pass. The first player to empty their
hand wins the round. Scores are the sum of the cards left in the other players' hands.

Museum guide, room 4: The painting on your left shows a harbour at dusk. Notice how the painter used
only three colours — ochre, umber and a pale grey-blue — yet the water seems to shimmer. The artist
was self-taught, worked as a sailmaker for most of his life, and sold just one picture before he died.
Visitors often ask why the boats have no sailors. Historians disagree; perhaps the crews had gone
ashore for the festival that the small lanterns in the background suggest.

Weather forecast: tomorrow begins cloudy with scattered showers in the north, brightening by the
afternoon. Highs of 14 to 17 degrees, lows near 6 overnight. Strong gusts along exposed coasts,
easing later. The weekend looks drier and warmer, although thunderstorms may develop inland on Sunday.

Interview notes. Candidate explained a binary search tree clearly, wrote a correct merge sort, and
asked thoughtful questions about on-call rotations, code review, testing culture and documentation.
Strengths: communication, curiosity, patience. Concerns: limited experience with distributed systems
and databases; suggested a follow-up conversation with the infrastructure team next Wednesday.

Astronomy club minutes: Jupiter and Saturn were visible low in the south-east after midnight. Priya
brought her new telescope; Omar photographed the Moon's craters and the Orion nebula. Next meeting:
bring warm gloves, a red torch, hot chocolate and star charts. Membership fees remain unchanged.

Error: file not found: /home/user/data/config.toml (check the path and try again)
Warning: 3 requests were retried after a timeout of 30 seconds.
INFO 2024-05-01 12:00:00 server started on http://127.0.0.1:8000
"""


#: Qwen2's split pattern, and the same byte-level set-up as its tokenizer
#: class: transformers' ``AutoTokenizer`` rebuilds a qwen2 checkpoint's
#: tokenizer from vocab + merges with exactly this pre-tokenizer (plus NFC),
#: so using it everywhere keeps every checkpoint's tokenizer identical to
#: what ``AutoTokenizer`` loads.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_level_tokenizer(model: Any, nfc: bool) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers

    tokenizer = Tokenizer(model)
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@lru_cache(maxsize=1)
def _trained_bpe_json() -> str:
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = _byte_level_tokenizer(models.BPE(), nfc=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any UTF-8 text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer.to_str()


def build_tokenizer(*, nfc: bool = False) -> Any:
    """Return the builtin tokenizer as a fresh ``PreTrainedTokenizerFast``.

    Byte-level BPE (vocab ``TARGET_VOCAB_SIZE``) trained on ``CORPUS``; the
    same bytes on every run. Encoding adds no special tokens — neither bos nor
    eos — with or without ``add_special_tokens``, and the ChatML
    ``chat_template`` does not emit bos either. bos/eos/pad are set
    (``<|begin_of_text|>``, ``<|end_of_text|>``, ``<|pad|>``) for callers
    that want them.

    Args:
        nfc: NFC-normalise input, as transformers' Qwen2 tokenizer class always
            does. Without it ``decode(encode(t)) == t`` for any text ``t`` that
            contains no special-token strings; with it, for any NFC text.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer.from_str(_trained_bpe_json())
    backend = _byte_level_tokenizer(trained.model, nfc)
    for token in SPECIAL_TOKENS:
        backend.add_special_tokens([token])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=_LLAMA_FAMILY_DEFAULTS["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


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
        architecture: one of ``ARCHITECTURES`` (llama, mistral, qwen2, qwen3, gpt2).
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
    tokenizer.model_max_length = config.max_position_embeddings
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
