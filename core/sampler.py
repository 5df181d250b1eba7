"""Turns one step's logits into next tokens: penalties, greedy or filtered sampling, logprobs.

Per row the order is: repetition penalty, presence and frequency penalties,
``logit_bias``, the ban on eos and stop ids before ``min_tokens``,
then either argmax (greedy) or temperature, top-k, top-p, min-p and a draw
from the row's own ``torch.Generator``. Everything is computed in float32 on
``logits.device`` (the final draw in float64); rows are batched wherever that
does not couple their random streams, and each sampled row draws its random
number from its own generator, so a seeded request gets the same tokens
whatever else shares its batch.

Reported logprobs are ``log_softmax`` of the logits *after* the penalties (and
the bias and ban) and *before* temperature, top-k, top-p and min-p: they describe the model's
(penalised) distribution, not the filtered one the token was drawn from, so
they do not depend on the sampling knobs (vLLM's default, "raw" after
penalties). Prompt tokens' logprobs (``score_tokens``) are of the raw
distribution itself: no penalty, bias or ban applies to a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierserve.core.outputs import TokenLogprob
from tierserve.core.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing by them overflows
# float32 and the distribution is a point mass on the argmax anyway.
_MIN_TEMPERATURE = 1e-5
SCORED_ROWS_AT_ONCE = 64  # score_tokens' float32 log-softmax covers this many rows, whatever the chunk's length


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs from one sequence."""

    params: SamplingParams
    # Per-sequence RNG, seeded from params.seed or by the engine from a global
    # RNG. None only for greedy rows; a sampled row without one draws from
    # torch's global RNG and loses batch-independence.
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Token ids this token may not be (eos and stop ids while min_tokens is not reached).
    suppressed: frozenset[int] = frozenset()


@dataclass(slots=True)
class SampledToken:
    token_id: int
    # None unless params.logprobs is not None.
    logprob: float | None
    # Top params.logprobs (token id, logprob) pairs, descending; [] for 0,
    # None when params.logprobs is None.
    top_logprobs: list[tuple[int, float]] | None


def adjusts(row: SamplingRow) -> bool:
    """Whether the row's logits change before the pick (penalties, bias, banned tokens)."""
    return row.params.has_penalties or bool(row.params.logit_bias) or bool(row.suppressed)


def is_greedy(params: SamplingParams) -> bool:
    """True when the row takes the argmax (temperature 0 or below float32-safe range)."""
    return params.temperature < _MIN_TEMPERATURE


class Sampler:
    """Stateless: all per-sequence state (history, RNG) comes in through the rows."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """Pick one token per row.

        Args:
            logits: ``[len(rows), vocab]``, any float dtype, any device. Not modified.
            rows: one :class:`SamplingRow` per logits row.

        Returns:
            One :class:`SampledToken` per row, in order.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits: expected shape [{len(rows)}, vocab] for {len(rows)} rows, got {list(logits.shape)}")
        if not rows:
            return []

        # Hot path: plain greedy decoding is one batched argmax and one transfer.
        # The float32 cast is skipped because it cannot change the argmax.
        if all(is_greedy(r.params) and r.params.logprobs is None and not adjusts(r) for r in rows):
            return [SampledToken(t, None, None) for t in logits.argmax(dim=-1).tolist()]

        x = logits.to(torch.float32, copy=True)
        device = x.device
        n = len(rows)

        penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if penalised:
            _apply_penalties(x, rows, penalised)
        adjust_logits(x, rows)

        with_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logprobs = torch.log_softmax(_take(x, with_logprobs, n), dim=-1) if with_logprobs else None

        tokens = torch.empty(n, dtype=torch.long, device=device)
        greedy = [i for i, r in enumerate(rows) if is_greedy(r.params)]
        sampled = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
        if greedy:
            _put(tokens, greedy, n, _take(x, greedy, n).argmax(dim=-1))
        if sampled:
            _put(tokens, sampled, n, _sample(_take(x, sampled, n), [rows[i] for i in sampled]))

        token_ids = tokens.tolist()
        if logprobs is None:
            return [SampledToken(t, None, None) for t in token_ids]

        chosen = logprobs.gather(1, _take(tokens, with_logprobs, n).unsqueeze(1)).squeeze(1).tolist()
        top_n = [rows[i].params.logprobs or 0 for i in with_logprobs]
        k = min(max(top_n), logprobs.shape[1])
        if k > 0:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
        out = [SampledToken(t, None, None) for t in token_ids]
        for j, i in enumerate(with_logprobs):
            top = list(zip(top_ids[j][: top_n[j]], top_values[j][: top_n[j]])) if k > 0 else []
            out[i] = SampledToken(token_ids[i], chosen[j], top)
        return out


