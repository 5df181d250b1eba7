"""Scenario ``quality``: how close reduced precisions stay to float32 on the same checkpoint.

For a GGUF file (``--model smollm2``) it is perplexity instead, next to llama.cpp's on the same file
(``bench/perplexity.py``).

Each text's token ids are fed whole (teacher forcing) to the native backend's
model at float32 and at each variant, and the logits at every position compared:

- greedy agreement: the fraction of positions whose most likely next token is the same;
- mean KL(float32 || variant), in nats per position.

Variants: int8 weights (``model.quantization = "int8"``) with the fastest int8
kernel here and the portable one, and bfloat16 weights (``model.dtype``).
(``kv_cache.dtype`` is checked end to end by the tests: this model path never
reads the KV arena.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find its friends.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read books.",
    "Q: What is the capital of France?\nA: The capital of France is Paris, a city on the Seine.",
]


@dataclass(frozen=True, slots=True)
class Closeness:
    """How a variant's next-token distributions compare with float32's over the same positions."""

    greedy_agreement: float
    mean_kl: float
    positions: int


def load_model(path: Path, dtype: torch.dtype, quantization: str = "none", linear_kernel: str = "auto"):
    """The native backend's model for ``path`` on the CPU, as a server with these settings would run it."""
    from transformers import AutoConfig

    from tierserve.plugins.backends.llama import PagedLlama
    from tierserve.plugins.backends.native import load_safetensors

    config = AutoConfig.from_pretrained(path)
    return PagedLlama(config, load_safetensors(path), torch.device("cpu"), dtype, linear_kernel, quantization)


def teacher_forced_logits(model, token_ids: list[list[int]]) -> list[torch.Tensor]:
    """Float32 logits ``[len, vocab]`` at every position of each sequence."""
    with torch.inference_mode():
        hidden = model.final_hidden_states([torch.tensor(ids) for ids in token_ids])
        return [model.lm_head(h).float() for h in hidden]


def closeness(reference: list[torch.Tensor], variant: list[torch.Tensor]) -> Closeness:
    ref, var = torch.cat(reference), torch.cat(variant)
    agreement = (ref.argmax(-1) == var.argmax(-1)).float().mean().item()
    log_p, log_q = ref.log_softmax(-1), var.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return Closeness(agreement, kl, ref.shape[0])


def variants() -> dict[str, dict]:
    """Name -> ``load_model`` keywords for every reduced precision that runs here."""
    from tierserve.plugins.backends.linear import int8_kernels

    found = {"bfloat16": {"dtype": torch.bfloat16}}
    kernels = int8_kernels(torch.device("cpu"))
    found[f"int8-{kernels[0]}"] = {"dtype": torch.float32, "quantization": "int8"}  # the fastest kernel here
    if "fbgemm" in kernels and len(kernels) > 2:  # the portable one as well
        found[f"int8-{kernels[1]}"] = {"dtype": torch.float32, "quantization": "int8", "linear_kernel": "torch"}
    return found


def measure(path: Path, token_ids: list[list[int]]) -> dict[str, Closeness]:
    """``closeness`` of every variant against float32 on ``path``."""
    reference = teacher_forced_logits(load_model(path, torch.float32), token_ids)
    return {
        name: closeness(reference, teacher_forced_logits(load_model(path, **options), token_ids))
        for name, options in variants().items()
    }


def run(ctx, checkpoints: list[str]) -> dict:
    """Figures for ``ctx``'s checkpoint and the test suite's tiny architectures (written here, seeded); for a GGUF
    file, its perplexity at each precision next to llama.cpp's (``bench.perplexity``)."""
    import tempfile

    from tierserve.models.gguf import is_gguf

    if is_gguf(ctx.checkpoint):
        from bench import perplexity

        return {"config": {"model": ctx.model, "file": ctx.checkpoint.name}, "perplexity": perplexity.run(ctx)}

    from tierserve.models.builtin_models import write_checkpoint

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tierserve-quality-") as scratch:
        paths = {ctx.model: ctx.checkpoint}
        for architecture in checkpoints:
            paths[architecture] = write_checkpoint(Path(scratch) / architecture, architecture, seed=1)
        with ctx.progress(len(paths), "quality") as bar:
            for name, path in paths.items():
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(path)
                ids = [tokenizer(text)["input_ids"] for text in TEXTS]
                results[name] = {k: asdict(v) for k, v in measure(path, ids).items()}
                bar.update(1)
    return {"config": {"model": ctx.model, "checkpoints": checkpoints, "texts": len(TEXTS)}, "results": results}

