"""What an engine's cache holds, as events a router can follow: blocks stored and removed, per tier.

Every change of where a block is goes through ``Placement``, which tells this
log; the log batches the changes and numbers the batches, as vLLM's KV events
do for llm-d and Dynamo. A reader (the fleet's replica publisher) asks for
everything after the last batch it has:

    KVEventLog.since(epoch, seq) ─► KVEvents(batches after seq)     it is caught up
                                 └► KVEvents(snapshot=every holding)  another epoch (a restarted engine),
                                                                       or it fell further behind than the log keeps

so a lost, repeated or out-of-order batch is never applied as a belief: the
reader sees a gap in the numbers and asks again from scratch (``seq = -1``).
Only tiers private to this engine are reported (L1 and its memory and disk
tiers); a shared tier (Redis) holds the same blocks for every replica.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_BATCHES = 1024  # batches kept for readers that are behind; further behind, they get a snapshot


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The changes of one interval, in order: ``(stored, position, key)`` (``stored`` False: removed)."""

    seq: int
    changes: tuple[tuple[bool, int, bytes], ...]


@dataclass(frozen=True, slots=True)
class KVEvents:
    """An answer to ``since``: the batches after the reader's ``seq``, or a ``snapshot`` to start over from.

    Attributes:
        epoch: this log's identity; a new one (a restarted engine) means every belief about the old is void.
        seq: the last batch's number (what the reader asks from next time).
        snapshot: position -> the keys held there, when the reader must start over; else None.
        positions: the names of the reported positions (``"l1"`` first), by position.
    """

    epoch: str
    seq: int
    batches: tuple[KVEventBatch, ...] = ()
    snapshot: dict[int, list[bytes]] | None = None
    positions: dict[int, str] = field(default_factory=dict)


class KVEventLog:
    """Numbered batches of block changes of the reported ``positions`` (position -> tier name).

    Not thread-safe: the engine's step thread records, and answers ``since`` between steps.

    Args:
        positions: the positions reported (L1 and the private tiers), with their names.
        holdings: position -> the keys held there now (for a snapshot).
    """

    def __init__(self, positions: dict[int, str], holdings: Callable[[int], list[bytes]], max_batches: int = MAX_BATCHES) -> None:
        self.positions = dict(positions)
        self.holdings = holdings
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.recorded = 0  # changes recorded so far: a reader that saw this count has nothing new to ask for
        self._pending: list[tuple[bool, int, bytes]] = []
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)

    def record(self, stored: bool, position: int, key: bytes) -> None:
        """``key`` arrived at (``stored``) or left ``position``; positions not reported are ignored."""
        if position in self.positions:
            self._pending.append((stored, position, key))
            self.recorded += 1

    def since(self, epoch: str | None, seq: int) -> KVEvents:
        """Everything after batch ``seq`` of ``epoch`` (the changes recorded since the last call become a batch)."""
        if self._pending:
            self.seq += 1
            self._batches.append(KVEventBatch(self.seq, tuple(self._pending)))
            self._pending = []
        oldest = self._batches[0].seq if self._batches else self.seq + 1
        if epoch != self.epoch or seq < oldest - 1 or seq > self.seq:
            snapshot = {position: self.holdings(position) for position in self.positions}
            return KVEvents(self.epoch, self.seq, snapshot=snapshot, positions=self.positions)
        batches = tuple(batch for batch in self._batches if batch.seq > seq)
        return KVEvents(self.epoch, self.seq, batches, positions=self.positions)
