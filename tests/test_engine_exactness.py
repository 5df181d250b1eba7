"""Greedy output equals Hugging Face ``generate()`` token for token, however the engine batches."""

from __future__ import annotations

import pytest

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, hf_greedy, make_engine
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

CHECKPOINTS = {
    "llama": ("llama", {}),
    "llama-sharded-safetensors": ("llama", {"max_shard_size": "100KB"}),
    "llama-tied-linear-rope": ("llama", {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 16}),
    # on the paged transformers backend (model.backend = "auto" picks it): the model's own modeling code
    "gpt2": ("gpt2", {}),
    "gemma2-softcap-alternating-window": ("gemma2", {}),
    "phi3-fused-projections": ("phi3", {}),
    "gpt-neox-partial-rotary": ("gpt_neox", {}),
}
NATIVE = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    architecture, overrides = CHECKPOINTS[request.param]
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param, architecture, **overrides)
    return path, hf_greedy(path, PROMPTS, NEW_TOKENS)


def test_one_at_a_time_and_again_from_the_prefix_cache(checkpoint):
    path, expected = checkpoint
    engine = make_engine(path)
    architecture = path.name.split("-")[0]
    assert engine.info.backend == ("native" if architecture in NATIVE else "transformers")
    assert engine.info.paged and engine.info.tier_names
    block = engine.info.block_size
    for prompt, reference in zip(PROMPTS, expected):
        [result] = engine.generate([prompt], GREEDY)
        assert result.token_ids == reference, prompt
        [again] = engine.generate([prompt], GREEDY)
        assert again.token_ids == reference, prompt
        length = len(result.prompt_token_ids)
        full_blocks = (length - 1) // block * block  # the last prompt token is always recomputed
        # the first run's KV (prompt and all but its last new token) filled the block the prompt ends in:
        # that block is cached too, and the prompt's tokens at its start are copied from it
        tail_cached = length + NEW_TOKENS - 1 >= full_blocks + block
        assert again.cached_tokens == (length - 1 if tail_cached else full_blocks), prompt
    assert_pool_released(engine)


# [sliding_window] use_flash_attention: torch picks its fastest attention kernel, or the math kernel is forced
ATTENTION = pytest.mark.parametrize("use_flash_attention", [True, False], ids=["torch-picks", "math"])


def kernel_of(use_flash_attention: bool, path=None) -> str:
    if path is not None and path.name.startswith("gemma2"):
        return "math (logit soft-capping)"  # torch's fused kernels cannot soft-cap
    return "flash/math (torch picks)" if use_flash_attention else "math"


@ATTENTION
def test_all_submitted_together(checkpoint, use_flash_attention):
    path, expected = checkpoint
    engine = make_engine(path, sliding_window__use_flash_attention=use_flash_attention)
    assert engine.info.attention_kernel == kernel_of(use_flash_attention, path)
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert_pool_released(engine)


@ATTENTION
def test_chunked_prefill_and_preemption(checkpoint, use_flash_attention):
    path, expected = checkpoint
    # 24 blocks of 4 tokens cannot hold all eight sequences: the scheduler must preempt;
    # a 16-token budget splits every long prompt into chunks.
    engine = make_engine(
        path, kv_cache__block_size=4, kv_cache__l1_capacity=24, scheduler__max_num_batched_tokens=16,
        sliding_window__use_flash_attention=use_flash_attention,
    )  # fmt: skip
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert engine.stats().counters.preemptions > 0
    assert_pool_released(engine)


@ATTENTION
def test_unpaged_transformers_backend_on_gpt2(tmp_path, use_flash_attention):
    path = build_checkpoint(tmp_path, "gpt2", "gpt2")
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    engine = make_engine(path, backend="transformers-unpaged", sliding_window__use_flash_attention=use_flash_attention)
    assert engine.info.attention_kernel == kernel_of(use_flash_attention)
    assert not engine.info.paged
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == expected
    small = make_engine(
        path, backend="transformers-unpaged", kv_cache__block_size=4, kv_cache__l1_capacity=24,
        scheduler__max_num_batched_tokens=16,
    )
    assert [r.token_ids for r in small.generate(PROMPTS, GREEDY)] == expected
    assert small.stats().counters.preemptions > 0
    assert_pool_released(small)
