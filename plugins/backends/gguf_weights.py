"""A GGUF file's tensors as the native backend's state dict: Hugging Face names, Q8_0 kept int8, Q4 kept 4-bit.

Names and the q/k row order come from transformers' GGUF loader (its tensor
name map and its per-architecture tensor processor: llama.cpp's converter
permutes q/k rows for llama-family RoPE, and the processor undoes it). Here it
is applied to row indices, so a quantized tensor's rows move with their scales
and nothing passes through float that need not:

    F32 / F16 / BF16          as they are (then the model's dtype)
    Q8_0, quantization int8   GroupedInt8: int8 values and one scale per 32, bytes copied
          or gguf
    Q4_0 / Q4_1 / Q5_0 /      BlockQ4: the file's blocks, bytes copied (the token embedding table too: the rows
    Q5_1 / Q4_K / Q5_K,       a step reads are dequantized exactly)
          quantization gguf
    Q6_K, quantization gguf   BlockQ6K: the file's super-blocks, bytes copied
    Q8_0, quantization none   dequantized to the model's dtype (logged)
    any other type            dequantized by the gguf package, then the model's dtype
                              or, with quantization int8 or gguf, group-wise int8 (logged)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import structlog
import torch

from tierserve.core.errors import ConfigError
from tierserve.models.gguf import FLOAT_TYPES, check_gguf, open_reader
from tierserve.plugins.backends.linear import BLOCK_LAYOUTS, GROUP_SIZE, BlockQ4, BlockQ6K, GroupedInt8, quantize_groups

# bytes per block as stored (Q4_K, Q6_K: super-blocks of 256), for the types kept so (linear.BlockQ4, BlockQ6K)
KEPT_BLOCK_BYTES = {kind: size for kind, (size, _) in BLOCK_LAYOUTS.items()} | {"Q6_K": 210}

log = structlog.get_logger(__name__)


def hf_name_map(config, architecture: str):
    """(GGUF tensor name -> Hugging Face parameter name, transformers' tensor processor) for ``config``."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from tierserve.models.gguf_transformers import name_maps_built_once

    with torch.device("meta"):  # the parameter names only; nothing is allocated
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    with name_maps_built_once():
        return get_gguf_hf_weights_map(skeleton, processor), processor


def load_gguf_state(
    path: Path, config, dtype: torch.dtype, quantization: str
) -> dict[str, torch.Tensor | GroupedInt8 | BlockQ4 | BlockQ6K]:
    """Every tensor of the GGUF file ``path`` under its Hugging Face name (see the module docstring).

    Raises:
        ConfigError: the file fails ``check_gguf`` (truncated, corrupt, unknown type or architecture).
    """
    from gguf import GGMLQuantizationType, dequantize

    info = check_gguf(path)
    reader = open_reader(path)  # parsed once; tensor bytes memory-mapped
    names, processor = hf_name_map(config, info.architecture)
    state: dict[str, torch.Tensor | GroupedInt8 | BlockQ4 | BlockQ6K] = {}
    converted: dict[str, str] = {}
    kept: set[str] = set()
    for tensor in reader.tensors:
        data = reader.data(tensor)
        name = names.get(tensor.name)
        if name is None:  # e.g. llama.cpp's precomputed rope_freqs: the config rebuilds it
            log.info("gguf_tensor_skipped", tensor=tensor.name, path=str(path))
            continue
        kind = GGMLQuantizationType(tensor.tensor_type)
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else None  # GGUF lists dims innermost first
        order = processor.process(weights=np.arange(rows), name=tensor.name).weights if rows else None
        if kind == GGMLQuantizationType.Q8_0 and quantization in ("int8", "gguf") and rows:
            state[name] = q8_0_groups(data, rows, order)
            continue
        if kind.name in KEPT_BLOCK_BYTES and quantization == "gguf" and rows:
            blocks = np.asarray(data).reshape(rows, -1, KEPT_BLOCK_BYTES[kind.name])
            blocks = torch.from_numpy(np.ascontiguousarray(blocks[order] if order is not None else blocks))
            state[name] = BlockQ6K(blocks) if kind.name == "Q6_K" else BlockQ4(kind.name, blocks)
            kept.add(kind.name)
            continue
        if kind.name == "BF16":
            values = torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
        elif kind.name in ("F32", "F16"):
            values = torch.from_numpy(np.array(data))
        else:
            values = torch.from_numpy(dequantize(data, kind))  # the reader shaped it [rows, columns]
        if order is not None:
            values = values[torch.from_numpy(np.ascontiguousarray(order))]
        if kind.name in FLOAT_TYPES:
            state[name] = values.to(dtype)
        elif quantization in ("int8", "gguf") and rows and values.shape[-1] % GROUP_SIZE == 0:
            state[name] = quantize_groups(values)
            converted[kind.name] = "int8 (groups of 32)"
        else:
            state[name] = values.to(dtype)
            converted[kind.name] = str(dtype).removeprefix("torch.")
    for kind_name, target in converted.items():
        if kind_name in KEPT_BLOCK_BYTES or kind_name == "Q8_0":
            why = f"model.quantization = 'gguf' keeps {kind_name} as stored ({quantization!r} here)"
        else:
            why = f"{kind_name} has no kernel of its own (kept as stored: {', '.join([*KEPT_BLOCK_BYTES, 'Q8_0'])})"
        log.warning("gguf_dequantized", path=str(path), type=kind_name, to=target, why=why)
    kept_types = kept | ({"Q8_0"} if "Q8_0" in info.tensor_types and quantization in ("int8", "gguf") else set())
    if kept_types:
        kernels = {t: "q6k" if t == "Q6_K" else "q8" if t == "Q8_0" else "q4" for t in sorted(kept_types)}
        log.info("gguf_blocks_kept", path=str(path), types=sorted(kept_types), kernels=kernels)
    if not state:
        raise ConfigError(f"model.path {str(path)!r}: none of its tensors belongs to a {config.model_type} model")
    return state


def q8_0_groups(data: np.ndarray, rows: int, order: np.ndarray | None = None) -> GroupedInt8:
    """Q8_0 blocks (a float16 scale, then 32 int8 values) as int8 values and float32 scales, rows reordered."""
    blocks = np.asarray(data).reshape(rows, -1, 2 + GROUP_SIZE)
    if order is not None:
        blocks = blocks[order]
    scale = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0].astype(np.float32)
    values = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, -1)
    return GroupedInt8(torch.from_numpy(values), torch.from_numpy(scale))
