"""Sampler behaviour: greedy, filters, penalties, seeded draws, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tierserve.core.sampler import SampledToken, Sampler, SamplingRow
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

sampler = Sampler()


def row(seed: int | None = None, prompt: list[int] | None = None, output: list[int] | None = None, **params) -> SamplingRow:
    p = SamplingParams(seed=seed, **params)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(p, gen, list(prompt or []), list(output or []))


def ids(tokens: list[SampledToken]) -> list[int]:
    return [t.token_id for t in tokens]


# Probabilities 0.5, 0.3, 0.15, 0.05 for tokens 0..3.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draw_many(n: int, logits: torch.Tensor = LOGITS, seed: int = 0, **params) -> list[int]:
    r = row(seed=seed, **params)
    return [sampler(logits.unsqueeze(0), [r])[0].token_id for _ in range(n)]


def test_greedy_is_argmax_for_every_row_and_dtype():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    rows = [row(temperature=0.0) for _ in range(6)]
    expected = logits.argmax(dim=-1).tolist()
    assert ids(sampler(logits, rows)) == expected
    assert ids(sampler(logits.to(torch.bfloat16), rows)) == logits.to(torch.bfloat16).float().argmax(dim=-1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in sampler(logits, rows))


def test_logits_are_not_modified():
    logits = torch.randn(2, 10)
    before = logits.clone()
    sampler(logits, [row(seed=1, repetition_penalty=2.0, prompt=[1, 2]), row(temperature=0.0, presence_penalty=1.0, output=[3])])
    assert torch.equal(logits, before)


def test_temperature_towards_zero_converges_to_argmax():
    logits = torch.tensor([1.0, 2.0, 1.5, 0.0])
    assert set(draw_many(200, logits, temperature=0.02)) == {1}
    # At temperature 1 the other tokens do show up.
    assert len(set(draw_many(200, logits, temperature=1.0))) > 1


def test_temperature_below_float32_range_is_greedy():
    logits = torch.tensor([[1.0, 2.0, 1.9999]])
    assert sampler(logits, [row(temperature=1e-7)])[0].token_id == 1


def test_tokens_without_probability_are_never_sampled():
    inf = float("-inf")
    assert set(draw_many(300, torch.tensor([inf, 0.0, inf, 0.0, inf]))) == {1, 3}
    # All the mass on the very last token: the draw must not run off the end.
    assert set(draw_many(100, torch.tensor([inf, inf, inf, 5.0]), top_p=0.5)) == {3}


def test_top_k_one_equals_greedy():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    greedy = ids(sampler(logits, [row(temperature=0.0) for _ in range(5)]))
    for seed in range(20):
        rows = [row(seed=seed * 10 + i, temperature=1.5, top_k=1) for i in range(5)]
        assert ids(sampler(logits, rows)) == greedy


def test_top_k_keeps_only_k_most_likely():
    assert set(draw_many(300, top_k=2)) == {0, 1}


def test_tiny_top_p_keeps_only_the_top_token():
    assert set(draw_many(200, top_p=1e-6)) == {0}


def test_top_p_keeps_smallest_set_reaching_p():
    assert set(draw_many(400, top_p=0.75)) == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
    assert set(draw_many(400, top_p=0.85)) == {0, 1, 2}  # 0.8 < 0.85 <= 0.95


def test_min_p_drops_tokens_below_fraction_of_max():
    assert set(draw_many(400, min_p=0.5)) == {0, 1}  # floor 0.25: drops 0.15 and 0.05
    assert set(draw_many(400, min_p=0.2)) == {0, 1, 2}  # floor 0.10: drops 0.05


def test_sampling_frequencies_follow_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5, -1.0])
    probs = logits.softmax(dim=-1)
    n = 4000
    counts = torch.bincount(torch.tensor(draw_many(n, logits, seed=1234)), minlength=5).double()
    expected = probs.double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.47  # 4 degrees of freedom, p = 0.001


def test_same_seed_same_tokens():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))

    def run() -> list[list[int]]:
        rows = [row(seed=7, temperature=0.9), row(seed=8, top_k=20), row(seed=9, top_p=0.9)]
        return [ids(sampler(logits, rows)) for _ in range(5)]

    first = run()
    assert first == run()
    assert len({tuple(step) for step in first}) > 1  # the draws do vary between steps


def test_seeded_row_is_independent_of_batch_composition():
    torch.manual_seed(0)
    steps = [torch.randn(4, 64) for _ in range(8)]

    def target() -> SamplingRow:
        return row(seed=42, temperature=0.8, top_p=0.95, top_k=30, min_p=0.01, repetition_penalty=1.2, prompt=[1, 2, 3])

    alone = target()
    alone_ids = []
    for logits in steps:
        token = sampler(logits[2:3], [alone])[0].token_id
        alone.output_token_ids.append(token)
        alone_ids.append(token)

    mixed = target()
    others = [
        row(seed=1, temperature=1.3),
        row(temperature=0.0, frequency_penalty=0.5, output=[4, 4]),
        row(seed=99, top_k=5, logprobs=3),
    ]
    batch = [others[0], others[1], mixed, others[2]]
    mixed_ids = []
    for logits in steps:
        token = sampler(logits, batch)[2].token_id
        mixed.output_token_ids.append(token)
        mixed_ids.append(token)
    assert mixed_ids == alone_ids


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2, 0.5]])
    r = row(temperature=0.0, repetition_penalty=2.0, prompt=[0], output=[2], logprobs=5)
    [token] = sampler(logits, [r])
    penalised = torch.tensor([1.0, 1.5, -2.0, -1.2, 0.5])
    assert token.token_id == 1  # token 0 lost the top spot
    expected = torch.log_softmax(penalised, dim=-1)
    assert dict(token.top_logprobs) == pytest.approx({i: expected[i].item() for i in range(5)}, abs=1e-6)


def test_presence_penalty_counts_output_tokens_once():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    # Prompt tokens do not count for presence/frequency.
    assert sampler(logits, [row(temperature=0.0, presence_penalty=1.0, prompt=[0, 0])])[0].token_id == 0
    [token] = sampler(logits, [row(temperature=0.0, presence_penalty=1.0, output=[0, 0, 0], logprobs=0)])
    assert token.token_id == 1
    expected = torch.log_softmax(torch.tensor([2.0, 2.5, 0.0]), dim=-1)
    assert token.logprob == pytest.approx(expected[1].item(), abs=1e-6)


def test_frequency_penalty_scales_with_count():
    logits = torch.tensor([[3.0, 2.5, 2.2]])
    once = sampler(logits, [row(temperature=0.0, frequency_penalty=0.4, output=[0])])[0]
    assert once.token_id == 0  # 2.6 > 2.5
    thrice = sampler(logits, [row(temperature=0.0, frequency_penalty=0.4, output=[0, 0, 0, 1], logprobs=3)])[0]
    expected = torch.log_softmax(torch.tensor([3.0 - 1.2, 2.5 - 0.4, 2.2]), dim=-1)
    assert thrice.token_id == 2
    assert [t for t, _ in thrice.top_logprobs] == [2, 1, 0]
    assert [lp for _, lp in thrice.top_logprobs] == pytest.approx([expected[i].item() for i in (2, 1, 0)], abs=1e-6)


def test_negative_presence_penalty_encourages_repeats():
    logits = torch.tensor([[1.0, 1.2]])
    assert sampler(logits, [row(temperature=0.0, presence_penalty=-0.5, output=[0])])[0].token_id == 0


def test_history_ids_outside_the_vocab_are_ignored():
    logits = torch.tensor([[1.0, 2.0]])
    [token] = sampler(logits, [row(temperature=0.0, repetition_penalty=3.0, presence_penalty=1.0, prompt=[5, 1], output=[7])])
    assert token.token_id == 0  # 2.0 / 3 < 1.0


def test_logprobs_are_log_softmax_sorted_top_n():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4))
    rows = [row(seed=1, temperature=0.7, top_k=3, logprobs=5), row(temperature=0.0, logprobs=0), row(seed=2)]
    out = sampler(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)

    assert out[0].logprob == pytest.approx(reference[0, out[0].token_id].item(), abs=1e-6)
    top = out[0].top_logprobs
    assert len(top) == 5
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    top_ref = reference[0].topk(5)
    assert [t for t, _ in top] == top_ref.indices.tolist()
    assert [lp for _, lp in top] == pytest.approx(top_ref.values.tolist(), abs=1e-6)

    assert out[1].token_id == logits[1].argmax().item()
    assert out[1].logprob == pytest.approx(reference[1].max().item(), abs=1e-6)
    assert out[1].top_logprobs == []

    assert out[2].logprob is None and out[2].top_logprobs is None


def test_logprobs_ignore_temperature_and_filters():
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    [token] = sampler(logits, [row(seed=3, temperature=0.3, top_k=1, logprobs=2)])
    assert token.token_id == 0
    assert token.logprob == pytest.approx(torch.log_softmax(logits[0], dim=-1)[0].item(), abs=1e-6)


def test_logprobs_n_larger_than_vocab():
    [token] = sampler(torch.tensor([[0.0, 1.0]]), [row(temperature=0.0, logprobs=20)])
    assert [t for t, _ in token.top_logprobs] == [1, 0]
    assert sum(math.exp(lp) for _, lp in token.top_logprobs) == pytest.approx(1.0)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(2, 5), [row(temperature=0.0)])


def test_empty_batch():
    assert sampler(torch.zeros(0, 5), []) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logprobs", 21),
        ("max_tokens", 0),
        ("stop", [""]),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: got"):
        SamplingParams(**{field: value})


def test_top_p_that_underflows_in_float32_keeps_the_top_token():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=3e-178, top_k=10**6, presence_penalty=0.7)
    rows = [SamplingRow(params, torch.Generator().manual_seed(i), [], [1]) for i in range(3)]
    tokens = [t.token_id for t in Sampler()(logits, rows)]
    penalised = logits.clone()
    penalised[:, 1] -= 0.7
    assert tokens == penalised.argmax(dim=-1).tolist()
