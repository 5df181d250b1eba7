"""Grammar engines for constrained decoding: the per-token mask cost of llguidance and xgrammar on this CPU.

    python -m bench grammar [--steps 120]

Both engines constrain the same JSON schema (an object with a string, an
integer, an array of strings and a boolean) and walk it for ``--steps``
tokens, each step filling the next-token bitmask and taking the best allowed
token of random logits. Two vocabularies: the builtin checkpoint's tokenizer
(2,048 tokens) and a synthetic byte-level BPE vocabulary of 150,000 tokens of
1-12 characters (no 150k tokenizer can be downloaded here; what the mask
costs depends on the token strings' lengths and characters, which the
synthetic one draws from letters, digits, spaces and JSON punctuation).
Reported: compile time, and the median, p90 and mean mask time per token.
Needs both packages: ``pip install llguidance xgrammar``.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}  # fmt: skip


def synthetic_tokenizer(size: int, seed: int = 0) -> Any:
    """A byte-level BPE fast tokenizer with ``size`` tokens: the 256 bytes, then random short strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = random.Random(seed)
    byte_chars = bytes_to_unicode()
    common = [byte_chars[b] for b in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;\"'{}[]()-_"]
    vocab = {byte_chars[b]: b for b in range(256)}
    while len(vocab) < size:
        length = rng.choice([2, 3, 3, 4, 4, 5, 5, 6, 7, 8, 9, 10, 12])
        vocab.setdefault("".join(rng.choice(common) for _ in range(length)), len(vocab))
    backend = Tokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=byte_chars[0])


def walk(fill, allowed_logits, consume, steps: int, vocab: int, seed: int) -> list[float]:
    """Per-step mask times of a greedy walk through the grammar on random logits."""
    rng = random.Random(seed)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        if not fill():
            break
        times.append(time.perf_counter() - start)
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        consume(int(allowed_logits(logits).argmax()))
    return times


def run_xgrammar(tokenizer: Any, steps: int) -> tuple[float, list[float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_seconds = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def fill() -> bool:
        if matcher.is_terminated():
            return False
        matcher.fill_next_token_bitmask(mask, 0)
        return True

    def allowed(logits: torch.Tensor) -> torch.Tensor:
        xgr.apply_token_bitmask_inplace(logits, mask)
        return logits

    return compile_seconds, walk(fill, allowed, matcher.accept_token, steps, info.vocab_size, 1)


def run_llguidance(tokenizer: Any, steps: int) -> tuple[float, list[float]]:
    import llguidance.hf
    import llguidance.torch

    from tierserve.core.grammar import JSON_OPTIONS, GrammarRuntime, unpack_bitmask

    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
    compile_seconds = time.perf_counter() - start
    vocab = llg_tokenizer.vocab_size
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def fill() -> bool:
        if matcher.is_stopped():
            return False
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        return True

    def allowed(logits: torch.Tensor) -> torch.Tensor:
        GrammarRuntime.apply(logits, unpack_bitmask(mask, vocab))
        return logits

    return compile_seconds, walk(fill, allowed, matcher.consume_token, steps, vocab, 1)


def run(ctx, steps: int) -> dict:
    from bench.stats import median, percentile

    tokenizers = {"builtin (2k)": ctx.tokenizer, "synthetic (150k)": synthetic_tokenizer(150_000)}
    results: dict[str, dict[str, dict[str, float]]] = {}
    for label, tokenizer in tokenizers.items():
        for engine, runner in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
            compile_seconds, times = runner(tokenizer, steps)
            results.setdefault(label, {})[engine] = {
                "vocab": len(tokenizer), "compile_ms": 1000 * compile_seconds, "steps": len(times),
                "mask_us_median": 1e6 * median(times), "mask_us_p90": 1e6 * percentile(times, 90),
                "mask_us_mean": 1e6 * sum(times) / len(times),
            }  # fmt: skip
            print(label, engine, results[label][engine], flush=True)
    return {"config": {"steps": steps, "schema": SCHEMA}, "results": results}
