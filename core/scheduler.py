"""The scheduler contract: which sequences run at each step, and what a step's results do to them.

A scheduler plugin subclasses ``Scheduler`` and implements four things:
``add`` (queue a sequence), ``schedule`` (pick the step's chunks and give them
KV slots), ``finish`` (drop a sequence from its queues and free its blocks)
and the ``num_waiting``/``num_running`` counts. Everything after the forward
pass is the same for every policy and lives here, in ``update_from_output``.

The contract of ``schedule()``, which an outside scheduler must keep:

* Return a ``SchedulerOutput`` whose chunks cover ``seq.token_ids`` from
  ``seq.num_computed_tokens`` on (a chunk may stop short: chunked prefill),
  within ``settings.max_num_batched_tokens`` tokens and
  ``settings.max_num_seqs`` running sequences.
* Before a chunk is returned, ``self.kv.allocate_slots(seq, start + n)`` must
  have succeeded for it. When the pool is short, preempt with
  ``self.preempt(seq)`` (it frees the blocks and resets the progress for
  recompute), requeue the sequence yourself and list it in
  ``output.preempted``; never return a chunk of a preempted sequence.
* Call ``self.kv.match_prefix(seq)`` when admitting a sequence that holds no
  blocks, so its cached prefix is reused rather than recomputed.
* Size a prefill chunk with ``self.chunk_tokens(seq, budget, logit_rows)``: a
  prompt whose log-probabilities are asked for gets a logits row per position,
  so the scored positions of one step stop at ``PROMPT_LOGITS_PER_STEP``
  (``logit_rows`` is what the step's earlier chunks left of it; subtract each
  chunk's ``num_prompt_logits``). A 0 means none are left: that sequence waits
  for the next step.
* A decoding sequence (one uncomputed token) may carry speculative drafts in
  ``seq.spec_token_ids``: schedule them as lookahead slots
  (``ScheduledChunk(seq, 1 + k, num_draft=k)``, slots allocated up to
  ``start + 1 + k``), or fewer, or none: drafts that are not scheduled are
  simply dropped (``self.drop_drafts(seq, keep)``); nothing needs rolling back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from tierserve.cache.kv_manager import KVCacheManager
from tierserve.cache.figures import Figures
from tierserve.core.batch import RunnerOutput, SchedulerOutput
from tierserve.core.sections import SchedulerSettings
from tierserve.core.errors import QueueFullError
from tierserve.core.outputs import CoreOutput, TokenLogprob
from tierserve.core.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:  # the server process imports this module; torch belongs to the engine core's
    from tierserve.core.sampler import SampledToken

__all__ = ["PROMPT_LOGITS_PER_STEP", "ModelLimits", "QueueFullError", "Scheduler", "SchedulerStats"]

# prompt positions of one step whose full-vocabulary logits prompt logprobs need: 512 rows of a 152k vocabulary
# are 297 MiB of float32 logits, where a whole 8k-token step's would be 4.6 GiB
PROMPT_LOGITS_PER_STEP = 512


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the stop checks need to know of the model."""

    max_model_len: int | None = None
    eos_token_ids: Collection[int] = frozenset()


@dataclass(slots=True)
class SchedulerStats:
    """Counters kept as steps happen (read in O(1) for statistics)."""

    preemptions: int = 0
    generation_tokens: int = 0
    early_stops: int = 0  # a stop condition hit inside an accepted run of drafts
    finish_reasons: dict[str, int] = field(default_factory=dict)


