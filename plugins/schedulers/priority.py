"""Priority: FCFS continuous batching ordered by each request's priority (lower value first)."""

from __future__ import annotations

from typing import Any

from tierserve.core.hookspecs import hookimpl
from tierserve.core.sequence import Sequence
from tierserve.plugins.schedulers.fcfs import FCFSScheduler


class PriorityScheduler(FCFSScheduler):
    """Admits by (priority, arrival); under memory pressure preempts the lowest priority first."""

    def order_key(self, seq: Sequence) -> Any:
        return (seq.priority, seq.arrival_time, seq.seq_id)


@hookimpl
def register_schedulers(register):
    register("priority", PriorityScheduler, description="continuous batching by request priority, then arrival")