def score_tokens(logits: torch.Tensor, token_ids: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """Per row of ``logits``, the log-probability of its token in ``token_ids``, that token's rank and the
    top ``top_n`` alternatives, from ``log_softmax`` of the row in float32 (prompt logprobs).

    Rows are converted ``SCORED_ROWS_AT_ONCE`` at a time and only the numbers asked for are kept, so a long
    prompt never holds more than one slice's full-vocabulary float32 copy.
    """
    scored: list[TokenLogprob] = []
    ids = list(token_ids)
    targets = torch.tensor(ids, dtype=torch.long, device=logits.device)
    for first in range(0, len(targets), SCORED_ROWS_AT_ONCE):
        rows = torch.log_softmax(logits[first : first + SCORED_ROWS_AT_ONCE].float(), dim=-1)
        chosen = rows.gather(1, targets[first : first + SCORED_ROWS_AT_ONCE, None])
        ranks = (rows >= chosen).sum(dim=-1).tolist()
        top_values = top_ids = None
        if top_n:
            top_values, top_ids = (t.tolist() for t in rows.topk(min(top_n, rows.shape[1]), dim=-1))
        for j, logprob in enumerate(chosen.squeeze(1).tolist()):
            top = list(zip(top_ids[j], top_values[j])) if top_n else []
            scored.append(TokenLogprob(ids[first + j], logprob, top, ranks[j]))
    return scored


def _take(x: torch.Tensor, index: list[int], n: int) -> torch.Tensor:
    """Rows ``index`` of ``x``, without a gather when that is every row."""
    return x if len(index) == n else x[torch.tensor(index, device=x.device)]


def _put(dest: torch.Tensor, index: list[int], n: int, values: torch.Tensor) -> None:
    if len(index) == n:
        dest.copy_(values)
    else:
        dest[torch.tensor(index, device=dest.device)] = values


def _token_counts(rows: Sequence[SamplingRow], index: list[int], vocab: int, device: torch.device, *, prompt: bool) -> torch.Tensor:
    """``[len(index), vocab]`` float32 counts of each token in the rows' output (and prompt)."""
    lists = [(rows[i].prompt_token_ids + rows[i].output_token_ids) if prompt else rows[i].output_token_ids for i in index]
    width = max(map(len, lists))
    # Padding and ids outside [0, vocab) (a tokenizer larger than the logits)
    # land in one extra column that is cut off: they must not index out of bounds.
    padded = torch.tensor([t + [vocab] * (width - len(t)) for t in lists], dtype=torch.long, device=device)
    padded = torch.where((padded < 0) | (padded > vocab), vocab, padded)
    counts = torch.zeros(len(index), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow], index: list[int]) -> None:
    """Apply repetition, presence and frequency penalties to rows ``index`` of ``x`` in place."""
    n, vocab, device = len(rows), x.shape[1], x.device

    rep = [i for i in index if rows[i].params.repetition_penalty != 1.0]
    if rep:
        # Hugging Face semantics: every token seen in prompt or output is made
        # less likely whatever its sign.
        seen = _token_counts(rows, rep, vocab, device, prompt=True) > 0
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=device).unsqueeze(1)
        sub = _take(x, rep, n)
        _put(x, rep, n, torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub))

    additive = [i for i in index if rows[i].params.presence_penalty != 0.0 or rows[i].params.frequency_penalty != 0.0]
    if additive:
        # OpenAI semantics: output tokens only.
        counts = _token_counts(rows, additive, vocab, device, prompt=False)
        presence = torch.tensor([rows[i].params.presence_penalty for i in additive], device=device).unsqueeze(1)
        frequency = torch.tensor([rows[i].params.frequency_penalty for i in additive], device=device).unsqueeze(1)
        sub = _take(x, additive, n)
        _put(x, additive, n, sub - (frequency * counts + presence * (counts > 0)))


