"""The paged ``transformers`` backend: what the native backend's arena gives, for architectures it has no layers for."""

from __future__ import annotations

import pytest

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, hf_greedy, make_engine
from tierserve.models.backend_choice import UnsupportedModel
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
REPETITIVE = ["one two three four one two three four one two three four one two", "ab ab ab ab ab ab ab ab"]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt"), "gemma2", "gemma2")
    prompts = PROMPTS + REPETITIVE
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("tight", [False, True], ids=["ngram", "ngram-tight-memory"])
def test_speculation_keeps_greedy_output(gemma2, tight):
    path, prompts, expected = gemma2
    settings = {"speculative__method": "ngram"}
    if tight:  # preemption and block trimming under speculation
        settings.update(kv_cache__block_size=4, kv_cache__l1_capacity=40, scheduler__max_num_batched_tokens=16)
    engine = make_engine(path, **settings)
    assert engine.info.backend == "transformers"
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
    stats = engine.stats().speculation
    assert stats.verifications > 0 and stats.accepted > 0
    assert_pool_released(engine)


def test_a_narrower_kv_dtype_halves_the_blocks_and_keeps_serving(gemma2):
    path, prompts, expected = gemma2
    wide = make_engine(path)
    narrow = make_engine(path, kv_cache__dtype="bfloat16")
    assert narrow.info.kv_dtype == "bfloat16" and narrow.info.kv_block_bytes * 2 == wide.info.kv_block_bytes
    assert narrow.info.fingerprint != wide.info.fingerprint  # bfloat16 KV is never served to a float32 arena
    results = narrow.generate(prompts, GREEDY)
    assert sum(r.token_ids == e for r, e in zip(results, expected)) >= len(expected) // 2  # rounding may flip ties


def test_architectures_it_cannot_page_are_refused_with_the_reason(tmp_path):
    path = build_checkpoint(tmp_path, "bloom", "bloom")
    with pytest.raises(UnsupportedModel, match=r"AttentionInterface.*model.backend = \"transformers-unpaged\""):
        make_engine(path, backend="transformers")
    fallback = make_engine(path)  # auto
    assert (fallback.info.backend, fallback.info.paged) == ("transformers-unpaged", False)
    assert [r.token_ids for r in fallback.generate(PROMPTS[:2], GREEDY)] == hf_greedy(path, PROMPTS[:2], NEW_TOKENS)
