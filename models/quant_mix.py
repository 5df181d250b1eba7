"""The block type each weight matrix gets in a llama.cpp file type (Q4_K_M, Q4_0, ...), as ``llama-quantize`` picks it.

A file type is a mix: Q4_K_M is Q4_K for most matrices, Q6_K for the output head and for ``attn_v`` and
``ffn_down`` in the layers ``use_more_bits`` names, and a 32-weight type where a matrix's width is not whole
super-blocks of 256. This is llama.cpp's ``llama_tensor_get_type`` (``src/llama-quant.cpp``) for the file types
tierserve writes, on dense models without an importance matrix: what ``tierserve quantize`` writes and what
``model.quantization`` rounds a Hugging Face directory to.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# file type -> (gguf.LlamaFileType name, the type of a matrix no rule moves)
FILE_TYPES = {
    "q4_0": ("MOSTLY_Q4_0", "Q4_0"), "q4_1": ("MOSTLY_Q4_1", "Q4_1"), "q5_0": ("MOSTLY_Q5_0", "Q5_0"),
    "q5_1": ("MOSTLY_Q5_1", "Q5_1"), "q8_0": ("MOSTLY_Q8_0", "Q8_0"), "q4_k_s": ("MOSTLY_Q4_K_S", "Q4_K"),
    "q4_k_m": ("MOSTLY_Q4_K_M", "Q4_K"), "q5_k_s": ("MOSTLY_Q5_K_S", "Q5_K"), "q5_k_m": ("MOSTLY_Q5_K_M", "Q5_K"),
    "q6_k": ("MOSTLY_Q6_K", "Q6_K"),
}  # fmt: skip
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # quantized by tierserve's kernels (k_quantize.c); the rest by the gguf package
WEIGHTS_A_BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
# a super-block type on a matrix whose width is not whole super-blocks (tensor_type_fallback)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# names that end in "weight" and still are not quantized (tensor_allows_quantization, dense models)
_NEVER = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight", "token_types.weight", "ssm_conv1d")


@dataclass(frozen=True, slots=True)
class Matrix:
    """A tensor as the type choice sees it: its GGUF name (``blk.3.attn_v.weight``), dimensions and width."""

    name: str
    dims: int
    columns: int

    @property
    def layer(self) -> int:
        """Its block's index (-1 outside the blocks: the head, the embedding table)."""
        head, _, rest = self.name.partition(".")
        index = rest.partition(".")[0]
        return int(index) if head == "blk" and index.isdigit() else -1


def quantized(matrix: Matrix) -> bool:
    """Whether llama-quantize rounds this tensor at all (matrices named ``*weight``, not norms or routers)."""
    return matrix.dims >= 2 and matrix.name.endswith("weight") and not any(n in matrix.name for n in _NEVER)


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for part in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight"):
        if part in name:
            return "attn_v"
    return "ffn_down" if "ffn_down" in name else "other"


def _more_bits(index: int, count: int) -> bool:
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def block_types(matrices: Iterable[Matrix], file_type: str, layers: int, *, pure: bool = False) -> dict[str, str]:
    """Each quantized matrix's block type (``Q6_K``, ``Q5_0``, ... or ``F16`` where no block fits its width) for
    ``file_type`` (a key of ``FILE_TYPES``) in a model of ``layers`` blocks; tensors left as they are are absent.
    ``pure`` (``llama-quantize --pure``): every matrix in the file type's own block type but for the fallbacks.

    The counters of llama-quantize (the n-th ``attn_v``, the n-th ``ffn_down``) run in its order: by block, the
    head and embedding table first."""
    default = FILE_TYPES[file_type][1]
    chosen = [m for m in sorted(matrices, key=lambda m: (m.layer, m.name)) if quantized(m)]
    tied = not any(m.name == "output.weight" for m in chosen)
    value_count = sum(_category(m.name) == "attn_v" for m in chosen)
    values = downs = 0
    types: dict[str, str] = {}
    for matrix in chosen:
        kind, category = default, "pure" if pure else _category(matrix.name)
        if category == "output" or (tied and category == "token_embd"):
            if matrix.columns % WEIGHTS_A_BLOCK[default]:
                kind = "Q8_0"
            elif kind != "Q8_0":
                kind = "Q6_K"
        elif category == "attn_v":
            if file_type in ("q4_k_m", "q5_k_m") and _more_bits(values, value_count):
                kind = "Q6_K"
            elif file_type == "q4_k_s" and values < 4:
                kind = "Q5_K"
            if layers == 80 and kind == "Q4_K":  # llama.cpp's 70B rule: v is 8x smaller than q there
                kind = "Q5_K"
            values += 1
        elif category == "ffn_down":
            if file_type in ("q4_k_m", "q5_k_m") and _more_bits(downs, layers):
                kind = "Q6_K"
            elif file_type == "q4_k_s" and downs < layers // 8:
                kind = "Q5_K"
            downs += 1
        if matrix.columns % WEIGHTS_A_BLOCK[kind]:
            kind = FALLBACK.get(kind, kind)
            if matrix.columns % WEIGHTS_A_BLOCK[kind]:
                kind = "F16"
        types[matrix.name] = kind
    return types
