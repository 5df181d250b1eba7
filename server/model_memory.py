"""How much memory a model will take before it is loaded: its weights and its live KV pool.

The model registry refuses a load that would take the loaded models past
``[registry] memory_budget_bytes`` with this figure, so it must not need the
model in memory: it reads the checkpoint's config and safetensors headers only
(a GGUF file's header).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierserve.core.sections import Settings

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "BOOL": 1}


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    weight_bytes: int
    kv_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


def _weight_elements(directory: Path) -> tuple[int, int]:
    """(elements, bytes) of every tensor in the checkpoint's safetensors files, from their headers."""
    elements = stored = 0
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in tensor["shape"]:
                count *= dim
            elements += count
            stored += count * _DTYPE_BYTES.get(tensor["dtype"], 4)
    return elements, stored


def _gguf_elements(path: Path) -> tuple[int, int]:
    """(elements, bytes) of every tensor in a GGUF file, from its header."""
    from tierserve.models.gguf import check_gguf

    tensors = check_gguf(path).tensors
    return sum(t.n_elements for t in tensors), sum(t.n_bytes for t in tensors)


# bytes a weight held (GGML type numbers): Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (repacked by tiles: cpu_gemm.c),
# Q8_0 (float32 scales), F32, F16 and BF16 (widened to the model's float32); any other type is held as int8 groups
_KEPT = {2: 18 / 32, 3: 20 / 32, 6: 22 / 32, 7: 24 / 32, 12: 19 / 32, 13: 23 / 32, 14: 26.5 / 32, 8: 1.125, 0: 4.0,
         1: 4.0, 30: 4.0}  # fmt: skip


def _gguf_kept_bytes(path: Path) -> int:
    """Bytes a GGUF file's tensors take with ``model.quantization = "gguf"``."""
    from tierserve.models.gguf import check_gguf

    # the token embedding table is held as the file stores it (its rows dequantized as read); a tied one twice (the
    # head's tiles too)
    tensors = check_gguf(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return int(sum(
        t.n_bytes + (gguf_held_bytes(t) if tied else 0) if t.name == "token_embd.weight" and t.tensor_type in _KEPT
        else gguf_held_bytes(t)
        for t in tensors
    ))  # fmt: skip


def gguf_held_bytes(tensor) -> float:
    """The bytes tierserve holds one GGUF tensor in as a matrix a step multiplies (``model.quantization =
    "gguf"``): ``_KEPT``'s size per weight for its type, int8 groups (1.125) for any other."""
    return tensor.n_elements * _KEPT.get(tensor.tensor_type, 1.125)


# model.quantization on a directory, as held (K types: scales widened to float32); the mixes about a fifth Q6_K
_BLOCK_BYTES_PER_WEIGHT = {"q4_0": 18 / 32, "q4_1": 20 / 32, "q8_0": 1.125, "q4_k": 4.75 / 8, "q5_k": 5.75 / 8,
                           "q6_k": 6.625 / 8, "q4_k_m": 5.2 / 8, "q5_k_m": 6.0 / 8}  # fmt: skip
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _device_type(name: str) -> str:
    """``cuda`` or ``cpu`` as ``model.device`` will resolve, without importing torch here.

    The HTTP process never loads torch, so ``auto`` asks the driver (``/proc/driver/nvidia/gpus``)
    and the installed torch build (its ``version.py``) instead; the engine resolves it for real.
    """
    if name != "auto":
        return name.split(":")[0]
    if "torch" in sys.modules:
        return "cuda" if sys.modules["torch"].cuda.is_available() else "cpu"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    gpus = Path("/proc/driver/nvidia/gpus")
    spec = importlib.util.find_spec("torch")
    if not (gpus.is_dir() and any(gpus.iterdir())) or spec is None or not spec.submodule_search_locations:
        return "cpu"
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    cuda_build = version.is_file() and re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]", version.read_text(), re.M)
    return "cuda" if cuda_build else "cpu"


def _itemsize(dtype: str, device: str) -> int:
    """Bytes per element of ``model.dtype``/``kv_cache.dtype``; ``auto`` is 2 on a GPU, float32 on a CPU."""
    if dtype == "auto":
        return 2 if device == "cuda" else 4
    return _ITEMSIZE[dtype]


def _per_row_int8_bytes(settings: Settings, device: str) -> int:
    """Bytes per int8 weight quantized per row: ``auto`` on a CPU where the cpu_gemm kernels run keeps
    their packed q8 copy next to the portable kernel's (``linear.int8_copies``)."""
    from tierserve.plugins.backends.cpu_gemm_builds import built_here

    backend = "transformers" if settings.model.backend == "transformers" else "native"
    kernel = settings.plugins.table(backend).get("linear_kernel", "auto")
    return 2 if kernel == "auto" and device == "cpu" and built_here() else 1


def estimate_memory(settings: Settings) -> MemoryEstimate:
    """Weights in the dtype they will run in (int8: one byte each) plus the L1 pool ``[kv_cache]`` sizes."""
    from tierserve.models.checkpoints import resolve_model_path
    from tierserve.models.gguf import config_dict as gguf_config_dict
    from tierserve.models.gguf import is_gguf

    model, kv = settings.model, settings.kv_cache
    directory = resolve_model_path(model.path, model.gguf_file)
    device = _device_type(model.device)
    weight_itemsize = _itemsize(model.dtype, device)
    kv_itemsize = weight_itemsize if kv.dtype == "auto" else _itemsize(kv.dtype, device)
    gguf = is_gguf(Path(directory))
    elements, stored = _gguf_elements(directory) if gguf else _weight_elements(Path(directory))
    config = gguf_config_dict(directory) if gguf else json.loads((Path(directory) / "config.json").read_text())
    per_weight: float = weight_itemsize
    if model.quantization == "int8":
        # a GGUF file's weights stay group-wise int8: one byte each plus a float32 scale per 32 (1.125 bytes);
        # per-row int8 is one byte, twice where ``auto`` keeps the small-batch q8 copy next to fbgemm's
        per_weight = 1.125 if gguf else _per_row_int8_bytes(settings, device)
    # bfloat16 weights: one copy each (linear.bf16_copies)
    weight_bytes = int(elements * per_weight) if elements else stored
    if model.quantization in _BLOCK_BYTES_PER_WEIGHT and not gguf:
        # every weight matrix rounded at load to GGUF blocks (the embedding table as int8 rows: about the same)
        weight_bytes = int(elements * _BLOCK_BYTES_PER_WEIGHT[model.quantization])
    if model.quantization == "gguf" and gguf:
        # Q4_0 / Q4_1 / Q8_0 kept as stored (Q8_0's scales widened to float32: 1.125 bytes a weight, not 1.0625),
        # any other type at int8's 1.125 bytes
        weight_bytes = _gguf_kept_bytes(directory)
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // max(1, heads)
    layers = config.get("num_hidden_layers", 0)
    block_bytes = layers * 2 * kv.block_size * kv_heads * head_dim * kv_itemsize
    blocks = kv.l1_capacity
    if kv.l1_max_bytes is not None and block_bytes:
        blocks = max(1, kv.l1_max_bytes // block_bytes)
    return MemoryEstimate(weight_bytes, blocks * block_bytes)
