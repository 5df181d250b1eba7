"""FCFS: continuous batching with chunked prefill and recompute preemption, first come first served."""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from tierserve.core.batch import ScheduledChunk, SchedulerOutput
from tierserve.core.hookspecs import hookimpl
from tierserve.core.scheduler import PROMPT_LOGITS_PER_STEP, QueueFullError, Scheduler
from tierserve.core.sequence import Sequence, SequenceStatus


class FCFSScheduler(Scheduler):
    """Continuous batching in arrival order.

    Each step: sequences that are decoding get one token each first (so a long
    prefill never starves them), then running prefills continue in chunks,
    then waiting sequences are admitted while the token budget, the sequence
    cap and free blocks allow, and (``prefill_group_tokens``) while the new
    prompts' tokens together stay within that group size (the uncached tokens
    of those already admitted this step plus the next one's whole prompt): on
    a compute-bound device a step's time grows with its prefill tokens, so
    prefilling a burst one group a step gives the first prompts their first
    token after their own prefill instead of after everyone's. After a step
    that started prompts, ``decode_steps_between_prefills`` steps start none
    while any sequence decodes: with closed-loop clients (a chat sends its
    next turn as its last one ends) sequences that finish one step apart
    would otherwise send prompts that each arrive during the previous one's
    prefill step and wait all of it, turn after turn.

    Prompts whose logprobs are asked for take at most ``PROMPT_LOGITS_PER_STEP`` scored positions a step
    together (each returns a vocabulary-wide logits row).

    When a running sequence needs a block and none is free, the last-admitted
    running sequence is preempted: its blocks are freed and it goes back to
    the front of the queue, to be recomputed from its prompt plus what it
    already generated.
    """

    def __init__(self, settings, kv, model=None) -> None:
        super().__init__(settings, kv, model)
        self._waiting: list[tuple[Any, Sequence]] = []  # heap by order key
        self._running: list[Sequence] = []
        self._counter = itertools.count()
        self._steps_before_prompts = 0  # steps that start no new prompt while sequences decode

    def order_key(self, seq: Sequence) -> Any:
        """Lower runs first; preemption takes the highest. Subclasses change the policy here."""
        return (seq.arrival_time, seq.seq_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def add(self, seq: Sequence) -> None:
        if len(self._waiting) >= self.settings.max_waiting_requests:
            raise QueueFullError(
                f"{len(self._waiting)} requests are waiting (max_waiting_requests = "
                f"{self.settings.max_waiting_requests}); retry later"
            )
        self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (self.order_key(seq), next(self._counter), seq))

    def finish(self, seq: Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        else:
            for i, entry in enumerate(self._waiting):
                if entry[-1] is seq:
                    self._waiting[i] = self._waiting[-1]
                    self._waiting.pop()
                    heapq.heapify(self._waiting)
                    break
        self.kv.free(seq)

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self._running.remove(seq)
        self.preempt(seq)
        self._push_waiting(seq)
        output.preempted.append(seq)

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, output: SchedulerOutput) -> bool:
        """Allocate slots for ``seq``, preempting lower-priority running sequences; False if ``seq`` itself had to go."""
        target = seq.num_computed_tokens + num_tokens
        while not self.kv.allocate_slots(seq, target):
            victim = max(self._running, key=self.order_key)
            self._preempt(victim, output)
            if victim is seq:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.settings.max_num_batched_tokens
        self._running.sort(key=self.order_key)
        decoding = [s for s in self._running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self._running if s.num_uncomputed_tokens > 1]
        logit_rows = PROMPT_LOGITS_PER_STEP  # scored prompt positions this step may still take

        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_tokens = min(self.chunk_tokens(seq, budget, logit_rows) + len(seq.spec_token_ids), budget)
            if not num_tokens:  # a scored prompt, and the step's logits rows are taken
                continue
            num_draft = max(0, num_tokens - seq.num_uncomputed_tokens)
            self.drop_drafts(seq, num_draft)  # the drafts the budget cannot cover are not verified
            if self._allocate_or_preempt(seq, num_tokens, output):
                chunk = ScheduledChunk(seq, num_tokens, num_draft)
                output.chunks.append(chunk)
                budget -= num_tokens
                logit_rows -= chunk.num_prompt_logits
        # a preemption victim may have been scheduled before it was chosen
        output.chunks = [c for c in output.chunks if c.seq.status is SequenceStatus.RUNNING]
        budget = self.settings.max_num_batched_tokens - output.num_tokens

        group_limit, group_tokens = self.settings.prefill_group_tokens, 0
        hold = bool(decoding) and self._steps_before_prompts > 0
        self._steps_before_prompts = self._steps_before_prompts - 1 if hold else 0
        parked = []  # prompts whose prefixes are still being read below L1: the ones after them go first
        if not output.preempted and not hold:
            while self._waiting and budget > 0 and len(self._running) < self.settings.max_num_seqs:
                seq = self._waiting[0][-1]
                # judged on the whole prompt, before the cache is asked: a deferred prompt is looked up once
                if group_limit and group_tokens and group_tokens + min(seq.num_uncomputed_tokens, budget) > group_limit:
                    break
                if not self.kv.can_admit(seq, budget):  # short of blocks: not looked up, nothing counted
                    break
                if not self.kv.prefix_loaded(seq):
                    parked.append(heapq.heappop(self._waiting))
                    continue
                self.kv.match_prefix(seq)  # cached prefix blocks are shared, not recomputed
                num_tokens = self.chunk_tokens(seq, budget, logit_rows)
                if not num_tokens:  # a scored prompt, and the step's logits rows are taken: it starts next step
                    break
                if not self.kv.allocate_slots(seq, seq.num_computed_tokens + num_tokens):
                    self.kv.missed_admission(seq, seq.num_computed_tokens + num_tokens)
                    break
                seq.blocks_wanted = 0
                group_tokens += num_tokens
                heapq.heappop(self._waiting)
                seq.status = SequenceStatus.RUNNING
                self._running.append(seq)
                chunk = ScheduledChunk(seq, num_tokens)
                output.chunks.append(chunk)
                budget -= num_tokens
                logit_rows -= chunk.num_prompt_logits
                self._steps_before_prompts = self.settings.decode_steps_between_prefills
        for item in parked:
            heapq.heappush(self._waiting, item)
        return output


@hookimpl
def register_schedulers(register):
    register("fcfs", FCFSScheduler, description="continuous batching, first come first served")
