"""A float checkpoint's weight matrices quantized at load into GGUF blocks: ``model.quantization = "q4_0"``,
``"q4_k_m"`` ... on a Hugging Face directory (native backend).

Each matrix a linear layer multiplies by (every 2-D ``*.weight`` but the token embedding table, which is read
by row and held as int8 rows as with ``int8``) is rounded with llama.cpp's reference quantizer (the ``gguf``
package's for the 32-weight types, ``k_quantize.c``'s port of ``quantize_row_q4_K_ref`` and its siblings for
the K types), so a Hugging Face directory gets the memory and the kernels of a GGUF file of that type:

    q4_0, q4_1          every matrix Q4_0 / Q4_1 (4.5 / 5 bits a weight), ts_q4_gemm
    q8_0                GroupedInt8: 8 bits and a float32 scale per 32 (9 bits a weight), the q8 kernel
    q4_k, q5_k, q6_k    every matrix Q4_K / Q5_K / Q6_K (ts_q4_gemm, ts_q6k_gemm)
    q4_k_m, q5_k_m      llama-quantize's mixes (the head, v and down in Q6_K where it puts them: quant_mix)

A K type on a matrix whose width is not whole super-blocks of 256 falls back as llama-quantize does (Q4_K to
Q5_0, Q5_K to Q5_1, Q6_K to Q8_0); a width that is not whole blocks of 32 stays float (both logged).
"""

from __future__ import annotations

import re

import numpy as np
import structlog
import torch

from tierserve.models.quant_mix import FILE_TYPES, K_TYPES, Matrix, block_types
from tierserve.plugins.backends.gguf_weights import KEPT_BLOCK_BYTES, q8_0_groups
from tierserve.plugins.backends.linear import BlockQ4, BlockQ6K, GroupedInt8

# model.quantization -> (the llama.cpp file type whose block types it takes, whether every matrix gets its one type)
BLOCK_QUANTIZATIONS = {"q4_0": ("q4_0", True), "q4_1": ("q4_1", True), "q8_0": ("q8_0", True),
                       "q4_k": ("q4_k_m", True), "q5_k": ("q5_k_m", True), "q6_k": ("q6_k", True),
                       "q4_k_m": ("q4_k_m", False), "q5_k_m": ("q5_k_m", False)}  # fmt: skip
# the Hugging Face names of the matrices llama-quantize's rules name, in its (GGUF) names
_GGUF_ROLES = {"self_attn.v_proj": "attn_v", "mlp.down_proj": "ffn_down"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")

log = structlog.get_logger(__name__)


def quantize_state(state: dict[str, torch.Tensor], quantization: str) -> dict[str, torch.Tensor | BlockQ4 | BlockQ6K | GroupedInt8]:
    """``state`` (a float checkpoint's tensors by Hugging Face name) with each weight matrix in ``quantization``'s
    GGUF blocks (see the module docstring)."""
    from tierserve.plugins.backends.gguf_quantize import quantize_matrix

    matrices = {name: t for name, t in state.items() if t.dim() == 2 and name.endswith(".weight")
                and name != "model.embed_tokens.weight"}  # fmt: skip
    types = _types(matrices, quantization)
    out: dict[str, torch.Tensor | BlockQ4 | BlockQ6K | GroupedInt8] = dict(state)
    file_type, _ = BLOCK_QUANTIZATIONS[quantization]
    kept_float, fell_back = [], {}
    for name, tensor in matrices.items():
        kind = types[name]
        if FILE_TYPES[file_type][1] in K_TYPES and tensor.shape[1] % 256:
            fell_back[name] = kind
        if kind == "F16":  # no block fits the width: llama-quantize writes F16, the float checkpoint is kept
            kept_float.append(name)
            continue
        out[name] = _held(kind, np.asarray(quantize_matrix(tensor.float().numpy(), kind)), tensor.shape[0])
    if kept_float:
        log.warning("block_quantize_skipped", quantization=quantization, tensors=kept_float,
                    why="their width is not a multiple of 32")  # fmt: skip
    if fell_back:
        log.warning("block_quantize_fallback", quantization=quantization, tensors=fell_back,
                    why="their width is not whole super-blocks of 256 (llama-quantize's fallback types)")  # fmt: skip
    return out


def _types(matrices: dict[str, torch.Tensor], quantization: str) -> dict[str, str]:
    """Each matrix's block type: llama-quantize's rules under GGUF names, or one type with its fallbacks."""
    file_type, pure = BLOCK_QUANTIZATIONS[quantization]
    as_gguf = {_gguf_name(name): name for name in matrices}
    listed = [Matrix(gguf, 2, int(matrices[name].shape[1])) for gguf, name in as_gguf.items()]
    layers = 1 + max((m.layer for m in listed), default=-1)
    return {as_gguf[gguf]: kind for gguf, kind in block_types(listed, file_type, layers, pure=pure).items()}


def _gguf_name(name: str) -> str:
    if name == "lm_head.weight":
        return "output.weight"
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"blk.{match[1]}.{_GGUF_ROLES.get(match[2], match[2])}.weight"


def _held(kind: str, data: np.ndarray, rows: int) -> BlockQ4 | BlockQ6K | GroupedInt8:
    """A matrix's blocks as a GGUF file of that type is held (``gguf_weights``' layouts)."""
    if kind == "Q8_0":
        return q8_0_groups(data, rows)
    blocks = torch.from_numpy(np.ascontiguousarray(data.reshape(rows, -1, KEPT_BLOCK_BYTES[kind])))
    return BlockQ6K(blocks) if kind == "Q6_K" else BlockQ4(kind, blocks)
