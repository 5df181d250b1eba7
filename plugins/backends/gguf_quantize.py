"""A GGUF file written again with its weight matrices in another llama.cpp file type: ``tierserve quantize``.

Every metadata key of the source is copied as it is (architecture, hyperparameters, tokenizer, chat
template), ``general.file_type`` says the new type, each matrix gets the block type ``llama-quantize`` picks for
that file type (``models.quant_mix``: Q4_K_M's Q6_K head, v and down, fallbacks where a width is not whole
super-blocks) and is rounded by llama.cpp's reference quantizer: the ``gguf`` package's ``quantize`` for the
32-weight types (``quantize_row_q4_0_ref`` and its siblings), tierserve's port of ``quantize_row_q4_K_ref``,
``..._q5_K_ref`` and ``..._q6_K_ref`` (``plugins/backends/k_quantize.c``) for the K types. The result holds the
bytes ``llama-quantize`` writes from the same float weights (without an importance matrix); llama-server and
tierserve both load it. 1-D tensors (norms, biases) stay as they are. Sources in F32, F16, BF16 or Q8_0 are
quantized from their values; other quantized sources need ``allow_requantize`` (their rounding is then rounded
again, as ``llama-quantize --allow-requantize`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tierserve.core.errors import ConfigError
from tierserve.models.quant_mix import FILE_TYPES, K_TYPES, Matrix, block_types

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGMLQuantizationType

    from tierserve.plugins.backends.cpu_gemm_abi import Kernels

TARGETS = FILE_TYPES  # the --type values
SOURCES = ("F32", "F16", "BF16", "Q8_0")  # quantized without allow_requantize


@dataclass(frozen=True, slots=True)
class QuantizeSummary:
    """What ``quantize_gguf`` wrote: tensors quantized and kept, and the sizes before and after."""

    quantized: int
    kept: int
    source_bytes: int
    target_bytes: int


def quantize_gguf(source: Path, target: Path, kind: str, allow_requantize: bool = False) -> QuantizeSummary:
    """Write ``source`` (a GGUF file) to ``target`` as the file type ``kind`` (a key of ``TARGETS``).

    Raises:
        ConfigError: an unknown ``kind``, a source that is not a readable GGUF file, a quantized source without
            ``allow_requantize``, a K type where tierserve's kernels are not built, or a target that exists.
    """
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

    from tierserve.models.gguf import check_gguf

    if kind not in TARGETS:
        raise ConfigError(f"--type {kind!r}: allowed: {', '.join(TARGETS)}")
    if target.exists():
        raise ConfigError(f"{target} exists: give a new file name")
    check_gguf(source)  # truncated, corrupt or unknown: a ConfigError naming what was found
    reader = GGUFReader(source)
    stored = {t.name: GGMLQuantizationType(t.tensor_type) for t in reader.tensors}
    matrices = [Matrix(t.name, len(t.shape), int(t.shape[0])) for t in reader.tensors]  # GGUF lists dims innermost first
    architecture = reader.get_field("general.architecture").contents()
    layers_field = reader.get_field(f"{architecture}.block_count")
    types = block_types(matrices, kind, int(layers_field.contents()) if layers_field is not None else 0)
    requantized = sorted({stored[name].name for name in types} - set(SOURCES))
    if requantized and not allow_requantize:
        raise ConfigError(f"{source} holds {', '.join(requantized)} weights: quantizing them again loses more than "
                          "quantizing the float weights; pass --allow-requantize to do it anyway")  # fmt: skip
    if any(t in K_TYPES for t in types.values()):
        k_kernels(kind)
    writer = GGUFWriter(target, architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    writer.add_file_type(LlamaFileType[TARGETS[kind][0]])
    quantized = kept = 0
    try:
        for tensor in reader.tensors:
            block = types.get(tensor.name)
            if block is None or GGMLQuantizationType[block] == stored[tensor.name]:
                writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=stored[tensor.name])
                kept += 1
                continue
            values = float32_values(np.asarray(tensor.data), stored[tensor.name])
            writer.add_tensor(tensor.name, quantize_matrix(values, block), raw_dtype=GGMLQuantizationType[block])
            quantized += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        target.unlink(missing_ok=True)  # never a half-written file
        raise
    writer.close()
    return QuantizeSummary(quantized, kept, source.stat().st_size, target.stat().st_size)


def float32_values(data: np.ndarray, stored: GGMLQuantizationType) -> np.ndarray:
    """A tensor's values as float32 (F32 as it is, BF16 widened, other types dequantized by gguf)."""
    import numpy as np
    from gguf import dequantize

    if stored.name == "F32":
        return np.asarray(data, dtype=np.float32)
    if stored.name == "BF16":
        return (np.asarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(dequantize(data, stored), dtype=np.float32)


def quantize_matrix(values: np.ndarray, block: str) -> np.ndarray:
    """float32 ``[rows, columns]`` in ``block``'s bytes (uint8 ``[rows, row bytes]``, F16 as float16):
    llama.cpp's reference quantizer of that type."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quantize

    if block == "F16":
        return values.astype(np.float16)
    if block in K_TYPES:
        rows = values.reshape(values.shape[0], -1)
        blocks = k_kernels(block).quantize_k(block, torch.from_numpy(np.require(rows, np.float32, ["C", "W"])))
        return blocks.reshape(values.shape[0], -1).numpy()
    return quantize(np.ascontiguousarray(values, dtype=np.float32), GGMLQuantizationType[block])


def k_kernels(kind: str) -> Kernels:
    """tierserve's kernels, which quantize the K types.

    Raises:
        ConfigError: they are not built on this machine (another CPU, or no C compiler at install)."""
    from tierserve.plugins.backends import cpu_gemm

    kernels = cpu_gemm.library()
    if kernels is None:
        raise ConfigError(f"{kind}: the K types are quantized by tierserve's C kernels, which this install does not "
                          f"have ({cpu_gemm.unavailable_reason()}); choose q4_0, q4_1, q5_0, q5_1 or q8_0")  # fmt: skip
    return kernels
