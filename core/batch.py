"""The typed records one engine step passes along: scheduler → model runner → scheduler.

    Scheduler.schedule() ─► SchedulerOutput (chunks: which tokens of which sequence run now)
    ModelRunner.execute(SchedulerOutput) ─► RunnerOutput (sampled tokens, next drafts)
    Scheduler.update_from_output(SchedulerOutput, RunnerOutput) ─► CoreOutputs

A chunk names its tokens explicitly: the sequence's own tokens from ``start``,
then any speculative drafts, which live apart from the sequence's tokens
(``Sequence.spec_token_ids``) until verification accepts them. A decoding
sequence with drafts is still a decode (one real token), scheduled with
lookahead slots for its drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierserve.core.outputs import TokenLogprob
    from tierserve.core.sampler import SampledToken
    from tierserve.core.sequence import Sequence
    from tierserve.core.speculation import Proposal


@dataclass(slots=True, eq=False)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` from position ``start`` run this step.

    The last ``num_draft`` of them are the sequence's speculative drafts
    (``seq.spec_token_ids[:num_draft]``); the others are
    ``seq.token_ids[start : start + num_tokens - num_draft]``. Their KV goes to
    the slots of ``seq.block_table`` (already allocated by the scheduler).
    """

    seq: Sequence
    num_tokens: int
    num_draft: int = 0
    start: int = -1  # -1: the sequence's num_computed_tokens when the chunk was made

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.seq.num_computed_tokens

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the sequence itself (not drafts) this chunk computes."""
        return self.num_tokens - self.num_draft

    @property
    def token_ids(self) -> list[int]:
        """The chunk's input tokens, drafts last."""
        end = self.start + self.num_tokens - self.num_draft
        ids = self.seq.token_ids[self.start : end]
        if self.num_draft:
            ids = ids + self.seq.spec_token_ids[: self.num_draft]
        return ids

    @property
    def tree_parents(self) -> list[int] | None:
        """The drafts' parents when they form a token tree (``Proposal.parents``), else None (a linear run)."""
        proposal = self.seq.spec_proposal
        if not self.num_draft or proposal is None or proposal.parents is None:
            return None
        return proposal.parents[: self.num_draft]

    @property
    def samples(self) -> bool:
        """Whether this chunk brings the sequence up to date, so the step samples its next token."""
        return self.start + self.num_tokens - self.num_draft == self.seq.num_tokens

    @property
    def prompt_logit_positions(self) -> range:
        """Positions of this chunk whose logits score the prompt token after them (``params.prompt_logprobs``) and
        are not scored yet: the chunk's last tokens, up to the prompt's last but one (the last one's row samples)."""
        seq = self.seq
        if seq.params.prompt_logprobs is None:
            return range(0)
        first = max(self.start, len(seq.prompt_logprobs))
        return range(first, max(first, min(self.start + self.num_real_tokens, seq.num_prompt_tokens - 1)))

    @property
    def num_prompt_logits(self) -> int:
        """Rows of ``prompt_logit_positions``."""
        return 0 if self.seq.params.prompt_logprobs is None else len(self.prompt_logit_positions)

    @property
    def num_logits(self) -> int:
        """Logit rows the backend returns for this chunk, its last ``num_logits`` tokens: the prompt rows, then
        one per draft plus one, if it samples.

            prompt  t0 t1 t2 t3 t4 | t5 t6 t7      (a chunk from position 5 to the prompt's end, asking for
            rows                     r5 r6 r7       prompt logprobs: r5, r6 score t6, t7; r7 samples)
        """
        return self.num_prompt_logits + (self.num_draft + 1 if self.samples else 0)

    @property
    def released(self) -> tuple[int, int]:
        """Key positions ``[first, end)`` whose KV a sliding window released: never attend to them.

        Their block-table entries point at a placeholder block. ``(0, 0)``: nothing released.
        """
        return self.seq.kv_drop_start, self.seq.kv_drop_end


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch: the chunks to run, and the sequences preempted to make room."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)  # when the step began (monotonic clock)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class RunnerOutput:
    """What the model runner made of a batch.

    Attributes:
        sampled: per ``seq_id`` of every chunk that sampled, the tokens to
            append, in order: one, or with drafts the accepted drafts then the
            target's own token.
        proposals: per ``seq_id``, drafts for the sequence's next step (only
            for sequences that speculate).
        failed: per ``seq_id``, the request field at fault and why the sequence cannot go on (its grammar
            matcher failed: a schema too large or recursive to follow); it ends with that error.
        prompt_logprobs: per ``seq_id`` of every chunk with prompt rows (``num_prompt_logits``), the
            log-probabilities of the prompt tokens those rows predict, in order.
    """

    sampled: dict[int, list[SampledToken]] = field(default_factory=dict)
    proposals: dict[int, Proposal] = field(default_factory=dict)
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)  # seq_id -> (param, why): it ends with an error
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