class Scheduler(ABC):
    """Decides each step's batch under the token and sequence budgets, and applies its results.

    Args:
        settings: the ``[scheduler]`` section (budgets, queue bound).
        kv: the KV manager this scheduler owns: block tables, prefix reuse,
            rollback and sliding-window release.
        model: the model's context length and eos ids, for the stop checks.
    """

    def __init__(self, settings: SchedulerSettings, kv: KVCacheManager, model: ModelLimits | None = None) -> None:
        self.settings = settings
        self.kv = kv
        self.model = model or ModelLimits()
        self.stats = SchedulerStats()
        self.figures = Figures()  # the scheduler's own counters and gauges (cache.figures), published with the engine's
        # called for every sequence that leaves the running set (finished or preempted), so the
        # model runner can drop what it keeps per sequence; the engine core sets it
        self.on_release: Callable[[Sequence], None] = lambda seq: None

    # ---- what a policy implements ----------------------------------------------------

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raise ``QueueFullError`` if the waiting queue is full."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks and allocate their KV slots (see the module docstring)."""

    @abstractmethod
    def finish(self, seq: Sequence) -> None:
        """Drop a sequence (running or waiting) from the queues and free its blocks (``self.kv.free``)."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Sequences queued but not running."""

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Sequences holding KV blocks."""

    # ---- shared by every policy --------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return self.num_waiting + self.num_running > 0

    @staticmethod
    def chunk_tokens(seq: Sequence, budget: int, logit_rows: int = PROMPT_LOGITS_PER_STEP) -> int:
        """Tokens of ``seq`` (drafts aside) its next chunk computes within ``budget``: all it lacks, except that
        a prompt whose logprobs are asked for takes at most ``logit_rows`` positions that need logits (what the
        step has left of ``PROMPT_LOGITS_PER_STEP``; positions scored before a preemption need none). 0: it
        must wait for the next step."""
        tokens = min(seq.num_uncomputed_tokens, budget)
        if seq.needs_prompt_logits:
            scored_until = max(seq.num_computed_tokens, len(seq.prompt_logprobs))
            tokens = min(tokens, scored_until - seq.num_computed_tokens + max(0, logit_rows))
        return tokens

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and reset it for recompute (the caller requeues it)."""
        self.kv.reset(seq)
        self.drop_drafts(seq)
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.on_release(seq)

    @staticmethod
    def drop_drafts(seq: Sequence, keep: int = 0) -> None:
        """Keep only the first ``keep`` speculative drafts of ``seq`` (the rest will not be verified)."""
        del seq.spec_token_ids[keep:]
        if not seq.spec_token_ids:
            seq.spec_proposal = None

    def finish_sequence(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence for good: out of the queues, blocks freed, the runner told."""
        if seq.status is not SequenceStatus.FINISHED:
            self.finish(seq)
            self.on_release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.stats.finish_reasons[reason.value] = self.stats.finish_reasons.get(reason.value, 0) + 1

    def update_from_output(self, batch: SchedulerOutput, result: RunnerOutput) -> list[CoreOutput]:
        """Apply a step's results: advance each sequence, append its tokens, check stops, free what finished.

        Accepted drafts join ``token_ids`` and keep their KV; the lookahead
        slots of rejected ones are given back. Completed blocks are published
        to the prefix cache, blocks out of a sliding window are released, and
        the drafts proposed for the next step are attached.

        Returns:
            One ``CoreOutput`` per sequence that produced tokens or finished.
        """
        outputs: list[CoreOutput] = []
        for seq in batch.preempted:
            if seq.streaming and not seq.is_finished and seq.num_tokens > self.kv.capacity_tokens // 2:
                # its dropped KV cannot be recomputed within the budget: end it rather than loop
                self.finish_sequence(seq, FinishReason.LENGTH)
                outputs.append(self._output(seq, [], FinishReason.LENGTH, None))
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.is_finished:
                continue
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = batch.created
            seq.peak_blocks = max(seq.peak_blocks, self.kv.held_blocks(seq))  # a window's released blocks excluded
            seq.prompt_logprobs.extend(result.prompt_logprobs.get(seq.seq_id, ()))
            sampled = result.sampled.get(seq.seq_id)
            accepted = len(sampled) - 1 if chunk.num_draft and sampled else 0
            seq.num_computed_tokens = chunk.start + chunk.num_real_tokens + accepted
            self.drop_drafts(seq)
            if sampled is None:
                self.kv.cache_computed(seq)
                if chunk.samples and not seq.params.max_tokens:  # a prompt scored with nothing to generate
                    self.finish_sequence(seq, FinishReason.LENGTH)
                    outputs.append(self._output(seq, [], FinishReason.LENGTH, None))
                continue
            reason, tokens, logprobs = self._append(seq, sampled)
            failure = result.failed.get(seq.seq_id)
            if failure is not None:
                reason = FinishReason.ABORT
            if chunk.num_draft:
                seq.accepted_drafts += accepted
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                self.kv.trim(seq, seq.num_computed_tokens + 1)
            self.kv.cache_computed(seq)
            if reason is not None:
                self.finish_sequence(seq, reason)
            else:
                self.kv.release_out_of_window(seq)
                proposal = result.proposals.get(seq.seq_id)
                if proposal is not None and proposal.token_ids:
                    seq.spec_token_ids = list(proposal.token_ids)
                    seq.spec_proposal = proposal
            outputs.append(self._output(seq, tokens, reason, logprobs, failure))
        return outputs

    def _append(
        self, seq: Sequence, sampled: list[SampledToken]
    ) -> tuple[FinishReason | None, list[int], list[TokenLogprob] | None]:
        """Append sampled tokens up to the first that ends the sequence (eos, stop token, length)."""
        params = seq.params
        limit = self.model.max_model_len
        eos = self.model.eos_token_ids
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        reason = None
        for index, item in enumerate(sampled):
            token = item.token_id
            seq.token_ids.append(token)
            tokens.append(token)
            self.stats.generation_tokens += 1
            if logprobs is not None:
                logprobs.append(TokenLogprob(token, item.logprob, item.top_logprobs or []))
            if (token in eos and not params.ignore_eos) or token in params.stop_token_ids:
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= params.max_tokens or (
                limit is not None and seq.num_tokens >= limit and not seq.streaming
            ):
                reason = FinishReason.LENGTH
            if reason is not None:
                if index < len(sampled) - 1:
                    self.stats.early_stops += 1
                break
        return reason, tokens, logprobs

    @staticmethod
    def _output(
        seq: Sequence, tokens: list[int], reason: FinishReason | None, logprobs: list[TokenLogprob] | None,
        failure: tuple[str, str] | None = None,
    ) -> CoreOutput:
        cache = None
        if seq.cache_info_pending:
            cache, seq.cache_info_pending = seq.cache_info, False
        prompt_logprobs = None
        first = seq.num_output_tokens == len(tokens)
        if first and seq.params.prompt_logprobs is not None and not seq.needs_prompt_logits:
            prompt_logprobs = seq.prompt_logprobs
        return CoreOutput(
            seq.request_id,
            tokens,
            reason.value if reason is not None else None,
            logprobs,
            cache,
            seq.first_scheduled_time,
            seq.accepted_drafts,
            seq.windows_slid,
            seq.peak_blocks,
            error=failure[1] if failure is not None else None,
            error_param=failure[0] if failure is not None else None,
            prompt_logprobs=prompt_logprobs,
        )
