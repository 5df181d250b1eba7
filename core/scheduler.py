"""The scheduler interface: which sequences run at each engine step, and how many tokens each."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from tierserve.cache.block_pool import KVCacheManager
from tierserve.core.config import SchedulerSettings
from tierserve.core.sequence import Sequence


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``; the server answers 503 + Retry-After."""


@dataclass(slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``seq.num_computed_tokens`` run this step."""

    seq: Sequence
    num_tokens: int
    num_draft: int = 0  # the chunk's last num_draft tokens are speculative drafts to verify

    @property
    def num_logits(self) -> int:
        """Logit rows the backend returns for this chunk: one per draft plus one, if it samples."""
        return self.num_draft + 1 if self.samples else 0

    @property
    def samples(self) -> bool:
        """Whether this chunk brings the sequence up to date, so the step samples its next token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler(ABC):
    """Decides each step's batch under the token and sequence budgets.

    Args:
        settings: the ``[scheduler]`` section (budgets, queue bound).
        kv: the block-table manager; the scheduler allocates blocks for what
            it schedules and frees those of sequences it preempts.
    """

    def __init__(self, settings: SchedulerSettings, kv: KVCacheManager) -> None:
        self.settings = settings
        self.kv = kv

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raise ``QueueFullError`` if the waiting queue is full."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks, allocating their KV slots (preempting if blocks run out)."""

    @abstractmethod
    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence (running or waiting) and free its blocks."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Sequences queued but not running."""

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Sequences holding KV blocks."""

    @property
    def has_unfinished(self) -> bool:
        return self.num_waiting + self.num_running > 0
