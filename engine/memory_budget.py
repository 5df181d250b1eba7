"""Fitting the configured cache sizes to the machine: the L1 pool and the memory tiers' byte bounds.

A preset keeps the serving spec's values (L1 10,000 blocks, an 8 GB memory tier, ...); on a machine
where they cannot hold, the engine takes less and logs why (``kv_l1_sized_down``,
``kv_memory_tier_sized_down``) instead of failing to start or being killed later:

    L1 pool (allocated at start)  ≤ [kv_cache] l1_memory_fraction of the memory free now on its device
                                    (after the weights; unset: L1_SHARE_CUDA on a GPU, L1_SHARE on a CPU)
    memory tiers' max_bytes, sum  ≤ TIERS_SHARE of the host memory left after the L1 pool

Host memory is ``MemAvailable`` of ``/proc/meminfo``; where it cannot be read (not Linux), nothing is
sized down. GPU memory is ``torch.cuda.mem_get_info``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

L1_SHARE = 0.5  # of the device memory free once the weights are loaded; the rest is for activations and the process
L1_SHARE_CUDA = 0.9  # a GPU holds little else: weights are loaded, activations are small beside the KV pool
TIERS_SHARE = 0.5  # of the host memory left after the L1 pool: memory tiers fill as blocks are demoted


@dataclass(frozen=True, slots=True)
class Fitted:
    """A size the engine takes: ``value``, and why it is below what was asked (None: as asked)."""

    value: int
    reason: str | None = None


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Host memory available to new allocations without swapping (``MemAvailable``), or None if unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_available_bytes(device: torch.device) -> int | None:
    """Memory free now where the KV pool lives: that GPU's for a ``cuda`` device (what the allocator caches
    from loading the weights given back first), the host's otherwise."""
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


def fit_l1_blocks(
    requested: int, block_bytes: int, device_type: str, available: int | None, share: float | None = None
) -> Fitted:
    """The L1 pool's blocks: ``requested``, or fewer where they would take more than ``share`` of the memory
    ``available`` on the device (None: ``L1_SHARE_CUDA`` on a GPU, ``L1_SHARE`` elsewhere)."""
    if available is None or block_bytes <= 0:
        return Fitted(requested)
    if share is None:
        share = L1_SHARE_CUDA if device_type == "cuda" else L1_SHARE
    fits = max(1, int(available * share) // block_bytes)
    if requested <= fits:
        return Fitted(requested)
    reason = (
        f"{requested} blocks of {block_bytes} bytes ({_gib(requested * block_bytes)}) would take more than "
        f"{share:.0%} of the {_gib(available)} free on {device_type}"
    )
    return Fitted(fits, reason)


def fit_memory_tiers(requested: list[int], available: int | None) -> list[Fitted]:
    """Each memory tier's ``max_bytes`` (0: no byte bound, left alone), lowered in proportion where together
    they would pass ``TIERS_SHARE`` of the host memory ``available`` after the L1 pool."""
    bounded = sum(requested)
    if available is None or not bounded:
        return [Fitted(value) for value in requested]
    room = int(max(0, available) * TIERS_SHARE)
    if bounded <= room:
        return [Fitted(value) for value in requested]
    reason = (
        f"the memory tiers' max_bytes add up to {_gib(bounded)}, more than {TIERS_SHARE:.0%} of the "
        f"{_gib(available)} of host memory left after the L1 pool"
    )
    return [Fitted(max(1, value * room // bounded), reason) if value else Fitted(0) for value in requested]


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"
