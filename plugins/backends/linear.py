"""Dense layers for the native backend: weights prepacked for oneDNN on CPU, ``F.linear`` elsewhere.

PyTorch's CPU ``F.linear`` calls MKL, whose fp32 GEMV/GEMM reached 16 GB/s of
weight reads on the 2-core AMD machine this was tuned on, while the same
matmuls through oneDNN with a prepacked weight reached 37-60 GB/s (2.5-4x
faster at every batch size from 1 to 256). Decode is a GEMV over all weights,
so this is most of a token's cost. Results differ from MKL only in summation
order (about 1e-6 relative).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

KERNELS = ("auto", "onednn", "torch")


def _onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:  # bf16/fp16 need CPU support that a build may lack; a tiny call is the reliable probe
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8, dtype=dtype))
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), weight, None, "none", [], "")
        return bool(torch.allclose(out.float(), torch.full((2, 4), 8.0)))
    except RuntimeError:
        return False


class Linear:
    """``y = x @ weight.T + bias`` with the weight stored in the kernel's preferred layout."""

    __slots__ = ("weight", "bias", "packed", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = packed
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            rows = x.reshape(-1, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


class LinearFactory:
    """Builds every dense layer of one model with one kernel choice (``auto``: oneDNN where it works)."""

    def __init__(self, kernel: str, device: torch.device, dtype: torch.dtype) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"plugins.native.linear_kernel: got {kernel!r}, allowed: {', '.join(KERNELS)}")
        available = _onednn_available(device, dtype)
        if kernel == "onednn" and not available:
            raise ValueError(
                f"plugins.native.linear_kernel: 'onednn' needs a CPU device and a PyTorch build with oneDNN "
                f"linear support for {dtype}; use 'auto' or 'torch'"
            )
        self.packed = available and kernel != "torch"
        self.kernel = "onednn" if self.packed else "torch"

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return Linear(weight, bias, self.packed)
