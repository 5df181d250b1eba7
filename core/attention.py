"""Which scaled-dot-product-attention kernels a backend may use: ``[sliding_window] use_flash_attention``.

``true`` leaves the choice to torch, which takes the fastest kernel the device
and the call allow (flash, memory-efficient, math as the last resort);
``false`` forces the math kernel (a reference for comparing outputs, or a way
around a fused kernel that misbehaves on some device).

torch keeps the kernel switches process-wide, so a forced choice is applied
around each forward and undone after it, rather than once at start-up: other
engines in the process keep their own choice between steps.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import structlog
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

log = structlog.get_logger(__name__)

MATH = "math"
FLASH_MIN_CAPABILITY = (8, 0)  # torch's flash kernel needs Ampere or newer


@dataclass(frozen=True, slots=True)
class AttentionKernel:
    """The kernels attention may run on, as reported (``ModelInfo.attention_kernel``) and as enforced.

    Attributes:
        name: e.g. ``"flash/efficient/math (torch picks)"`` or ``"math"``.
        forced: the only kernels torch may use; empty: torch chooses among all.
    """

    name: str
    forced: tuple[SDPBackend, ...] = ()

    def scope(self) -> AbstractContextManager[object]:
        """Wrap every forward in this: it enforces ``forced`` for the duration."""
        return sdpa_kernel(list(self.forced)) if self.forced else nullcontext()


def _fused_kernels(device: torch.device) -> list[str]:
    """The fused kernels torch has for ``device`` (cpu, cuda); logs why flash is missing on a GPU without it."""
    if device.type == "cpu":
        return ["flash"]  # torch's CPU flash kernel; there is no memory-efficient one on CPU
    reason = None
    if not torch.backends.cuda.is_flash_attention_available():
        reason = "this torch build has no flash attention kernel"
    elif torch.cuda.get_device_capability(device) < FLASH_MIN_CAPABILITY:
        reason = f"flash attention needs compute capability {FLASH_MIN_CAPABILITY[0]}.{FLASH_MIN_CAPABILITY[1]} or newer"
    if reason is None:
        return ["flash", "efficient"]
    log.warning("flash_attention_unavailable", device=str(device), reason=reason, using="efficient/math")
    return ["efficient"]


def attention_kernel(use_flash_attention: bool, device: torch.device) -> AttentionKernel:
    """The kernel choice ``[sliding_window] use_flash_attention`` asks for on ``device``.

    Forcing math always works (every device has it); where a fused kernel is
    missing, ``true`` falls back to what torch has, and the reported name (and
    a warning at start-up, on a GPU) says so.
    """
    if not use_flash_attention:
        return AttentionKernel(MATH, (SDPBackend.MATH,))
    if device.type not in ("cpu", "cuda"):
        return AttentionKernel("torch picks")
    kernels = [*_fused_kernels(device), MATH]
    return AttentionKernel(f"{'/'.join(kernels)} (torch picks)")