def adjust_logits(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's ``logit_bias`` to float32 logits ``x`` in place, then set its suppressed ids to -inf.

    Ids at or past the logits' width (a tokenizer larger than the model's
    output) are skipped: nothing can be sampled there anyway.
    """
    vocab = x.shape[1]
    biased = [(i, t, v) for i, r in enumerate(rows) for t, v in r.params.logit_bias.items() if t < vocab]
    if biased:
        index, tokens, values = zip(*biased)
        where = (torch.tensor(index, device=x.device), torch.tensor(tokens, device=x.device))
        x.index_put_(where, torch.tensor(values, dtype=x.dtype, device=x.device), accumulate=True)
    banned = [(i, t) for i, r in enumerate(rows) for t in r.suppressed if t < vocab]
    if banned:
        index, tokens = zip(*banned)
        x[torch.tensor(index, device=x.device), torch.tensor(tokens, device=x.device)] = float("-inf")


def _sample(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Filter and draw one token per row of ``x`` (``[len(rows), vocab]``, float32, owned)."""
    return _draw(filtered_probs(x, rows), rows)


def filtered_probs(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to float32 logits ``x``: the (unnormalised)
    probabilities a sampled row draws from. Speculative verification compares these."""
    vocab, device = x.shape[1], x.device
    x = x / torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)

    filtered = [j for j, r in enumerate(rows) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
    if filtered:
        top_k = [rows[j].params.top_k if 0 < rows[j].params.top_k < vocab else vocab for j in filtered]
        top_p = [rows[j].params.top_p for j in filtered]
        sub = _take(x, filtered, len(rows))
        # When every filtered row has a top-k, its k largest are all that can
        # survive, and a partial top-k is far cheaper than a full-vocab sort.
        width = max(top_k)
        if width < vocab:
            ordered, order = sub.topk(width, dim=-1)
        else:
            ordered, order = sub.sort(dim=-1, descending=True, stable=True)
        if any(k < vocab for k in top_k):
            rank = torch.arange(width, device=device).unsqueeze(0)
            ordered.masked_fill_(rank >= torch.tensor(top_k, device=device).unsqueeze(1), float("-inf"))
        if any(p < 1.0 for p in top_p):
            probs = ordered.softmax(dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p:
            # what remains is the smallest set with mass >= top_p, and the top
            # token (nothing above it) always stays. top_p == 1 never drops,
            # even when float rounding pushes the running sum to 1 early.
            threshold = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=device).unsqueeze(1)
            drop = probs.cumsum(dim=-1) - probs >= threshold
            drop[:, 0] = False  # the top token always stays, even if top_p underflows to 0 in float32
            ordered.masked_fill_(drop, float("-inf"))
        _put(x, filtered, len(rows), torch.full_like(sub, float("-inf")).scatter_(1, order, ordered))

    probs = x.softmax(dim=-1)
    min_p = [r.params.min_p for r in rows]
    if any(p > 0.0 for p in min_p):
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def draw(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row of ``probs`` (need not be normalised), each from its row's generator."""
    return _draw(probs, list(rows))


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One categorical draw per row (rows need not sum to 1), each from its row's generator.

    Inverse-CDF sampling: the only per-row work is one uniform number from the
    row's own generator, so a row's draw depends on nothing else in the batch;
    the search is batched. Same distribution as ``torch.multinomial`` per
    row, without its full-vocabulary pass per row.
    """
    device = probs.device
    uniform = torch.cat([
        torch.rand(1, generator=r.generator, dtype=torch.float64, device=r.generator.device if r.generator is not None else device)
        .to(device)
        for r in rows
    ])
    # float64: a float32 running sum over 100k+ tokens drifts enough to bias the tail.
    probs = torch.nan_to_num(probs.to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0).clamp_(min=0.0)
    empty = probs.sum(dim=-1) <= 0
    if bool(empty.any()):
        # filtering always keeps a row's top token, so this only guards against
        # NaN logits: stay inside the vocabulary rather than index past it
        probs[empty] = 0.0
        probs[empty, 0] = 1.0
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    # searchsorted(right=True) lands on the first token whose cdf exceeds the
    # target, which always has probability > 0; keeping the target strictly
    # below the total stops rounding from running off the end.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
