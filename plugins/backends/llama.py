"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) computed against a paged KV arena.

Weights come from a Hugging Face state dict (a GGUF file's tensors are renamed
into one, Q8_0 matrices as ``GroupedInt8``); q/k/v and gate/up projections are
fused into one matmul each. Attention itself (the batch layout, the arena, the kernels) is
``paged_attention``, shared with the ``transformers`` backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tierserve.plugins.backends import cpu_gemm
from tierserve.plugins.backends.native import NATIVE_MODEL_TYPES
from tierserve.plugins.backends.linear import (
    GROUP_SIZE,
    GroupedInt8,
    Int8Linear,
    Linear,
    LinearFactory,
    BlockQ4,
    BlockQ6K,
    BLOCK_MODES,
    cat_rows,
    quantize_rows,
)
from tierserve.plugins.backends.lora import LoraBatch, LoraSlots
from tierserve.plugins.backends.paged_attention import KVArena, PagedBatch, window_layout
from tierserve.plugins.backends.fused_decode import FusedDecode


# attend(layer_index, layer, q, k, v) -> attention output shaped like q
Attend = Callable[[int, "LayerWeights", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear | Int8Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear | Int8Linear
    post_norm: torch.Tensor
    gate_up: Linear | Int8Linear
    down: Linear | Int8Linear
    sliding_window: int | None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, own: bool = False) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, scale in the input dtype; ``own``: up to
    ``cpu_gemm.LOOP_NORM_ELEMENTS`` elements run tierserve's kernel (torch's ops cost ~30 us at decode,
    and more when a prefill step's rows make them parallel), which sums the squares in its own order."""
    dtype = x.dtype
    out = cpu_gemm.rms_norm(x, weight, eps, max_elements=cpu_gemm.LOOP_NORM_ELEMENTS) if own else None
    if out is not None:
        return out
    if dtype == torch.float32:  # torch's fused op instead of five; the same float32 arithmetic
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class Embedding:
    """The token embedding table: float, int8 rows with one scale each (``model.quantization``),
    int8 with one scale per 32 columns (a GGUF Q8_0 table), or a GGUF file's Q4/Q5/Q6_K blocks as stored (the
    rows a step reads dequantized exactly)."""

    __slots__ = ("weight", "scale", "dtype", "by_column", "packed", "blocks")

    def __init__(self, weight: torch.Tensor | GroupedInt8 | BlockQ4 | BlockQ6K, dtype: torch.dtype,
                 quantized: bool) -> None:  # fmt: skip
        self.dtype = dtype
        self.by_column = False
        self.packed = self.blocks = None
        if isinstance(weight, (BlockQ4, BlockQ6K)):
            self.blocks, self.weight, self.scale = weight, weight.blocks, None
        elif isinstance(weight, GroupedInt8):
            self.weight, self.scale = weight.q, weight.scale
        elif quantized:
            q, scale = quantize_rows(weight)
            self.weight, self.scale = q.to(weight.device), scale.to(weight.device, dtype)
        else:
            self.weight, self.scale = weight, None

    @classmethod
    def of_grouped_head(cls, head: Int8Linear, dtype: torch.dtype) -> Embedding:
        """The table of a tied group-wise int8 output head, read in its ``[groups, 32, vocab]`` layout: a
        tied Q8_0 model holds its embedding once."""
        table = cls.__new__(cls)
        table.dtype, table.by_column, table.blocks = dtype, head.kernel == "grouped", None
        table.packed = head.q8 if head.kernel == "grouped-q8" else None  # cpu_gemm's tiles of 4 rows
        table.weight, table.scale = head.weight, head.scale  # grouped: [groups, 32, vocab], [groups, vocab]
        return table

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:  # each row's weights exactly (float32), then the model's dtype
            rows = self.blocks.blocks[token_ids]
            kept = BlockQ6K(rows) if isinstance(self.blocks, BlockQ6K) else BlockQ4(self.blocks.kind, rows)
            return kept.dequantize(torch.float32).to(self.dtype)
        if self.packed is not None:  # the same float32 products as the row layout below
            q, scale = self.packed.rows(token_ids)
            return (q.view(q.shape[0], -1, GROUP_SIZE) * scale[:, :, None]).view(q.shape).to(self.dtype)
        if self.by_column:  # the same float32 products as the row layout below, gathered by column
            q = self.weight[:, :, token_ids]  # [groups, 32, n]
            rows = (q * self.scale[:, None, token_ids]).permute(2, 0, 1)
            return rows.reshape(token_ids.shape[0], -1).to(self.dtype)
        if self.scale is None:
            return self.weight[token_ids]
        if self.scale.dim() == 2:  # group-wise: float32 products (exact), then the model's dtype
            q = self.weight[token_ids]
            return (q.view(q.shape[0], -1, GROUP_SIZE) * self.scale[token_ids, :, None]).view(q.shape).to(self.dtype)
        return self.weight[token_ids].to(self.dtype) * self.scale[token_ids, None]


class PagedLlama:
    """Functional forward pass over fused weights; no autograd, no nn.Module overhead."""

    def __init__(
        self,
        config,
        state: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        linear_kernel: str = "auto",
        quantization: str = "none",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        if config.model_type not in NATIVE_MODEL_TYPES:
            raise ValueError(
                f"the native backend runs {', '.join(NATIVE_MODEL_TYPES)} checkpoints, not "
                f"{config.model_type!r}; set model.backend = \"transformers\" for other architectures"
            )
        self.config = config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.act = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act in ("silu", "swish")
        self.scaling = self.head_dim**-0.5
        linear = LinearFactory(linear_kernel, device, dtype, quantization)
        self.linear_kernel = linear.kernel
        # tierserve's elementwise and decode attention kernels (cpu_gemm) run unless torch's are asked for
        self.own_kernels = linear_kernel != "torch"

        def take(name: str, required: bool = True) -> torch.Tensor | GroupedInt8 | None:
            tensor = state.pop(name, None)
            if tensor is None:
                if required:
                    raise ValueError(f"checkpoint is missing weight {name!r}")
                return None
            if isinstance(tensor, (GroupedInt8, BlockQ4, BlockQ6K)):
                return tensor.to(device)
            return tensor.to(device=device, dtype=dtype)

        embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        lm_head = take("lm_head.weight", required=False)
        tied = lm_head is None or getattr(config, "tie_word_embeddings", False)
        self.lm_head = linear(embed if tied else lm_head)
        head = self.lm_head
        if tied and isinstance(embed, GroupedInt8) and isinstance(head, Int8Linear) and head.kernel.startswith("grouped"):
            self.embed = Embedding.of_grouped_head(head, dtype)  # one int8 table for both, in the head's layout
        else:
            self.embed = Embedding(embed, dtype, quantized=quantization in ("int8", *BLOCK_MODES))
        del embed, lm_head

        layer_types = getattr(config, "layer_types", None)
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            biases = [take(p + f"self_attn.{n}_proj.bias", required=False) for n in "qkv"]
            if layer_types:
                window = config.sliding_window if layer_types[i] == "sliding_attention" else None
            else:
                window = getattr(config, "sliding_window", None)
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=linear(
                        cat_rows([q, k, v]),
                        torch.cat(biases, 0) if all(b is not None for b in biases) else None,
                    ),
                    q_norm=take(p + "self_attn.q_norm.weight", required=False),
                    k_norm=take(p + "self_attn.k_norm.weight", required=False),
                    o_proj=linear(take(p + "self_attn.o_proj.weight"), take(p + "self_attn.o_proj.bias", required=False)),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear(cat_rows([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                    down=linear(take(p + "mlp.down_proj.weight")),
                    sliding_window=window,
                )
            )
        state.pop("model.rotary_emb.inv_freq", None)
        self.linear_kernel = linear.kernels
        self.windows, self.trained_window = window_layout([layer.sliding_window for layer in self.layers])
        self._build_rope(config)
        self.arena = KVArena(
            len(self.layers), self.num_kv_heads, self.head_dim, self.kv_dtype, device, own_kernels=self.own_kernels
        )
        self.block_size = 0
        self.lora: LoraSlots | None = None
        # every layer in one C call for decodes of a few rows, where all matrices run tierserve's kernels
        self.fused_decode = FusedDecode.build(self)

    def enable_lora(self, max_loras: int, max_rank: int) -> LoraSlots:
        """Reserve ``max_loras`` adapter slots of rank ``max_rank`` on every layer's projections."""
        hidden = self.config.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = self.config.intermediate_size
        shapes = {
            "qkv": (hidden, [q_size, kv_size, kv_size]),
            "o_proj": (q_size, [hidden]),
            "gate_up": (hidden, [inter, inter]),
            "down": (inter, [hidden]),
        }
        self.lora = LoraSlots(shapes, len(self.layers), max_loras, max_rank, self.device, self.dtype)
        return self.lora

    def _build_rope(self, config) -> None:
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = int(self.head_dim * params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic NTK RoPE scaling is not supported by the native backend; use transformers")
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        self._inv_freq, self._rope_scaling = inv_freq.float(), scaling
        self._rope_table(config.max_position_embeddings)

    def _rope_table(self, length: int) -> None:
        positions = torch.arange(length, dtype=torch.float)
        freqs = positions[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self._rope_scaling).to(self.device, self.dtype)
        sin = (emb.sin() * self._rope_scaling).to(self.device, self.dtype)
        # rotate_half(x) * sin == x.roll(half) * [-sin_1, sin_2], exactly, in two ops instead of five
        half = sin.shape[-1] // 2
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def ensure_positions(self, length: int) -> None:
        """Grow the RoPE tables past the trained context (sliding-window generation runs beyond it)."""
        if length > self.cos.shape[0]:
            self._rope_table(max(length, 2 * self.cos.shape[0]))

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.arena.bytes_per_block(block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.arena.allocate(num_blocks, block_size)

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """CPU copy ``[n, layers, 2, block_size, kv_heads, head_dim]`` of whole blocks."""
        return self.arena.read_blocks(block_ids)

    def write_blocks(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Copy ``[n, layers, 2, block_size, kv_heads, head_dim]`` into whole blocks."""
        self.arena.write_blocks(block_ids, data)

    def _run_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend, lora: LoraBatch | None = None
    ) -> torch.Tensor:
        """The decoder stack over a flat token batch; ``attend(layer_index, layer, q, k, v)`` supplies attention,
        ``lora`` the rows that add an adapter's low-rank update to each projection."""
        slots = self.lora if lora is not None else None
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin_signed[positions].unsqueeze(1)
        half = self.head_dim // 2
        hidden = self.embed(input_ids)
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q_size = heads * self.head_dim
        kv_size = kv_heads * self.head_dim
        tokens = hidden.shape[0]
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, self.eps, self.own_kernels)
            qkv = layer.qkv(x)
            if slots is not None:
                qkv = slots.apply(lora, "qkv", index, x, qkv)
            v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, self.head_dim)
            if layer.q_norm is None:  # q and k rotate as one tensor of heads + kv_heads
                qk = qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, self.head_dim)
                qk = qk * cos + qk.roll(half, -1) * sin
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = rms_norm(qkv[:, :q_size].view(tokens, heads, self.head_dim), layer.q_norm, self.eps, self.own_kernels)
                k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, self.head_dim)
                k = rms_norm(k, layer.k_norm, self.eps, self.own_kernels)
                q = q * cos + q.roll(half, -1) * sin
                k = k * cos + k.roll(half, -1) * sin
            attn = attend(index, layer, q, k, v)
            if slots is None:
                hidden = hidden + layer.o_proj(attn.reshape(tokens, q_size))
                x = rms_norm(hidden, layer.post_norm, self.eps, self.own_kernels)
                hidden = hidden + layer.down(self._gated(layer.gate_up(x)))
                continue
            flat = attn.reshape(tokens, q_size)
            hidden = hidden + slots.apply(lora, "o_proj", index, flat, layer.o_proj(flat))
            x = rms_norm(hidden, layer.post_norm, self.eps)
            gate, up = slots.apply(lora, "gate_up", index, x, layer.gate_up(x)).chunk(2, dim=-1)
            act = self.act(gate) * up
            hidden = hidden + slots.apply(lora, "down", index, act, layer.down(act))
        return hidden

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up``; SiLU in one call (``cpu_gemm``) instead of torch's three ops over strided halves."""
        out = cpu_gemm.silu_mul(gate_up) if self.silu and self.own_kernels else None
        if out is not None:
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(self, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (float32) for ``batch.sample_rows`` and the final hidden states (after the last norm) they
        came from; KV of every token is written to the arena."""

        def paged_attention(index, layer, q, k, v):
            self.arena.store(index, batch.slot_mapping, k, v)
            return self.arena.attend(index, q, batch.groups, layer.sliding_window, self.scaling)

        hidden = self.fused_decode.run(batch) if self.fused_decode is not None else None
        if hidden is None:
            hidden = self._run_layers(batch.input_ids, batch.positions, paged_attention, batch.lora)
        last = rms_norm(hidden[batch.sample_rows], self.norm, self.eps)
        return self.lm_head(last).float(), last

    def final_hidden_states(self, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
        """Hidden states after the final norm, ``[len, hidden]`` per token id sequence.

        The layer math of ``forward``, but each sequence attends causally to its
        own keys and values only: the KV arena is neither read nor written, so
        this can run between steps without disturbing cached or running sequences.
        """
        lengths = [len(s) for s in sequences]
        input_ids = torch.cat(sequences).to(self.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        masks: list[dict[int | None, torch.Tensor | None]] = []
        for n in lengths:
            pos = torch.arange(n)
            by_window: dict[int | None, torch.Tensor | None] = {}
            for window in self.windows:
                if window is None or n <= window:
                    by_window[window] = None  # plain causal
                else:
                    keep = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
                    by_window[window] = keep[None, None].to(self.device)
            masks.append(by_window)

        def own_attention(index, layer, q, k, v):
            attn = torch.empty_like(q)
            start = 0
            for n, by_window in zip(lengths, masks):
                rows = slice(start, start + n)
                mask = by_window[layer.sliding_window]
                result = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1)[None],
                    k[rows].transpose(0, 1)[None],
                    v[rows].transpose(0, 1)[None],
                    attn_mask=mask,
                    is_causal=mask is None and n > 1,
                    scale=self.scaling,
                    enable_gqa=self.num_kv_heads != self.num_heads,
                )
                attn[rows] = result[0].transpose(0, 1)
                start += n
            return attn

        hidden = self._run_layers(input_ids, positions, own_attention)
        return list(rms_norm(hidden, self.norm, self.eps).split(lengths))
