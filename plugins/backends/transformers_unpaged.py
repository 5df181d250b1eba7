"""The ``transformers-unpaged`` backend: any ``AutoModelForCausalLM`` with the library's own KV cache.

The fallback for architectures the paged ``transformers`` backend refuses
(attention not routed through transformers' ``AttentionInterface``, layers
with different KV shapes, ALiBi, ...). Slower (one forward per sequence per
step) and without the prefix cache or its tiers: each sequence keeps a
``DynamicCache``; chunked prefill feeds chunks into it; preemption drops it
and the prompt is recomputed.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from tierserve.core.backend import ModelBackend
from tierserve.models.fingerprint import checkpoint_fingerprint
from tierserve.core.batch import ScheduledChunk
from tierserve.settings.config import Settings
from tierserve.core.errors import ConfigError
from tierserve.core.hookspecs import hookimpl
from tierserve.core.sequence import Sequence

if TYPE_CHECKING:  # loaded when the backend is built, not when plugins are listed
    import torch


class TransformersBackend(ModelBackend):
    """A Hugging Face causal LM run sequence by sequence with its own cache objects."""

    paged = False

    def __init__(self, settings: Settings) -> None:
        from tierserve.core.attention import attention_kernel
        from tierserve.models.checkpoints import (
            context_length,
            eos_token_ids,
            load_causal_lm,
            load_tokenizer,
            resolve_model_path,
        )
        from tierserve.models.devices import resolve_device, resolve_dtype

        model = settings.model
        # this backend keeps transformers' own weights and per-sequence caches
        if model.quantization != "none":
            raise ConfigError(
                f"model.quantization = {model.quantization!r} is supported by the native backend only; "
                "set model.backend = \"native\" or leave model.quantization at its default"
            )
        if settings.kv_cache.dtype != "auto":
            raise ConfigError(
                f"kv_cache.dtype = {settings.kv_cache.dtype!r} is supported by the paged backends only; "
                "set model.backend = \"auto\" (native or transformers) or leave kv_cache.dtype at its default"
            )
        self.path = resolve_model_path(model.path, model.gguf_file)
        self.device = resolve_device(model.device)
        self.dtype = resolve_dtype(model.dtype, self.device)
        self.tokenizer = load_tokenizer(self.path)
        self.model = load_causal_lm(self.path, dtype=self.dtype).to(self.device).eval()
        config = self.model.config
        self.vocab_size = config.vocab_size
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
        self.max_model_len = context_length(model.max_model_len, positions, self.path)
        self.eos_token_ids = eos_token_ids(self.path, self.tokenizer)
        self.attention = attention_kernel(settings.sliding_window.use_flash_attention, self.device)
        implementation = getattr(config, "_attn_implementation", None) or "eager"
        # only the "sdpa" implementation calls torch's kernels; "eager" is plain math already
        self.attention_kernel = self.attention.name if implementation == "sdpa" else f"{implementation} (transformers)"
        variant = "".join(f"/{k.name}" for k in self.attention.forced) if implementation == "sdpa" else ""
        self.fingerprint = checkpoint_fingerprint(self.path, str(self.dtype), "transformers" + variant)
        parameters = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._caches: dict[int, object] = {}

    def forward(self, chunks: Seq[ScheduledChunk]) -> torch.Tensor:
        import torch

        with torch.inference_mode(), self.attention.scope():
            return self._forward(chunks)

    def _forward(self, chunks: Seq[ScheduledChunk]) -> torch.Tensor:
        import torch
        from transformers import DynamicCache

        logits = []
        for chunk in chunks:
            seq = chunk.seq
            start = chunk.start
            if start == 0:
                self._caches[seq.seq_id] = DynamicCache()
            cache = self._caches[seq.seq_id]
            ids = torch.tensor([chunk.token_ids], device=self.device)
            positions = torch.arange(start, start + chunk.num_tokens, device=self.device)[None]
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_kwarg: cache})
            if chunk.num_logits:
                logits.append(out.logits[0, -chunk.num_logits :].float())
        if not logits:
            return torch.empty(0, self.vocab_size, device=self.device)
        return torch.cat(logits)

    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One forward per input (no padding, so absolute-position models such as GPT-2
        see the positions they were trained on), mean-pooling ``hidden_states[-1]``.

        That entry is the model's ``last_hidden_state``: after the final norm for
        Llama/Mistral/Qwen (``norm``), GPT-2 (``ln_f``) and OPT (``final_layer_norm``).
        Caveats: OPT checkpoints with ``project_out`` (``word_embed_proj_dim !=
        hidden_size``, e.g. opt-350m) return the projected, narrower width; post-LN
        models have no separate final norm (their last layer already ends in one).
        """
        import torch
        import torch.nn.functional as F

        pooled = []
        with torch.inference_mode(), self.attention.scope():
            for ids in token_ids:
                out = self.model(
                    input_ids=torch.tensor([ids], device=self.device), use_cache=False, output_hidden_states=True
                )
                pooled.append(out.hidden_states[-1][0].float().mean(0))
        return F.normalize(torch.stack(pooled), dim=-1)

    def release(self, seq: Sequence) -> None:
        self._caches.pop(seq.seq_id, None)

    def close(self) -> None:
        self._caches.clear()


@hookimpl
def register_backends(register):
    register(
        "transformers-unpaged",
        TransformersBackend,
        description="any AutoModelForCausalLM, one DynamicCache per sequence (no prefix cache): the fallback",
    )
