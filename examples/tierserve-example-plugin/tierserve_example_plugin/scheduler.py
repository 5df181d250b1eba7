"""An example tierserve scheduler: shortest prompt first, written from the scheduler contract alone.

It subclasses ``tierserve.core.scheduler.Scheduler`` (not a built-in
scheduler) and keeps the promises that class's docstring lists: budgets,
slots allocated before a chunk is returned, preemption through
``self.preempt``, ``kv.match_prefix`` on admission, drafts as lookahead
slots. Applying the step's results is the base class's job.
"""

from __future__ import annotations

from tierserve.core import hookimpl
from tierserve.core.batch import ScheduledChunk, SchedulerOutput
from tierserve.core.scheduler import PROMPT_LOGITS_PER_STEP, QueueFullError, Scheduler
from tierserve.core.sequence import Sequence, SequenceStatus


class ShortestPromptFirst(Scheduler):
    """Admits the waiting sequence with the fewest tokens first; under memory pressure the longest running one yields."""

    def __init__(self, settings, kv, model=None) -> None:
        super().__init__(settings, kv, model)
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def add(self, seq: Sequence) -> None:
        if len(self._waiting) >= self.settings.max_waiting_requests:
            raise QueueFullError(f"max_waiting_requests = {self.settings.max_waiting_requests} reached; retry later")
        seq.status = SequenceStatus.WAITING
        self._waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self.kv.free(seq)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.settings.max_num_batched_tokens
        logit_rows = PROMPT_LOGITS_PER_STEP  # scored prompt positions this step may still take
        # decodes before prefills, shorter sequences first
        for seq in sorted(self._running, key=lambda s: (s.num_uncomputed_tokens > 1, s.num_tokens)):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_tokens = min(self.chunk_tokens(seq, budget, logit_rows) + len(seq.spec_token_ids), budget)
            if not num_tokens:  # a scored prompt, and the step's logits rows are taken
                continue
            num_draft = max(0, num_tokens - seq.num_uncomputed_tokens)
            self.drop_drafts(seq, num_draft)
            if self._allocate_or_preempt(seq, seq.num_computed_tokens + num_tokens, output):
                chunk = ScheduledChunk(seq, num_tokens, num_draft)
                output.chunks.append(chunk)
                budget -= num_tokens
                logit_rows -= chunk.num_prompt_logits
        output.chunks = [c for c in output.chunks if c.seq.status is SequenceStatus.RUNNING]
        if output.preempted:
            return output  # memory is short: admit nothing new this step
        budget = self.settings.max_num_batched_tokens - output.num_tokens
        self._waiting.sort(key=lambda s: s.num_tokens)
        while self._waiting and budget > 0 and len(self._running) < self.settings.max_num_seqs:
            seq = self._waiting[0]
            self.kv.match_prefix(seq)
            num_tokens = self.chunk_tokens(seq, budget, logit_rows)
            if not num_tokens:
                break
            if not self.kv.allocate_slots(seq, seq.num_computed_tokens + num_tokens):
                self.kv.reset(seq)
                break
            self._waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            chunk = ScheduledChunk(seq, num_tokens)
            output.chunks.append(chunk)
            budget -= num_tokens
            logit_rows -= chunk.num_prompt_logits
        return output

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, output: SchedulerOutput) -> bool:
        """Slots for ``seq`` up to ``num_tokens``, preempting the longest running sequences; False if ``seq`` went."""
        while not self.kv.allocate_slots(seq, num_tokens):
            victim = max(self._running, key=lambda s: s.num_tokens)
            self._running.remove(victim)
            self.preempt(victim)
            victim.status = SequenceStatus.WAITING
            self._waiting.append(victim)
            output.preempted.append(victim)
            if victim is seq:
                return False
        return True


@hookimpl
def register_schedulers(register):
    register("sjf", ShortestPromptFirst, description="shortest prompt first (example plugin)")
