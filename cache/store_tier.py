"""What the tiered store is given: a tier below L1 with its name, and the backend's block copier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tierserve.cache.tier import CacheTier

if TYPE_CHECKING:
    import torch


class KVTransfer(Protocol):
    """Copies blocks between the backend's arena and CPU tensors ``[n, layers, 2, block_size, kv_heads, head_dim]``."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None: ...


@dataclass(slots=True)
class StoreTier:
    """A tier below L1, as the store uses it.

    Attributes:
        name: how statistics and ``clear`` name it (from settings, e.g. ``"l2"``,
            ``"l3"``, ``"redis"``); ``"l1"`` and ``"all"`` are reserved.
        tier: the storage.
        write_through: also write every newly computed block here
            (persistence). Entries written through are views of one batched
            copy off the pool: a tier that keeps tensors as given keeps that
            batch alive, so write through to tiers that encode (disk).
    """

    name: str
    tier: CacheTier
    write_through: bool = False
