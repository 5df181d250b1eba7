"""The ``transformers`` backend: any causal LM transformers runs, on tierserve's paged KV arena.

As vLLM's Transformers backend does, the model's own modeling code runs
unchanged over the step's flattened batch (``input_ids`` ``[1, T]`` with each
token's position), loaded with ``attn_implementation = "tierserve_paged"``:
every attention layer then calls ``paged_attention_forward``, which writes
the layer's keys and values into the arena and attends through the block
tables of the batch (``paged_attention``, the code the native backend uses).
So continuous batching, chunked prefill, prefix reuse from every tier,
persistence, warming, speculation and beam search work for every
architecture whose modeling code routes attention through transformers'
``AttentionInterface`` (GPT-2, Gemma 2, Phi-3, OPT, ... most of them).

At load a probe forward of a few tokens records each attention call: the
layers, in call order, their KV heads and head size, sliding window and logit
soft-capping. Models this cannot serve are refused with the reason
(``UnsupportedModel``): attention not routed through the interface, layers
with different KV shapes, KV shared across layers, or an attention input the
arena does not carry (ALiBi slopes, attention sinks, ...).

The model's dense layers (``nn.Linear``, GPT-2's ``Conv1D``) are swapped for
the native backend's kernels (``linear.py``): oneDNN with prepacked weights on
CPU (``[plugins.transformers] linear_kernel``), or int8 weights with
``model.quantization = "int8"``.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tierserve.cache.kv_manager import KVSpec
from tierserve.core.backend import ModelBackend, kernel_variant
from tierserve.models.fingerprint import checkpoint_fingerprint
from tierserve.models.backend_choice import UnsupportedModel
from tierserve.core.batch import ScheduledChunk
from tierserve.settings.config import Settings
from tierserve.core.errors import ConfigError
from tierserve.core.hookspecs import hookimpl

if TYPE_CHECKING:  # loaded when the backend is built, not when plugins are listed
    import torch

    from tierserve.plugins.backends.paged_attention import KVArena, PagedBatch

ATTENTION_NAME = "tierserve_paged"
PROBE_TOKENS = 4
# keyword arguments attention layers pass that the arena's attention accounts for (or that are inert)
KNOWN_ATTENTION_KWARGS = frozenset(
    {"dropout", "scaling", "sliding_window", "softcap", "is_causal", "position_ids", "cache_position",
     "output_attentions", "use_cache", "head_mask", "layer_idx", "position_embeddings"}
)  # fmt: skip


class TransformersSettings(BaseModel):
    """``[plugins.transformers]``: how the paged transformers backend runs the model's dense layers."""

    model_config = ConfigDict(extra="forbid")

    linear_kernel: Literal["auto", "onednn", "torch"] = Field(
        "auto",
        description="the model's nn.Linear (and GPT-2 Conv1D) layers: oneDNN with prepacked weights on CPU (auto), "
        "or transformers' own layers (torch)",
    )


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """What the probe saw of one attention layer."""

    heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None
    softcap: float | None


_probe: contextvars.ContextVar[list[tuple[Any, AttentionLayer, set[str]]] | None] = contextvars.ContextVar(
    "tierserve_attention_probe", default=None
)


def paged_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [1, heads, T, d]``, ``key``/``value [1, kv_heads, T, d]``.

    Returns ``[1, T, heads, d]``. The layer's backend (set on the module at
    load) routes the call through the arena; during the load-time probe the
    call is recorded and computed causally over the probe tokens.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    backend = module.__dict__.get("_tierserve_backend")
    if backend is not None:
        return backend.attend(module.__dict__["_tierserve_layer"], query, key, value, scale, softcap), None
    calls = _probe.get()
    if calls is None:
        raise RuntimeError("this model was loaded for tierserve's paged arena; serve it through its backend")
    extra = {name for name, item in kwargs.items() if item is not None and name not in KNOWN_ATTENTION_KWARGS}
    calls.append((module, AttentionLayer(query.shape[1], key.shape[1], key.shape[-1], sliding_window, softcap), extra))
    from tierserve.plugins.backends.paged_attention import attention

    mask = _window_mask(query.shape[2], sliding_window, query.device)
    out = attention(query, key, value, mask, mask is None, scale, softcap)
    return out.transpose(1, 2), None


