"""A float checkpoint's weight matrices quantized at load into GGUF blocks: ``model.quantization = "q4_0"``,
``"q4_1"`` or ``"q8_0"`` on a Hugging Face directory (native backend).

Each matrix a linear layer multiplies by (every 2-D ``*.weight`` but the token embedding table, which is read
by row and held as int8 rows as with ``int8``) is rounded with llama.cpp's reference quantizer
(``quantize_row_q4_0_ref`` and its siblings, as the ``gguf`` package implements them), so a Hugging Face
directory gets the memory and the kernels of a GGUF file of that type:

    q4_0   BlockQ4 Q4_0: 4.5 bits a weight, ts_q4_gemm
    q4_1   BlockQ4 Q4_1: 5 bits a weight, ts_q4_gemm
    q8_0   GroupedInt8: 8 bits and a float32 scale per 32 (9 bits a weight), the q8 kernel
"""

from __future__ import annotations

import numpy as np
import structlog
import torch

from tierserve.plugins.backends.linear import GROUP_SIZE, BlockQ4, GroupedInt8

BLOCK_QUANTIZATIONS = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0"}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}

log = structlog.get_logger(__name__)


def quantize_state(state: dict[str, torch.Tensor], quantization: str) -> dict[str, torch.Tensor | BlockQ4 | GroupedInt8]:
    """``state`` (a float checkpoint's tensors by Hugging Face name) with each weight matrix in ``quantization``'s
    GGUF blocks (see the module docstring); a matrix whose width is not whole blocks of 32 stays float (logged)."""
    from gguf import GGMLQuantizationType, quantize

    kind = BLOCK_QUANTIZATIONS[quantization]
    out: dict[str, torch.Tensor | BlockQ4 | GroupedInt8] = {}
    kept_float = []
    for name, tensor in state.items():
        if tensor.dim() != 2 or not name.endswith(".weight") or name == "model.embed_tokens.weight":
            out[name] = tensor
            continue
        if tensor.shape[1] % GROUP_SIZE:
            out[name] = tensor
            kept_float.append(name)
            continue
        rows = tensor.shape[0]
        data = quantize(tensor.float().numpy(), GGMLQuantizationType[kind]).reshape(rows, -1, _BLOCK_BYTES[kind])
        if kind == "Q8_0":
            scale = np.ascontiguousarray(data[:, :, :2]).view(np.float16)[:, :, 0].astype(np.float32)
            values = np.ascontiguousarray(data[:, :, 2:]).view(np.int8).reshape(rows, -1)
            out[name] = GroupedInt8(torch.from_numpy(values), torch.from_numpy(scale))
        else:
            out[name] = BlockQ4(kind, torch.from_numpy(np.ascontiguousarray(data)))
    if kept_float:
        log.warning("block_quantize_skipped", quantization=quantization, tensors=kept_float,
                    why=f"their width is not a multiple of {GROUP_SIZE}")  # fmt: skip
    return out
