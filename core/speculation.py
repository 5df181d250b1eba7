"""Speculative decoding: the speculator interface, and verification of drafts against the target.

A speculator proposes up to ``k`` draft tokens for a decoding sequence (the
model runner asks right after a step samples, for the next step). The drafts
wait in ``Sequence.spec_token_ids``; the scheduler gives them lookahead
slots, ONE target forward runs over the last real token plus the drafts
(logits at every position), and the runner keeps the longest valid run plus
one token from the target:

    greedy:  accept draft i while it equals the target's argmax at i; then emit
             the target's argmax at the first mismatch (or after the last draft).
    sampled: accept draft x with probability min(1, p(x)/q(x)); on rejection
             emit a draw from normalise(max(0, p - q)) and stop; if all are
             accepted, emit a draw from p at the end (speculative sampling,
             Leviathan et al. 2023 / Chen et al. 2023), so the output
             distribution equals sampling from p alone.

``p`` is the target's filtered distribution (``logit_bias`` and the
``min_tokens`` ban per position, then temperature, top-k/p, min-p);
``q`` the draft's, or a point mass on the draft for deterministic proposers
(n-gram lookup). KV written for rejected drafts is rolled back: the sequence
forgets those positions, trailing blocks are freed, nothing is published.

A speculator may also propose a token tree (``Proposal.parents``): several
continuations verified in the same forward under a tree attention mask
(``core/token_tree.py``), of which the longest accepted path is kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierserve.cache.figures import Figures

if TYPE_CHECKING:
    import torch

    from tierserve.core.backend import ModelBackend
    from tierserve.core.sections import Settings
    from tierserve.core.sampler import SamplingRow
    from tierserve.core.sequence import Sequence


@dataclass(slots=True)
class DraftRequest:
    """One sequence to draft for: its history (the tokens just sampled included) and how many drafts at most.

    Attributes:
        num_tokens: the most draft tokens (tree nodes, for a tree speculator) to propose.
        max_depth: the longest path a proposal may have (the room left before ``max_tokens`` and the
            context length).
        hidden: the target's final hidden state (after the last norm) at the position that produced the
            newest token, ``[hidden_size]``, for speculators that set ``needs_hidden_states``; else None.
    """

    seq: Sequence
    token_ids: list[int]
    num_tokens: int
    max_depth: int = 0
    hidden: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.max_depth <= 0:
            self.max_depth = self.num_tokens


@dataclass(slots=True)
class Proposal:
    """Draft tokens for one sequence; ``probs[i]`` is the distribution draft ``i`` was drawn from
    (``None``: proposed deterministically, a point mass).

    ``parents`` (tree proposals, deterministic only): node ``i``'s parent, ``-1`` for the sequence's last
    real token or the index of an earlier node (``core/token_tree.py``); ``None``: one linear run."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None


class Speculator(ABC):
    """Proposes draft tokens (a plugin registered through ``register_speculators``).

    Args:
        settings: all settings (``[speculative]`` holds this speculator's knobs).
        target: the target model's backend (its tokenizer, vocab, device).
    """

    proposes_trees: bool = False  # proposals carry ``parents``: the runner gives it a node budget per sequence
    needs_hidden_states: bool = False  # DraftRequest.hidden is filled (backends with supports_hidden_states)

    def __init__(self, settings: Settings, target: ModelBackend) -> None:
        self.settings = settings
        self.target = target
        self.figures = Figures()  # the speculator's own counters and gauges (cache.figures), published with the engine's

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Up to ``request.num_tokens`` drafts continuing each ``request.token_ids`` (may be empty).

        ``request.token_ids`` is the sequence's whole history, the tokens sampled
        this step included (``request.seq.token_ids`` does not have them yet);
        ``request.seq`` gives the id, sampling parameters and generator. Runs on
        the engine core's thread, once per step, for every speculating sequence."""

    def release(self, seq: Sequence) -> None:
        """Forget per-sequence state (finished, aborted or preempted)."""

    def close(self) -> None:
        """Release models and memory."""


@dataclass
class SpeculationStats:
    """The model runner's verification counters (published as ``engine.stats.SpeculationSnapshot``)."""

    verifications: int = 0  # target forwards that checked drafts
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # accepted drafts + the target's own token
    depth: int = 0  # summed over verifications: the drafts' depth (k for a linear run, a tree's deepest path)
    tree_verifications: int = 0  # of the verifications, those of token trees
    tree_nodes: int = 0  # nodes those trees held
    errors: int = 0  # speculator calls that raised: those requests went on without speculation


def verify(logits: torch.Tensor, proposal: Proposal, rows: list[SamplingRow], greedy: bool) -> list[int]:
    """Tokens to emit: the accepted drafts, then one token of the target's.

    Args:
        logits: ``[len(drafts) + 1, vocab]`` target logits at the last real token and each draft.
        proposal: the drafts (and their draft distributions, if any).
        rows: per logits row, the sequence's sampling parameters, generator and the
            tokens banned at that position (``min_tokens``).
        greedy: whether the request decodes greedily.
    """
    import torch

    from tierserve.core.sampler import adjust_logits, adjusts, draw, filtered_probs

    drafts = proposal.token_ids
    row = rows[0]
    if any(adjusts(r) for r in rows):
        logits = logits.to(torch.float32, copy=True)
        adjust_logits(logits, rows)
    if greedy:
        targets = logits.argmax(dim=-1).tolist()
        emitted = []
        for draft, target in zip(drafts, targets):
            if draft != target:
                break
            emitted.append(draft)
        emitted.append(targets[len(emitted)])
        return emitted

    probs = filtered_probs(logits.to(torch.float32), rows)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    emitted = []
    for index, draft in enumerate(drafts):
        p = probs[index]
        q_of_draft = float(proposal.probs[index, draft]) if proposal.probs is not None else 1.0
        uniform = float(torch.rand(1, generator=row.generator, dtype=torch.float64, device=row.generator.device))
        if q_of_draft > 0 and uniform < min(1.0, float(p[draft]) / q_of_draft):
            emitted.append(draft)
            continue
        if proposal.probs is not None:
            residual = torch.clamp(p - proposal.probs[index].to(p.device, p.dtype), min=0.0)
        else:
            residual = p.clone()
            residual[draft] = 0.0
        if float(residual.sum()) <= 0.0:  # p == q: any draw from p is right
            residual = p
        emitted.append(int(draw(residual[None], [row])[0]))
        return emitted
    emitted.append(int(draw(probs[len(drafts)][None], [row])[0]))
    return emitted
