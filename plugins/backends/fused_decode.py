"""Decode of a batch of sequences through every layer in one call of tierserve's C kernels (``ts_decode_layers``).

``PagedLlama._run_layers`` calls about fifteen kernels and torch ops per layer.
At batch 1 each spends 5-30 µs in Python, dispatch and an OpenMP fork/join
around a few µs of work: on the 77M-parameter bench model, about 2 ms of an
11 ms int8 step. Where every matrix of the model runs one of tierserve's
kernels (``cpu_gemm``: q8 for int8 weights or a GGUF Q8_0 file, ``bf16-avx2``
or, on the AVX-512 build, ``bf16-panels`` for bfloat16 weights and
``f32-panels`` for float32 ones) and the step is a plain decode, the same
operations run in one OpenMP parallel region instead, the threads meeting at
a barrier between operations, as llama.cpp's graph does; the per-row work
(norms, RoPE, the KV store, residual adds) is split by rows among the
threads. Each operation is computed by the same C code in the same order as
the Python path's kernel for it, and bfloat16 activations are rounded
wherever the Python path's bfloat16 tensors round them, so the hidden states
are the Python path's to the bit (tests/test_cpu_gemm.py checks).

Rows: at most ``SMALL_BATCH`` where a matrix is int8 (the layer loop runs
fbgemm above that), at most ``cpu_gemm.NORM_ROWS`` otherwise (the scratch and
the per-row split are sized for decode batches; within that the layer loop
normalises with the same kernel). Anything else
(prefill chunks, drafts, LoRA rows, more rows) runs the Python path. A prefix
every row of the batch shares (``paged_attention.shared_prefix``) is read once
for all rows, as the Python path reads it: the AVX-512 build only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierserve.plugins.backends import cpu_gemm
from tierserve.plugins.backends.cpu_gemm_abi import (
    BF16, F32, Q6_K, Q8_GROUPED, Q8_ROW, DecoderLayer, DecodeShape,
)
from tierserve.plugins.backends.linear import SMALL_BATCH, BlockLinear, Int8Linear, Linear, SplitLinear
from tierserve.plugins.backends.paged_attention import PagedBatch

if TYPE_CHECKING:
    from tierserve.plugins.backends.llama import LayerWeights, PagedLlama


def _kind(linear: Linear | Int8Linear | BlockLinear | SplitLinear, dtype: torch.dtype) -> int | None:
    """How ts_decode_layers computes this projection (a split one: its first part), or None where it cannot (the
    layer loop runs)."""
    if isinstance(linear, SplitLinear):  # two parts at most: ts_layer's qkv and qkv_tail
        kinds = [_kind(part, dtype) for part in linear.parts]
        return None if len(kinds) != 2 or None in kinds else kinds[0]
    if isinstance(linear, BlockLinear) and dtype == torch.float32:
        return Q6_K if linear.packed.kind == "Q6_K" else cpu_gemm.Q4_KINDS[linear.packed.kind]
    if isinstance(linear, Int8Linear) and linear.q8 is not None and dtype == torch.float32:
        return Q8_GROUPED if linear.q8.grouped else Q8_ROW
    if isinstance(linear, Linear) and linear.own is not None and dtype == torch.bfloat16:
        return BF16 if linear.own.weight.dtype == torch.int16 else None  # bfloat16 bits
    if isinstance(linear, Linear) and linear.own is not None and dtype == torch.float32:
        return F32 if linear.own.weight.dtype == torch.float32 else None  # f32-panels (the AVX-512 build)
    return None


def _packed(linear: Linear | Int8Linear | BlockLinear):
    """The packed weight ``ts_decode_layers`` reads (``_kind`` said it can)."""
    if isinstance(linear, Int8Linear):
        return linear.q8
    return linear.packed if isinstance(linear, BlockLinear) else linear.own


def _projections(layer: LayerWeights) -> tuple:
    return layer.qkv, layer.o_proj, layer.gate_up, layer.down


class FusedDecode:
    """The layer stack of one ``PagedLlama`` as ``ts_decode_layers`` reads it (``cpu_gemm_abi.DecodeStack``)."""

    def __init__(self, model: PagedLlama, kinds: list[list[int]]) -> None:
        self.model = model
        self.windows = [layer.sliding_window for layer in model.layers]
        config = model.config
        self.shape = DecodeShape(config.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim,
                                 config.intermediate_size)  # fmt: skip
        layers = []
        for layer in model.layers:
            qkv, tail, tail_rows = layer.qkv, None, 0
            if isinstance(qkv, SplitLinear):  # q and k in one GGUF type, v in another
                qkv, tail = qkv.parts
                tail_rows = tail.out_features
                tail = _packed(tail).projection()
            packed = [_packed(linear) for linear in (qkv, *_projections(layer)[1:])]
            input_norm, q_norm, k_norm, post_norm = (
                None if norm is None else norm.float().contiguous()
                for norm in (layer.input_norm, layer.q_norm, layer.k_norm, layer.post_norm)
            )
            layers.append(DecoderLayer(input_norm, post_norm, q_norm, k_norm, *(p.projection() for p in packed),
                                       qkv_tail=tail, qkv_tail_rows=tail_rows))  # fmt: skip
        self.stack = cpu_gemm.library().decode_stack(self.shape, layers, act_bf16=model.dtype == torch.bfloat16)
        self.arena_keys: list[torch.Tensor] | None = None  # the arena's key list the stack points into
        # a shared prefix runs the prefill attention kernel (the AVX-512 build's)
        self.prefill_attention = cpu_gemm.library().has_prefill_attention
        # int8 rows past SMALL_BATCH run fbgemm in the layer loop; float rows use tierserve's RMSNorm up to NORM_ROWS
        int8 = any(kind in (Q8_ROW, Q8_GROUPED) for row in kinds for kind in row)
        self.max_rows = SMALL_BATCH if int8 else cpu_gemm.NORM_ROWS
        self.scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, model: PagedLlama) -> FusedDecode | None:
        """The fused stack where ``model`` can run it (CPU, every matrix on q8 with float32 activations or on
        the bfloat16 kernel with bfloat16 ones, SiLU, full-width RoPE, heads the attention kernel takes);
        None otherwise."""
        lib = cpu_gemm.library() if model.own_kernels and model.device.type == "cpu" else None
        if lib is None or not model.silu:
            return None
        heads, kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim
        if (
            heads % kv_heads or heads // kv_heads > cpu_gemm.MAX_HEADS_PER_KV_HEAD or head_dim % 8
            or model.cos.shape[-1] != head_dim or model.kv_dtype not in (torch.float32, torch.bfloat16)
            or model.config.intermediate_size % cpu_gemm.QK  # SiLU-mul runs in blocks of 32 columns
        ):  # fmt: skip
            return None
        kinds = []
        for layer in model.layers:
            layer_kinds = [_kind(linear, model.dtype) for linear in _projections(layer)]
            if None in layer_kinds or layer.gate_up.bias is not None or layer.down.bias is not None:
                return None
            if isinstance(layer.qkv, SplitLinear) and layer.qkv.parts[0].out_features > 2 * model.config.intermediate_size:
                return None  # the parts are computed into the gate/up area
            if (layer.q_norm is None) != (layer.k_norm is None) or (layer.q_norm is None) != (model.layers[0].q_norm is None):
                return None  # run() checks the first layer's norms for every layer
            kinds.append(layer_kinds)
        return cls(model, kinds)

    def run(self, batch: PagedBatch) -> torch.Tensor | None:
        """The hidden states after the last layer (before the final norm), KV written to the arena; None
        where the batch is not a plain decode of at most ``max_rows`` rows (the Python path runs it)."""
        model = self.model
        rows = batch.input_ids.shape[0]
        if rows > self.max_rows or batch.lora is not None or len(batch.groups) != 1:
            return None
        group = batch.groups[0]
        if group.q_len != 1 or group.rows != slice(0, rows):
            return None
        shared = group.shared
        if shared is not None and not self.prefill_attention:
            return None
        if model.layers[0].q_norm is not None and rows * model.num_heads > cpu_gemm.NORM_ROWS:
            return None  # the Python path normalises that many head rows with torch's op
        arena = model.arena
        if not arena.k:
            return None  # no arena (cleared): the layer loop says so
        if arena.k is not self.arena_keys:  # allocated (again) since the stack was set: new lists, new buffers
            self.stack.set_arena(arena.k, arena.v)
            self.arena_keys = arena.k
        bs = arena.block_size
        if shared is None:
            ctx, blocks, shared_blocks, shared_tokens = group.ctx, group.blocks, None, 0
            row_masks = group.masks
        else:  # the prefix is read once for all rows; each row's own part has its own blocks, context and mask
            ctx, shared_tokens = group.ctx - shared.tokens, shared.tokens
            blocks = group.blocks[:, shared_tokens // bs :]
            shared_blocks = shared.block_ids(bs).contiguous()
            row_masks = shared.own_keeps
        masks = {
            window: None if mask is None else mask.reshape(rows, ctx).contiguous().view(torch.uint8)
            for window, mask in row_masks.items()
        }
        work, quantized, block_scales = self._scratch(rows, ctx)
        hidden = model.embed(batch.input_ids).float().contiguous()  # a new tensor: updated in place
        cos = model.cos[batch.positions].float().contiguous()
        sin = model.sin_signed[batch.positions].float().contiguous()
        self.stack.run(
            hidden, cos, sin, batch.slot_mapping, blocks.to(torch.int64).contiguous(), bs, ctx,
            [masks[window] for window in self.windows], model.eps, model.scaling, work, quantized, block_scales,
            shared_blocks, shared_tokens,
        )  # fmt: skip
        return hidden.to(model.dtype)

    def _scratch(self, rows: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The float work area, int8 rows and block scales ``ts_decode_layers`` needs for ``rows`` rows over
        ``ctx`` positions: the kept ones where they are large enough, else larger ones (rows rounded up to
        16, at least ``SMALL_BATCH``, the context to 1024 positions; never smaller than the kept ones)."""
        shape = self.shape
        if self.scratch is None or self.scratch[0].numel() < rows * shape.work_floats(ctx) or (
            self.scratch[1].numel() < rows * shape.widest
        ):
            capacity, most = -(-ctx // 1024) * 1024, max(SMALL_BATCH, -(-rows // 16) * 16)
            kept = (0, 0) if self.scratch is None else (self.scratch[0].numel(), self.scratch[1].numel())
            floats, widest = max(kept[0], most * shape.work_floats(capacity)), max(kept[1], most * shape.widest)
            self.scratch = (
                torch.empty(floats),
                torch.empty(widest, dtype=torch.int8),
                torch.empty(widest // cpu_gemm.QK),
            )
        return self.scratch
