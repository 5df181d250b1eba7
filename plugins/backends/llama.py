"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) computed against a paged KV arena.

Weights come from a Hugging Face state dict; q/k/v and gate/up projections are
fused into one matmul each. Attention reads K/V through block tables:

    slot(seq, pos) = block_table[pos // block_size] * block_size + pos % block_size
    k_cache[layer] : [num_blocks * block_size, num_kv_heads, head_dim]

Decode tokens of all sequences attend in one batched call; each prefill chunk
attends on its own (a chunk starting mid-prompt sees the cached prefix). Keys
are gathered a whole block at a time (one ``index_select`` of block-sized rows,
several times faster than gathering single slots). In a decode batch the query
heads of one KV head attend as that head's rows (K and V are never repeated
for grouped-query attention), and leading blocks all sequences share (a system
prompt, the prompt of parallel samples) are read once for the whole batch,
their result merged with each sequence's own part by log-sum-exp (cascade
attention, as in FlashInfer and vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tierserve.plugins.backends.linear import Int8Linear, Linear, LinearFactory, quantize_rows

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

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


@dataclass(slots=True)
class SharedPrefix:
    """Leading key positions every row of a decode group sees: attended once for the whole group."""

    keys: slice | torch.Tensor  # arena rows (consecutive blocks) or the block ids holding them
    tokens: int  # key positions 0..tokens-1, whole blocks
    own_masks: dict[int | None, torch.Tensor | None]  # sliding window -> additive mask [batch, 1, 1, ctx - tokens]


@dataclass(slots=True)
class AttentionGroup:
    """Rows of the flattened batch that attend together, and what they read."""

    rows: slice | torch.Tensor  # query rows: a slice of batch * q_len rows, or [batch, q_len] indices (-1 = padding)
    blocks: torch.Tensor  # [batch, ceil(ctx / block_size)] block ids holding key positions 0..ctx-1
    ctx: int  # key positions read (the longest context in the group)
    masks: dict[int | None, torch.Tensor | None]  # sliding window -> bool mask [batch, 1, q, ctx]
    batch: int
    q_len: int
    shared: SharedPrefix | None = None  # decode groups only


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output ``[n, heads, q, d]`` and its float32 log-sum-exp ``[n, heads, q, 1]``; ``mask`` is additive.

    Two such partial results over disjoint key sets merge exactly into the
    attention over their union (``merge_attention``).
    """
    if q.device.type == "cpu":  # torch's CPU flash kernel hands back the log-sum-exp it computes anyway
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        return out, lse.unsqueeze(-1).float()
    return attention_with_lse_math(q, k, v, mask, scale)


def attention_with_lse_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_lse`` in plain float32 tensor math, for devices without a kernel that returns it."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, -1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v.float()).to(q.dtype), lse


def merge_attention(
    a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """The attention over two disjoint key sets from each set's output and log-sum-exp."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return ((a.float() * weight_a + b.float() * weight_b) / (weight_a + weight_b)).to(a.dtype)


