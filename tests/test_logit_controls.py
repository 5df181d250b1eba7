"""``logit_bias`` and ``min_tokens`` change real generations, with and without speculative decoding."""

from __future__ import annotations

import pytest

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, make_engine
from tierserve.engine import RequestError
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


@pytest.fixture(scope="module")
def engines(tiny):
    """A plain engine and one drafting with prompt lookup (drafts verified under the bias and the ban)."""
    plain = make_engine(tiny)
    drafting = make_engine(tiny, speculative__method="ngram")
    yield plain, drafting
    for engine in (plain, drafting):
        assert_pool_released(engine)
        engine.close()


def unused_token(engine, prompt: str) -> int:
    """A token the greedy continuation of ``prompt`` never picks on its own."""
    [greedy] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return next(t for t in range(100, engine.info.vocab_size) if t not in greedy.token_ids)


def test_a_large_positive_bias_forces_its_token(engines):
    plain, drafting = engines
    forced = unused_token(plain, PROMPTS[1])
    for engine in engines:
        for params in (
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={forced: 100}),
            SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logit_bias={forced: 100}),
        ):
            [result] = engine.generate([PROMPTS[1]], params)
            assert result.token_ids == [forced] * 12
    assert drafting.stats().speculation.verifications > 0  # the repeated token was drafted and verified


def test_a_large_negative_bias_bans_its_tokens_and_leaves_the_batch_alone(engines):
    plain, _ = engines
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [alone] = plain.generate([PROMPTS[4]], greedy)
    ban = dict.fromkeys(alone.token_ids, -100)
    banned = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=ban)
    neighbour, avoided = plain.generate([PROMPTS[4], PROMPTS[4]], [greedy, banned])
    assert neighbour.token_ids == alone.token_ids  # an unbiased request in the same batch is unchanged
    assert not set(avoided.token_ids) & set(alone.token_ids)


def test_min_tokens_holds_back_eos_until_reached(engines):
    plain, _ = engines
    eos = min(plain.info.eos_token_ids)
    ends_at_once = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100})
    [early] = plain.generate([PROMPTS[1]], ends_at_once)
    assert early.finish_reason == "stop" and early.token_ids == [eos]
    for engine in engines:
        for seed in (None, 5):
            params = SamplingParams(
                temperature=0 if seed is None else 1.0, seed=seed, max_tokens=20, min_tokens=6, logit_bias={eos: 100}
            )
            [held] = engine.generate([PROMPTS[1]], params)
            assert held.finish_reason == "stop"
            assert len(held.token_ids) == 7 and eos not in held.token_ids[:6] and held.token_ids[6] == eos


def test_min_tokens_under_speculation_ends_exactly_where_plain_decoding_does(engines):
    """Drafts run past min_tokens: the ban must cover only the positions before it."""
    plain, drafting = engines
    eos = min(plain.info.eos_token_ids)
    forced = unused_token(plain, PROMPTS[4])
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=13, logit_bias={eos: 100, forced: 50})
    before = drafting.stats().speculation.proposed
    results = [engine.generate([PROMPTS[4]], params)[0] for engine in engines]
    assert results[0].token_ids == results[1].token_ids == [forced] * 13 + [eos]
    assert drafting.stats().speculation.proposed > before


def test_min_tokens_holds_back_stop_token_ids(engines):
    plain, _ = engines
    stop = unused_token(plain, PROMPTS[6])
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop], min_tokens=4, logit_bias={stop: 100}
    )
    [result] = plain.generate([PROMPTS[6]], params)
    assert result.finish_reason == "stop" and len(result.token_ids) == 5 and result.token_ids[4] == stop
    assert stop not in result.token_ids[:4]


def test_bias_ids_outside_the_vocabulary_and_bad_values_are_refused(engines):
    plain, _ = engines
    vocab = plain.info.vocab_size
    with pytest.raises(RequestError, match=rf"logit_bias: token id {vocab} is outside the vocabulary"):
        plain.generate([PROMPTS[0]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    for bias in ({1: 100.5}, {1: float("nan")}, {-1: 1.0}):
        with pytest.raises(RequestError, match=r"^logit_bias: "):
            SamplingParams(logit_bias=bias)
    with pytest.raises(RequestError, match=r"^min_tokens: got 9, allowed: 0 to max_tokens \(8\)"):
        SamplingParams(max_tokens=8, min_tokens=9)
