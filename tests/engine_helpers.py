"""Building tiny checkpoints and engines for tests, and the Hugging Face reference output."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tierserve.models.builtin_models import write_checkpoint
from tierserve.settings.config import load_settings
from tierserve.engine import EngineClient

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "café, naïve, 日本語 and 🙂",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read. "
    "Every morning she walked to the old library at the edge of the town, where the librarian "
    "kept a shelf of books nobody else ever asked for.",
    "1 2 3 4 5 6 7 8 9 10",
    "Q: What is the capital of France?\nA:",
    "x",
]


def build_checkpoint(root: Path, name: str, architecture: str, **overrides) -> Path:
    return write_checkpoint(root / name, architecture, seed=1, **overrides)


def make_engine(path: Path, backend: str = "auto", **settings) -> EngineClient:
    """An engine on ``path`` whose core runs in this process, stepped by hand until ``start()``."""
    overrides = {("model", "path"): str(path), ("model", "backend"): backend, ("model", "device"): "cpu"}
    for dotted, value in settings.items():
        section, key = dotted.rsplit("__", 1)  # plugins__native__linear_kernel: [plugins.native] linear_kernel
        overrides[(section.replace("__", "."), key)] = value
    loaded = load_settings(None, environ={}, overrides=overrides)
    return EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)


def hf_greedy(path: Path, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """``generate(do_sample=False)`` one prompt at a time, never stopping early."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


def assert_pool_released(engine: EngineClient) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats.kv_blocks_free + stats.kv_blocks_pinned == stats.kv_blocks_total  # pinned: named prefixes
    assert stats.requests_running == stats.requests_waiting == 0
