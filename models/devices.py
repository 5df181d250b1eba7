"""Device and dtype choice from settings: ``auto`` means CUDA when present, else CPU."""

from __future__ import annotations

import torch

from tierserve.core.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device = {name!r} but CUDA is not available here; use 'auto' or 'cpu'")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"model.device = {name!r} but MPS is not available here; use 'auto' or 'cpu'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on GPUs that support it, float16 on other GPUs, float32 on CPU."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_placement(model_path: str, device: str, dtype: str, kv_dtype: str, gguf_file: str | None = None):
    """What a paged backend loads and where: ``(checkpoint directory or GGUF file, device, weight dtype, KV dtype)``.

    ``kv_dtype`` ``"auto"`` is the weights' dtype (``kv_cache.dtype``); ``gguf_file`` is ``model.gguf_file``.
    """
    from tierserve.models.checkpoints import resolve_model_path

    where = resolve_device(device)
    weights = resolve_dtype(dtype, where)
    kv = weights if kv_dtype == "auto" else resolve_dtype(kv_dtype, where)
    return resolve_model_path(model_path, gguf_file), where, weights, kv
