"""The ``native`` backend: Llama-family checkpoints on tierserve's paged KV arena."""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from tierserve.cache.kv_manager import KVSpec
from tierserve.core.backend import ModelBackend, kernel_variant
from tierserve.models.fingerprint import checkpoint_fingerprint
from tierserve.models.backend_choice import UnsupportedModel
from tierserve.core.batch import ScheduledChunk
from tierserve.settings.config import Settings
from tierserve.core.hookspecs import hookimpl

# torch, transformers and the model load when a backend is built, so listing
# plugins or validating settings stays fast.
if TYPE_CHECKING:
    import torch

    from tierserve.plugins.backends.paged_attention import PagedBatch


def load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, single file or sharded (``*.safetensors.index.json``)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {directory}; the native backend reads safetensors only "
            "(convert the checkpoint, or set model.backend = \"transformers\")"
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(directory / name), framework="pt") as handle:
            for key in handle.keys():
                state[key] = handle.get_tensor(key)
    return state


NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # the architectures llama.py implements


class NativeSettings(BaseModel):
    """``[plugins.native]``: how the native backend runs."""

    model_config = ConfigDict(extra="forbid")

    linear_kernel: Literal["auto", "onednn", "torch"] = Field(
        "auto", description="dense matmuls: oneDNN prepacked weights on CPU (auto), or torch's F.linear"
    )