def _window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Causal visibility ``[length, length]`` limited to ``window`` keys back; None when plain causal suffices."""
    import torch

    if window is None or length <= window:
        return None
    pos = torch.arange(length, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


class PagedTransformersBackend(ModelBackend):
    """A Hugging Face causal LM whose attention layers read and write tierserve's block arena."""

    paged = True
    supports_released_kv = True
    supports_token_trees = True

    @staticmethod
    def supports_model_type(model_type: str) -> bool:
        """Whether transformers' class for ``model_type`` routes attention through ``AttentionInterface``."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[AutoConfig.for_model(model_type).__class__]
        except (KeyError, ValueError):
            return False
        return bool(getattr(model_class, "_supports_attention_backend", False))

    def __init__(self, settings: Settings) -> None:
        from tierserve.core.attention import attention_kernel
        from tierserve.models.checkpoints import context_length, eos_token_ids, load_causal_lm, load_config, load_tokenizer
        from tierserve.models.devices import resolve_placement
        from tierserve.plugins.backends.linear import BLOCK_MODES, LinearFactory, swap_linear_layers
        from tierserve.plugins.backends.paged_attention import KVArena, window_layout

        model = settings.model
        self.path, self.device, self.dtype, kv_dtype = resolve_placement(
            model.path, model.device, model.dtype, settings.kv_cache.dtype, model.gguf_file
        )
        config = load_config(self.path)
        if not self.supports_model_type(config.model_type):
            raise UnsupportedModel(
                f"{config.model_type!r} models do not route attention through transformers' AttentionInterface, "
                "so they cannot run on the paged KV arena; set model.backend = \"transformers-unpaged\" "
                "(no prefix cache) to serve it"
            )
        _register_attention()
        self.tokenizer = load_tokenizer(self.path)
        self.model = (
            load_causal_lm(self.path, dtype=self.dtype, attn_implementation=ATTENTION_NAME)
            .to(self.device)
            .eval()
        )
        self.config = self.model.config
        options = settings.plugin_options("transformers", TransformersSettings)
        if model.quantization in BLOCK_MODES:
            raise ConfigError(
                f"model.quantization = {model.quantization!r} keeps GGUF blocks on the native backend only (this "
                "backend runs transformers' float modules); set model.backend = \"native\" for a Llama, "
                "Mistral or Qwen checkpoint, or model.quantization = \"int8\""
            )
        try:
            factory = LinearFactory(options.linear_kernel, self.device, self.dtype, model.quantization,
                                    setting="plugins.transformers.linear_kernel")  # fmt: skip
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if factory.packed or factory.own or model.quantization != "none":  # else transformers' layers are that kernel
            swap_linear_layers(self.model, factory)
        self.quantization = model.quantization
        self.linear_kernel = factory.kernel
        self.layers = self._probe()
        first = self.layers[0]
        self.windows, self.trained_window = window_layout([layer.sliding_window for layer in self.layers])
        own_kernels = options.linear_kernel != "torch"  # tierserve's decode attention (cpu_gemm) where it runs
        self.arena: KVArena = KVArena(
            len(self.layers), first.kv_heads, first.head_dim, kv_dtype, self.device, own_kernels=own_kernels
        )
        self.kv_dtype = kv_dtype
        self._batch: PagedBatch | None = None
        self.vocab_size = self.config.vocab_size
        positions = getattr(self.config, "max_position_embeddings", None) or getattr(self.config, "n_positions", None)
        self.max_model_len = context_length(model.max_model_len, positions or 2048, self.path)
        self.eos_token_ids = eos_token_ids(self.path, self.tokenizer)
        self.attention = attention_kernel(settings.sliding_window.use_flash_attention, self.device)
        softcapped = any(layer.softcap is not None for layer in self.layers)
        self.attention_kernel = "math (logit soft-capping)" if softcapped else self.attention.name
        kernels = kernel_variant("transformers-paged", factory.kernel, self.attention.forced, self.dtype, kv_dtype)
        if own_kernels:
            from tierserve.plugins.backends.cpu_gemm import fingerprint_tag

            kernels += fingerprint_tag(self.device, self.dtype, kv_dtype)
        self.fingerprint = checkpoint_fingerprint(self.path, str(self.dtype), kernels)
        self.block_size = settings.kv_cache.block_size
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def _probe(self) -> list[AttentionLayer]:
        """Run a few tokens through the model and describe each attention layer it called, in order."""
        import torch

        model_type = self.model.config.model_type
        if getattr(self.model.config, "num_kv_shared_layers", 0):  # later layers read earlier layers' KV
            raise UnsupportedModel(
                f"{model_type!r}: its layers share KV across layers (num_kv_shared_layers), which the paged arena "
                "does not model; set model.backend = \"transformers-unpaged\" to serve it"
            )
        calls: list[tuple[Any, AttentionLayer, set[str]]] = []
        token = _probe.set(calls)
        try:
            ids = (torch.arange(PROBE_TOKENS, device=self.device) % self.model.config.vocab_size)[None]
            with torch.inference_mode():
                self.model(input_ids=ids, position_ids=torch.arange(PROBE_TOKENS, device=self.device)[None],
                           use_cache=False)  # fmt: skip
        finally:
            _probe.reset(token)
        if not calls:
            raise UnsupportedModel(
                f"{model_type!r}: no attention layer called transformers' attention interface; "
                "set model.backend = \"transformers-unpaged\" to serve it without the paged arena"
            )
        modules = [module for module, _, _ in calls]
        if len({id(m) for m in modules}) != len(modules):
            raise UnsupportedModel(f"{model_type!r}: an attention module runs twice per forward (shared layers)")
        extra = sorted(set().union(*(names for _, _, names in calls)))
        if extra:
            raise UnsupportedModel(
                f"{model_type!r}: its attention takes {', '.join(extra)}, which the paged arena does not carry; "
                "set model.backend = \"transformers-unpaged\" to serve it"
            )
        layers = [layer for _, layer, _ in calls]
        shapes = {(layer.kv_heads, layer.head_dim) for layer in layers}
        if len(shapes) > 1:
            raise UnsupportedModel(f"{model_type!r}: its layers keep keys of different shapes {sorted(shapes)}")
        if any(layer.heads % layer.kv_heads for layer in layers):
            raise UnsupportedModel(f"{model_type!r}: query heads are not a multiple of the KV heads")
        for index, module in enumerate(modules):
            module.__dict__["_tierserve_layer"] = index
            module.__dict__["_tierserve_backend"] = self
        return layers

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.arena.bytes_per_block(block_size)

    def kv_spec(self, block_size: int) -> KVSpec:
        return KVSpec(self.arena.bytes_per_block(block_size), self.trained_window)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.arena.allocate(num_blocks, block_size)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        import torch

        return self.arena.read_blocks(torch.tensor(block_ids, dtype=torch.long, device=self.device))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        import torch

        self.arena.write_blocks(torch.tensor(block_ids, dtype=torch.long, device=self.device), data)

    def move_kv(self, block_table: list[int], sources: list[int], targets: list[int]) -> None:
        import torch

        with torch.inference_mode():
            self.arena.move(block_table, sources, targets)

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
        softcap: float | None,
    ) -> torch.Tensor:  # fmt: skip
        """One layer's attention for the step (``query [1, heads, T, d]``) or, outside a step, over the input alone."""
        window = self.layers[layer].sliding_window
        batch = self._batch
        if batch is None:  # embeddings: each input attends to itself; the arena is not touched
            from tierserve.plugins.backends.paged_attention import attention

            mask = _window_mask(query.shape[2], window, query.device)
            return attention(query, key, value, mask, mask is None, scale, softcap).transpose(1, 2)
        self.arena.store(layer, batch.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
        return self.arena.attend(layer, query[0].transpose(0, 1), batch.groups, window, scale, softcap)[None]

    def forward(self, chunks: Seq[ScheduledChunk]) -> torch.Tensor:
        import torch

        from tierserve.plugins.backends.paged_attention import build_paged_batch

        batch = build_paged_batch(chunks, self.block_size, self.windows, self.device)
        keep = {"logits_to_keep": batch.sample_rows} if self._logits_to_keep else {}
        self._batch = batch
        try:
            with torch.inference_mode(), self.attention.scope():
                out = self.model(
                    input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False, **keep
                )
        finally:
            self._batch = None
        logits = out.logits[0]
        return (logits if keep else logits[batch.sample_rows]).float()

    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One forward per input, mean-pooling ``hidden_states[-1]`` (after the final norm), as the
        ``transformers-unpaged`` backend does; the arena is neither read nor written."""
        import torch
        import torch.nn.functional as F

        pooled = []
        with torch.inference_mode(), self.attention.scope():
            for ids in token_ids:
                positions = torch.arange(len(ids), device=self.device)[None]
                out = self.model(
                    input_ids=torch.tensor([ids], device=self.device), position_ids=positions, use_cache=False,
                    output_hidden_states=True,
                )  # fmt: skip
                pooled.append(out.hidden_states[-1][0].float().mean(0))
        return F.normalize(torch.stack(pooled), dim=-1)

    def close(self) -> None:
        self.arena.clear()


@hookimpl
def register_backends(register):
    register(
        "transformers",
        PagedTransformersBackend,
        settings=TransformersSettings,
        description="any AutoModelForCausalLM whose attention goes through transformers' AttentionInterface, "
        "on the paged KV arena (prefix cache and every tier)",
    )