@dataclass(slots=True)
class PagedBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    groups: list[AttentionGroup]
    sample_rows: torch.Tensor  # rows whose logits are returned


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, scale in the input dtype."""
    dtype = x.dtype
    if dtype == torch.float32:  # one fused op instead of five; the same float32 arithmetic
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class Embedding:
    """The token embedding table, float or int8 rows with one scale each (``model.quantization``)."""

    __slots__ = ("weight", "scale", "dtype")

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, quantized: bool) -> None:
        self.dtype = dtype
        if quantized:
            q, scale = quantize_rows(weight)
            self.weight, self.scale = q.to(weight.device), scale.to(weight.device, dtype)
        else:
            self.weight, self.scale = weight, None

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return self.weight[token_ids]
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
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the native backend runs {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints, not "
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
        self.scaling = self.head_dim**-0.5
        linear = LinearFactory(linear_kernel, device, dtype, quantization)
        self.linear_kernel = linear.kernel

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            tensor = state.pop(name, None)
            if tensor is None:
                if required:
                    raise ValueError(f"checkpoint is missing weight {name!r}")
                return None
            return tensor.to(device=device, dtype=dtype)

        embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        lm_head = take("lm_head.weight", required=False)
        tied = lm_head is None or getattr(config, "tie_word_embeddings", False)
        self.lm_head = linear(embed if tied else lm_head)
        self.embed = Embedding(embed, dtype, quantized=quantization == "int8")
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
                        torch.cat([q, k, v], 0).contiguous(),
                        torch.cat(biases, 0) if all(b is not None for b in biases) else None,
                    ),
                    q_norm=take(p + "self_attn.q_norm.weight", required=False),
                    k_norm=take(p + "self_attn.k_norm.weight", required=False),
                    o_proj=linear(take(p + "self_attn.o_proj.weight"), take(p + "self_attn.o_proj.bias", required=False)),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear(
                        torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0).contiguous()
                    ),
                    down=linear(take(p + "mlp.down_proj.weight")),
                    sliding_window=window,
                )
            )
        state.pop("model.rotary_emb.inv_freq", None)
        self.windows = sorted({layer.sliding_window for layer in self.layers}, key=lambda w: w or 0)
        # every layer windowed: KV older than the widest window is never read again
        self.trained_window = None if None in self.windows else max(self.windows)
        self._build_rope(config)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.block_size = 0

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
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * len(self.layers) * block_size * self.num_kv_heads * self.head_dim * element

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks * block_size, self.num_kv_heads, self.head_dim)
        self.block_size = block_size
        self.k_cache = [torch.zeros(shape, device=self.device, dtype=self.kv_dtype) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, device=self.device, dtype=self.kv_dtype) for _ in self.layers]

    def read_blocks(self, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
        """CPU copy ``[n, layers, 2, block_size, kv_heads, head_dim]`` of whole blocks."""
        shape = (-1, block_size, self.num_kv_heads, self.head_dim)
        out = torch.empty(
            (len(block_ids), len(self.layers), 2, block_size, self.num_kv_heads, self.head_dim),
            dtype=self.kv_dtype,
            device="cpu",
            pin_memory=self.device.type == "cuda",
        )
        for layer, (k, v) in enumerate(zip(self.k_cache, self.v_cache)):
            out[:, layer, 0].copy_(k.view(shape).index_select(0, block_ids), non_blocking=True)
            out[:, layer, 1].copy_(v.view(shape).index_select(0, block_ids), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def write_blocks(self, block_ids: torch.Tensor, block_size: int, data: torch.Tensor) -> None:
        """Copy ``[n, layers, 2, block_size, kv_heads, head_dim]`` into whole blocks."""
        shape = (-1, block_size, self.num_kv_heads, self.head_dim)
        data = data.to(device=self.device, dtype=self.kv_dtype)
        for layer, (k, v) in enumerate(zip(self.k_cache, self.v_cache)):
            k.view(shape).index_copy_(0, block_ids, data[:, layer, 0])
            v.view(shape).index_copy_(0, block_ids, data[:, layer, 1])

    def _run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The decoder stack over a flat token batch; ``attend(layer_index, layer, q, k, v)`` supplies attention."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin_signed[positions].unsqueeze(1)
        half = self.head_dim // 2
        hidden = self.embed(input_ids)
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q_size = heads * self.head_dim
        kv_size = kv_heads * self.head_dim
        tokens = hidden.shape[0]
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, self.eps)
            qkv = layer.qkv(x)
            v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, self.head_dim)
            if layer.q_norm is None:  # q and k rotate as one tensor of heads + kv_heads
                qk = qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, self.head_dim)
                qk = qk * cos + qk.roll(half, -1) * sin
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = rms_norm(qkv[:, :q_size].view(tokens, heads, self.head_dim), layer.q_norm, self.eps)
                k = rms_norm(qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, self.head_dim), layer.k_norm, self.eps)
                q = q * cos + q.roll(half, -1) * sin
                k = k * cos + k.roll(half, -1) * sin
            attn = attend(index, layer, q, k, v)
            hidden = hidden + layer.o_proj(attn.reshape(tokens, q_size))
            x = rms_norm(hidden, layer.post_norm, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(self.act(gate) * up)
        return hidden

    def forward(self, batch: PagedBatch) -> torch.Tensor:
        """Logits (float32) for ``batch.sample_rows``; KV of every token is written to the arena."""

        def paged_attention(index, layer, q, k, v):
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            k_cache.index_copy_(0, batch.slot_mapping, k.to(self.kv_dtype))
            v_cache.index_copy_(0, batch.slot_mapping, v.to(self.kv_dtype))
            return self._attend(q, k_cache, v_cache, batch.groups, layer.sliding_window)

        hidden = self._run_layers(batch.input_ids, batch.positions, paged_attention)
        last = rms_norm(hidden[batch.sample_rows], self.norm, self.eps)
        return self.lm_head(last).float()

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

    def _attend(self, q, k_cache, v_cache, groups: list[AttentionGroup], window: int | None) -> torch.Tensor:
        only = groups[0] if len(groups) == 1 else None
        # one group over all rows in order (a decode step, a lone prefill): its result is the output as it is
        direct = only is not None and isinstance(only.rows, slice) and only.rows == slice(0, q.shape[0])
        out = None if direct else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        by_block = (-1, self.block_size, self.num_kv_heads, self.head_dim)
        for group in groups:
            if group.q_len == 1:  # decodes: rows is a slice
                result = self._attend_decode(q[group.rows], k_cache, v_cache, group, window)
                if direct:
                    return result
                out[group.rows] = result
                continue
            padded = isinstance(group.rows, torch.Tensor)
            if padded:
                queries = q[group.rows.clamp(min=0)].transpose(1, 2)  # [batch, heads, q_len, head_dim]
            else:
                queries = q[group.rows].view(group.batch, group.q_len, self.num_heads, self.head_dim).transpose(1, 2)
            ids = group.blocks.reshape(-1)
            shape = (group.batch, -1, self.num_kv_heads, self.head_dim)
            # [batch, kv_heads, ctx, head_dim]
            keys = k_cache.view(by_block).index_select(0, ids).view(shape)[:, : group.ctx].transpose(1, 2)
            values = v_cache.view(by_block).index_select(0, ids).view(shape)[:, : group.ctx].transpose(1, 2)
            if keys.dtype != queries.dtype:  # kv_cache.dtype narrower than the model's
                keys, values = keys.to(queries.dtype), values.to(queries.dtype)
            mask = group.masks[window]
            result = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None and group.q_len > 1,
                scale=self.scaling,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
            result = result.transpose(1, 2)
            if direct:
                return result.reshape(-1, self.num_heads, self.head_dim)
            if padded:
                valid = group.rows >= 0
                out[group.rows[valid]] = result[valid]
            else:
                out[group.rows] = result.reshape(-1, self.num_heads, self.head_dim)
        return out

    def _attend_decode(self, q, k_cache, v_cache, group: AttentionGroup, window: int | None) -> torch.Tensor:
        """One query token per sequence, ``q: [batch, heads, head_dim]``.

        The query heads that share a KV head become that head's query rows, so
        K and V are read once per KV head, never repeated. A prefix all rows
        share is attended once for the whole batch (every row's queries against
        one copy of its keys) and merged by log-sum-exp with each row's own part.
        """
        batch, kv_heads, head_dim = group.batch, self.num_kv_heads, self.head_dim
        queries = q.view(batch, kv_heads, -1, head_dim)  # [batch, kv_heads, heads per kv head, head_dim]
        shared = group.shared
        skip = 0 if shared is None else shared.tokens // self.block_size
        ids = group.blocks[:, skip:].reshape(-1)
        by_block = (-1, self.block_size, kv_heads, head_dim)
        shape = (batch, -1, kv_heads, head_dim)
        ctx = group.ctx - (0 if shared is None else shared.tokens)
        keys = k_cache.view(by_block).index_select(0, ids).view(shape)[:, :ctx].transpose(1, 2)
        values = v_cache.view(by_block).index_select(0, ids).view(shape)[:, :ctx].transpose(1, 2)
        if keys.dtype != queries.dtype:  # kv_cache.dtype narrower than the model's
            keys, values = keys.to(queries.dtype), values.to(queries.dtype)
        if shared is None:
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=group.masks[window], scale=self.scaling
            )
            return out.reshape(batch, self.num_heads, head_dim)
        own, own_lse = attention_with_lse(queries, keys, values, shared.own_masks[window], self.scaling)
        if isinstance(shared.keys, slice):
            prefix_k, prefix_v = k_cache[shared.keys], v_cache[shared.keys]  # [tokens, kv_heads, head_dim] views
        else:
            prefix_k = k_cache.view(by_block).index_select(0, shared.keys).view(-1, kv_heads, head_dim)
            prefix_v = v_cache.view(by_block).index_select(0, shared.keys).view(-1, kv_heads, head_dim)
        if prefix_k.dtype != queries.dtype:
            prefix_k, prefix_v = prefix_k.to(queries.dtype), prefix_v.to(queries.dtype)
        # the whole batch's queries as the rows of one sequence: [1, kv_heads, batch * heads per kv head, head_dim]
        rows = queries.transpose(0, 1).reshape(1, kv_heads, -1, head_dim)
        common, common_lse = attention_with_lse(
            rows, prefix_k.transpose(0, 1)[None], prefix_v.transpose(0, 1)[None], None, self.scaling
        )
        common = common.view(kv_heads, batch, -1, head_dim).transpose(0, 1)
        common_lse = common_lse.view(kv_heads, batch, -1, 1).transpose(0, 1)
        return merge_attention(own, own_lse, common, common_lse).reshape(batch, self.num_heads, head_dim)
