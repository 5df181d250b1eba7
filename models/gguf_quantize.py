"""A GGUF file written again with its weight matrices in another block type: ``tierserve quantize``.

Every metadata key of the source is copied as it is (architecture, hyperparameters, tokenizer, chat
template), ``general.file_type`` says the new type, and each 2-D weight is rounded by llama.cpp's reference
quantizer (the ``gguf`` package's ``quantize``, the algorithm of ``quantize_row_q4_0_ref`` and its siblings);
1-D tensors (norms, biases) and matrices whose width is not whole blocks stay as they are. The result is a file
``llama-server`` and tierserve both load. Sources in F32, F16, BF16 or Q8_0 are quantized from their values;
other quantized sources need ``allow_requantize`` (their rounding is then rounded again, as
``llama-quantize --allow-requantize`` does).

The K types (Q4_K_M, Q6_K, ...) are not written: the ``gguf`` package has no quantizer for them, and their
reference search (``make_qkx2_quants``) is not reimplemented here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierserve.core.errors import ConfigError

# the block types written, and the file type each gives (gguf.LlamaFileType names)
TARGETS = {"q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
           "q8_0": "MOSTLY_Q8_0"}  # fmt: skip
SOURCES = ("F32", "F16", "BF16", "Q8_0")  # quantized without allow_requantize


@dataclass(frozen=True, slots=True)
class QuantizeSummary:
    """What ``quantize_gguf`` wrote: tensors quantized and kept, and the sizes before and after."""

    quantized: int
    kept: int
    source_bytes: int
    target_bytes: int


def quantize_gguf(source: Path, target: Path, kind: str, allow_requantize: bool = False) -> QuantizeSummary:
    """Write ``source`` (a GGUF file) to ``target`` with its weight matrices in ``kind`` (a key of ``TARGETS``).

    Raises:
        ConfigError: an unknown ``kind``, a source that is not a readable GGUF file, a quantized source without
            ``allow_requantize``, or a target that exists or is the source.
    """
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, dequantize, quantize
    from gguf.constants import GGML_QUANT_SIZES

    from tierserve.models.gguf import check_gguf

    if kind not in TARGETS:
        raise ConfigError(f"--type {kind!r}: allowed: {', '.join(TARGETS)}")
    if target.exists():
        raise ConfigError(f"{target} exists: give a new file name")
    check_gguf(source)  # truncated, corrupt or unknown: a ConfigError naming what was found
    reader = GGUFReader(source)
    types = {GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if len(t.shape) > 1}
    requantized = sorted(types - set(SOURCES))
    if requantized and not allow_requantize:
        raise ConfigError(f"{source} holds {', '.join(requantized)} weights: quantizing them again loses more than "
                          "quantizing the float weights; pass --allow-requantize to do it anyway")  # fmt: skip
    block = GGMLQuantizationType[kind.upper()]
    block_size = GGML_QUANT_SIZES[block][0]
    architecture = reader.get_field("general.architecture").contents()
    writer = GGUFWriter(target, architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    writer.add_file_type(LlamaFileType[TARGETS[kind]])
    quantized = kept = 0
    try:
        for tensor in reader.tensors:
            stored = GGMLQuantizationType(tensor.tensor_type)
            columns = int(tensor.shape[0])  # GGUF lists dims innermost first
            if len(tensor.shape) < 2 or columns % block_size or stored == block:
                writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=stored)
                kept += 1
                continue
            values = np.asarray(tensor.data)
            if stored.name not in ("F32", "F16", "BF16"):
                values = dequantize(values, stored)
            elif stored.name == "BF16":
                values = (np.asarray(values).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            writer.add_tensor(tensor.name, quantize(np.asarray(values, dtype=np.float32), block), raw_dtype=block)
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