class NativeBackend(ModelBackend):
    """Loads a Hugging Face Llama/Mistral/Qwen2/Qwen3 directory or GGUF file and runs it paged."""

    paged = True
    supports_released_kv = True
    supports_lora = True
    supports_token_trees = True
    supports_hidden_states = True

    @staticmethod
    def supports_model_type(model_type: str) -> bool:
        """Whether this backend has its own layers for ``model_type`` (``model.backend = "auto"`` asks)."""
        return model_type in NATIVE_MODEL_TYPES

    def __init__(self, settings: Settings) -> None:
        from tierserve.core.attention import attention_kernel
        from tierserve.models.checkpoints import context_length, eos_token_ids, load_config, load_tokenizer
        from tierserve.models.devices import resolve_placement
        from tierserve.plugins.backends.llama import PagedLlama

        model = settings.model
        self.path, self.device, self.dtype, kv_dtype = resolve_placement(
            model.path, model.device, model.dtype, settings.kv_cache.dtype, model.gguf_file
        )
        self.attention = attention_kernel(settings.sliding_window.use_flash_attention, self.device)
        self.attention_kernel = self.attention.name
        self.config = load_config(self.path)
        if not self.supports_model_type(self.config.model_type):
            raise UnsupportedModel(
                f"the native backend runs {', '.join(NATIVE_MODEL_TYPES)} checkpoints, not "
                f"{self.config.model_type!r}; set model.backend = \"auto\" or \"transformers\" for other architectures"
            )
        self.tokenizer = load_tokenizer(self.path)
        self.model = PagedLlama(
            self.config,
            self._weights(model.quantization),
            self.device,
            self.dtype,
            linear_kernel=settings.plugin_options("native", NativeSettings).linear_kernel,
            quantization=model.quantization,
            kv_dtype=kv_dtype,
        )
        self.quantization = model.quantization
        self.linear_kernel = self.model.linear_kernel
        self.kv_dtype = kv_dtype
        self.vocab_size = self.config.vocab_size
        self.max_model_len = context_length(model.max_model_len, self.config.max_position_embeddings, self.path)
        self.eos_token_ids = eos_token_ids(self.path, self.tokenizer)
        kernels = kernel_variant("native", self.model.linear_kernel, self.attention.forced, self.dtype, kv_dtype)
        if self.model.own_kernels:
            from tierserve.plugins.backends.cpu_gemm import fingerprint_tag

            kernels += fingerprint_tag(self.device, self.dtype, kv_dtype)
        if model.quantization not in ("none", "int8", "gguf"):  # blocks rounded at load: q4_0 and q4_1 differ
            kernels += f"+{model.quantization}"
        self.fingerprint = checkpoint_fingerprint(self.path, str(self.dtype), kernels)
        self.block_size = settings.kv_cache.block_size
        self.max_lora_rank = model.max_lora_rank
        self.lora = self.model.enable_lora(model.max_loras, model.max_lora_rank) if model.max_loras else None

    def _weights(self, quantization: str) -> dict[str, object]:
        from tierserve.models.gguf import is_gguf

        from tierserve.core.errors import ConfigError
        from tierserve.plugins.backends.block_quantize import BLOCK_QUANTIZATIONS, quantize_state

        if not is_gguf(self.path):
            if quantization == "gguf":
                raise ConfigError(
                    f"model.quantization = 'gguf' keeps a GGUF file's blocks as stored, but model.path "
                    f"{str(self.path)!r} is a Hugging Face directory; use model.quantization = 'q4_0', 'q4_1', "
                    "'q8_0', 'q4_k', 'q5_k', 'q6_k', 'q4_k_m', 'q5_k_m' or 'int8' (or 'none')"
                )
            state = load_safetensors(self.path)
            return quantize_state(state, quantization) if quantization in BLOCK_QUANTIZATIONS else state
        if quantization in BLOCK_QUANTIZATIONS:
            raise ConfigError(
                f"model.quantization = {quantization!r} quantizes a Hugging Face directory's float weights at load; "
                f"model.path {str(self.path)!r} is a GGUF file: use model.quantization = 'gguf' to keep its blocks"
            )
        from tierserve.plugins.backends.gguf_weights import load_gguf_state

        return load_gguf_state(self.path, self.config, self.dtype, quantization)

    def load_lora(self, name: str, path: str) -> dict[str, object]:
        from tierserve.core.errors import RequestError
        from tierserve.plugins.backends.lora import read_adapter

        if self.lora is None:
            raise RequestError(
                "lora_name: LoRA is off for this model; set model.max_loras (adapter slots) to load adapters",
                param="lora_name",
            )
        adapter = read_adapter(name, path, max_rank=self.max_lora_rank, num_layers=len(self.model.layers))
        self.lora.add(adapter)
        return {"path": adapter.path, "rank": adapter.rank, "modules": adapter.modules, "fingerprint": adapter.fingerprint}

    def unload_lora(self, name: str) -> None:
        if self.lora is not None and name in self.lora.slot_of:
            self.lora.remove(name)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_bytes_per_block(block_size)

    def kv_spec(self, block_size: int) -> KVSpec:
        return KVSpec(self.model.kv_bytes_per_block(block_size), self.model.trained_window)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.model.allocate_kv_cache(num_blocks, block_size)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        import torch

        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self.model.read_blocks(ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        import torch

        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.model.write_blocks(ids, data)

    def forward(self, chunks: Seq[ScheduledChunk]) -> torch.Tensor:
        import torch

        with torch.inference_mode(), self.attention.scope():
            logits, hidden = self.model.forward(self._build_batch(chunks))
        self.last_hidden_states = hidden if self.keep_hidden_states else None
        return logits

    def move_kv(self, block_table: list[int], sources: list[int], targets: list[int]) -> None:
        import torch

        with torch.inference_mode():
            self.model.arena.move(block_table, sources, targets)

    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        with torch.inference_mode(), self.attention.scope():
            sequences = [torch.tensor(ids, dtype=torch.long) for ids in token_ids]
            hidden = self.model.final_hidden_states(sequences)
            return F.normalize(torch.stack([h.float().mean(0) for h in hidden]), dim=-1)

    def _build_batch(self, chunks: Seq[ScheduledChunk]) -> PagedBatch:
        from tierserve.plugins.backends.paged_attention import build_paged_batch

        batch = build_paged_batch(chunks, self.block_size, self.model.windows, self.device)
        self.model.ensure_positions(batch.max_position + 1)
        if self.lora is not None:
            batch.lora = self.lora.batch(batch.order)
        return batch

    def close(self) -> None:
        self.model.arena.clear()


@hookimpl
def register_backends(register):
    register(
        "native",
        NativeBackend,
        settings=NativeSettings,
        aliases={"model.linear_kernel": "linear_kernel"},
        description="Llama/Mistral/Qwen2/Qwen3 on the paged KV arena (fast path)",
    )
