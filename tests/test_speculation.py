"""Speculative decoding: greedy output unchanged, sampling distribution unchanged, KV rolled back."""

from __future__ import annotations

import math
import shutil
from collections import Counter

import torch
from transformers import AutoModelForCausalLM

import pytest

from tests.engine_helpers import PROMPTS, build_checkpoint, hf_greedy, make_engine
from tierserve.core.sampling_params import SamplingParams
from tierserve.plugins.speculation.ngram import lookup

pytestmark = pytest.mark.unit

REPETITIVE = ["a b c a b c a b c a b c", "the cat sat. the cat sat. the cat sat.", "1 2 3 1 2 3 1 2 3"]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    target = build_checkpoint(root, "target", "llama")
    draft = build_checkpoint(root, "draft", "llama", num_hidden_layers=1)
    prompts = PROMPTS + REPETITIVE
    return target, draft, prompts, hf_greedy(target, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def near_draft(models, tmp_path_factory):
    """The target with its weights slightly perturbed: a draft that is often, not always, right."""
    target = models[0]
    path = tmp_path_factory.mktemp("near") / "draft"
    shutil.copytree(target, path)
    model = AutoModelForCausalLM.from_pretrained(target)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.15 * parameter.std())
    model.save_pretrained(path)
    return path


def assert_clean(engine):
    engine.check_integrity()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_lookup_proposes_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 4, 1, 2, 3], 1, 3, 3) == [4, 1, 2]
    assert lookup([1, 2, 3, 9, 9, 9, 2, 3], 1, 2, 4) == [9, 9, 9, 2]
    assert lookup([7, 8, 7, 8, 7], 1, 2, 5) == [8, 7, 8, 7, 8]  # a short loop goes on repeating
    assert lookup([5, 6], 1, 2, 2) == []
    assert lookup([256, 1, 0, 0, 0, 1], 1, 1, 2) == [0, 0]  # byte patterns across token boundaries never match


@pytest.mark.parametrize(
    "method",
    ["ngram", "draft_model", "draft_model-same-weights", "ngram-tight-memory"],
)
def test_greedy_output_is_unchanged(models, method):
    target, draft, prompts, expected = models
    settings = {"speculative__method": method.split("-")[0]}
    if method.startswith("draft_model"):
        settings["speculative__draft_model"] = str(target if "same" in method else draft)
    if method == "ngram-tight-memory":  # preemption and block trimming under speculation
        settings.update(kv_cache__block_size=4, kv_cache__l1_capacity=40, scheduler__max_num_batched_tokens=16)
    engine = make_engine(target, **settings)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    stats = engine.stats().speculation
    assert stats.enabled and stats.verifications > 0 and stats.proposed > 0
    if "same" in method:
        assert stats.acceptance_rate == 1.0  # a draft identical to the target is always right
    assert_clean(engine)
    engine.close()


def two_sample_chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    na, nb = sum(a[k] for k in keys), sum(b[k] for k in keys)
    stat = 0.0
    for k in keys:
        expected_a = (a[k] + b[k]) * na / (na + nb)
        expected_b = (a[k] + b[k]) * nb / (na + nb)
        stat += (a[k] - expected_a) ** 2 / expected_a + (b[k] - expected_b) ** 2 / expected_b
    return stat, len(keys) - 1


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper critical value (z = 3.09: p = 0.001) by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_same_distributions(*pairs: tuple[Counter, Counter]) -> None:
    """Each pair of samples (plain decoding's, speculative decoding's) passes a two-sample chi-square test."""
    for a, b in pairs:
        stat, df = two_sample_chi_square(a, b)
        assert df >= 3
        assert stat < chi_square_critical(df), (stat, df)


def test_sampling_distribution_is_unchanged(models, near_draft):
    target = models[0]
    prompt = REPETITIVE[1]
    runs = 600

    def second_and_third_tokens(engine) -> tuple[Counter, Counter]:
        params = [SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True, seed=s) for s in range(runs)]
        results = engine.generate([prompt] * runs, params)
        return Counter(r.token_ids[1] for r in results), Counter(tuple(r.token_ids[1:3]) for r in results)

    plain = make_engine(target, scheduler__max_num_seqs=256, scheduler__max_waiting_requests=4096)
    speculative = make_engine(
        target, speculative__method="draft_model", speculative__draft_model=str(near_draft),
        scheduler__max_num_seqs=256, scheduler__max_waiting_requests=4096,
    )
    base_second, base_pairs = second_and_third_tokens(plain)
    spec_second, spec_pairs = second_and_third_tokens(speculative)
    stats = speculative.stats().speculation
    assert stats.proposed >= runs and 0.05 < stats.acceptance_rate < 0.95  # both accept and reject paths ran
    assert_same_distributions((base_second, spec_second), (base_pairs, spec_pairs))
    for engine in (plain, speculative):
        assert_clean(engine)
        engine.close()


def test_speculation_needs_a_paged_backend(tmp_path):
    from tierserve.core.errors import ConfigError

    path = build_checkpoint(tmp_path, "g", "gpt2")
    with pytest.raises(ConfigError, match="needs a paged backend"):
        make_engine(path, backend="transformers-unpaged", speculative__method="ngram")
