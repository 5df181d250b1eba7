"""Attention over tierserve's paged KV arena: the step's batch layout, the arena, and the kernels.

Both paged backends use it: ``native`` (its own Llama-family layers) and
``transformers`` (a model's own modeling code, whose attention calls land here
through transformers' ``AttentionInterface``). A step's chunks are flattened
into one token batch; each layer writes its keys and values to

    slot(seq, pos) = block_table[pos // block_size] * block_size + pos % block_size
    k[layer] : [num_blocks * block_size, kv_heads, head_dim]

and attends through the block tables. Short chunks (decodes, draft
verification, the last prompt tokens after a prefix hit) attend in one padded
call, long prefill chunks one by one (a chunk starting mid-prompt sees the
cached prefix). Keys are gathered a whole block at a time (one
``index_select`` of block-sized rows, several times faster than single
slots). In a decode batch the query heads of one KV head attend as that head's
rows (K and V are never repeated for grouped-query attention), and leading
blocks all sequences share (a system prompt, the prompt of parallel samples)
are read once for the whole batch, their result merged with each sequence's
own part by log-sum-exp (cascade attention, as in FlashInfer and vLLM).

A chunk whose drafts form a token tree (``ScheduledChunk.tree_parents``)
joins the padded short group whatever its length: its nodes keep their
storage slots (one after another past the real tokens) but are positioned
at the last real token's position plus their depth, and each node's row
sees the context and its own ancestors only (``core/token_tree.py``).
"""

from __future__ import annotations

import math
import mmap
import warnings
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tierserve.core.batch import ScheduledChunk
from tierserve.plugins.backends import cpu_gemm

SHORT_CHUNK_TOKENS = 16  # chunks this short share one padded attention call
# a decode batch reads a prefix its sequences share once, when it is at least this long
SHARED_PREFIX_MIN_TOKENS = 64


@dataclass(slots=True)
class SharedPrefix:
    """Leading key positions every row of a decode group sees: attended once for the whole group."""

    keys: slice | torch.Tensor  # arena rows (consecutive blocks) or the block ids holding them
    tokens: int  # key positions 0..tokens-1, whole blocks
    own_keeps: dict[int | None, torch.Tensor | None]  # sliding window -> visible own positions [batch, ctx - tokens]

    def block_ids(self, block_size: int) -> torch.Tensor:
        """The ids of the blocks holding the prefix, in order (int64)."""
        if isinstance(self.keys, slice):
            return torch.arange(self.keys.start // block_size, self.keys.stop // block_size)
        return self.keys.to(torch.int64)


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
    causal: bool = False  # one sequence whose queries see every position up to their own (masks[None] says so too)
    prompt: bool = False  # one sequence's prompt rows (no drafts): over bfloat16 KV they may round their queries


@dataclass(slots=True)
class PagedBatch:
    """One step's tokens, flattened, and how each attends."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] arena rows the tokens' keys and values go to
    groups: list[AttentionGroup]
    sample_rows: torch.Tensor  # rows whose logits are returned
    max_position: int
    order: list[ScheduledChunk] = field(default_factory=list)  # the chunks in row order (each one's rows are consecutive)
    lora: Any = None  # the backend's per-row adapter segments (native: lora.LoraBatch), None without adapters


def window_layout(per_layer: Seq[int | None]) -> tuple[list[int | None], int | None]:
    """The distinct sliding windows of a model's layers (``None``: full attention) and its trained window.

    The trained window is the widest one when every layer is windowed (KV older
    than it is never read again), else ``None``.
    """
    windows = sorted(set(per_layer), key=lambda w: w or 0)
    return windows, None if None in windows else max(windows)


def build_paged_batch(
    chunks: Seq[ScheduledChunk],
    block_size: int,
    windows: Seq[int | None],
    device: torch.device,
) -> PagedBatch:
    """Flatten a step's chunks; ``windows`` are the sliding windows the model's layers use
    (``None`` for full attention)."""
    from tierserve.core.token_tree import tree_depths, tree_visibility

    if len(chunks) == 1:
        lone = lone_decode(chunks[0], block_size, windows, device)
        if lone is not None:
            return lone
    bs = block_size
    short = [c for c in chunks if c.num_tokens <= SHORT_CHUNK_TOKENS or c.tree_parents is not None]
    # decodes (one token each) attend as their own group, so a step's longer short chunks (drafts, trees,
    # prompt tails) neither pad them to their length nor keep them from sharing a prefix (cascade attention)
    single = [c for c in short if c.num_tokens == 1]
    multi = [c for c in short if c.num_tokens > 1]
    short = single + multi
    short_ids = {id(c) for c in short}
    long = [c for c in chunks if id(c) not in short_ids]

    input_ids: list[int] = []
    positions: list[int] = []
    first_row: dict[int, int] = {}
    depths: dict[int, list[int]] = {}  # tree chunks: each node's depth
    for chunk in short + long:
        start = chunk.start
        first_row[id(chunk)] = len(input_ids)
        input_ids.extend(chunk.token_ids)
        parents = chunk.tree_parents
        if parents is None:
            positions.extend(range(start, start + chunk.num_tokens))
            continue
        root = start + chunk.num_real_tokens - 1
        depths[id(chunk)] = tree_depths(parents)
        positions.extend(range(start, root + 1))
        positions.extend(root + d for d in depths[id(chunk)])
    groups: list[AttentionGroup] = []
    slot_parts: list[torch.Tensor] = []

    def padded_group(part: list[ScheduledChunk]) -> None:
        """One attention group for short chunks whose rows lie one after another from ``part[0]``'s."""
        tables = [c.seq.block_table for c in part]
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        starts = torch.tensor([c.start for c in part], dtype=torch.long)
        lengths = torch.tensor([c.num_tokens for c in part], dtype=torch.long)
        ctx = starts + lengths
        q_len = int(lengths.max())
        pos = torch.arange(int(ctx.max()))
        offsets = torch.arange(q_len)
        q_valid = offsets[None, :] < lengths[:, None]  # [B, Q]
        q_pos = starts[:, None] + offsets[None, :]
        write_pos = q_pos.clamp(max=len(pos) - 1)  # padding rows point anywhere valid; they are dropped
        new_slots = table.gather(1, write_pos // bs) * bs + write_pos % bs
        slot_parts.append(new_slots[q_valid])
        causal = (pos[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        released = torch.tensor([c.released for c in part])
        drop_start, drop_end = released[:, 0, None, None], released[:, 1, None, None]
        causal &= (pos[None, None, :] < drop_start) | (pos[None, None, :] >= drop_end)  # released by a window
        # windows compare token positions, which tree nodes take from their depth, not their slot
        key_at = pos[None, :].expand(len(part), -1)
        query_at = q_pos
        if depths:
            key_at, query_at = key_at.clone(), q_pos.clone()
            for b, chunk in enumerate(part):
                depth = depths.get(id(chunk))
                if depth is None:
                    continue
                real, nodes = chunk.num_real_tokens, len(depth)
                base = chunk.start + real
                at = torch.tensor(depth) + (base - 1)
                key_at[b, base : base + nodes] = at
                query_at[b, real : real + nodes] = at
                causal[b, real : real + nodes, base : base + nodes] &= tree_visibility(chunk.tree_parents)
        keeps = {
            window: causal if window is None else causal & (key_at[:, None, :] > query_at[:, :, None] - window)
            for window in windows
        }
        masks: dict[int | None, torch.Tensor | None] = {}
        for window, keep in keeps.items():
            if q_len == 1 and bool(keep.all()):
                masks[window] = None  # equal-length decodes: nothing to mask
                continue
            keep = keep.clone()
            keep[:, :, 0] |= ~q_valid  # padding rows attend to something; their output is dropped
            masks[window] = keep[:, None].to(device)
        rows = torch.where(q_valid, torch.tensor([first_row[id(c)] for c in part])[:, None] + offsets[None, :], -1)
        if bool((lengths == q_len).all()):  # no padding: the group's rows lie in order from its first
            first = first_row[id(part[0])]
            rows_index: slice | torch.Tensor = slice(first, first + len(part) * q_len)
        else:
            rows_index = rows.to(device)
        blocks = table[:, : -(-int(ctx.max()) // bs)]
        group = AttentionGroup(rows_index, blocks.to(device), int(ctx.max()), masks, len(part), q_len)
        if q_len == 1:
            group.shared = shared_prefix(table, int(ctx.min()), keeps, bs, device)
        groups.append(group)

    for part in (single, multi):
        if part:
            padded_group(part)

    for chunk in long:
        start, n = chunk.start, chunk.num_tokens
        table = torch.tensor(chunk.seq.block_table, dtype=torch.long)
        pos = torch.arange(start + n)
        slots = table[pos // bs] * bs + pos % bs
        slot_parts.append(slots[start:])
        q_pos = torch.arange(start, start + n)
        causal = pos[None, :] <= q_pos[:, None]
        drop_start, drop_end = chunk.released
        dropped = drop_end > drop_start
        if dropped:
            causal &= (pos[None, :] < drop_start) | (pos[None, :] >= drop_end)
        masks = {}
        for window in windows:
            keep = causal if window is None else causal & (pos[None, :] > q_pos[:, None] - window)
            plain = window is None and start == 0 and not dropped
            masks[window] = None if plain else keep[None, None].to(device)
        row = first_row[id(chunk)]
        blocks = table[None, : -(-(start + n) // bs)]
        groups.append(
            AttentionGroup(
                slice(row, row + n), blocks.to(device), start + n, masks, 1, n, causal=not dropped,
                prompt=not chunk.num_draft,
            )
        )

    sample_rows = [
        row
        for c in chunks
        for row in range(first_row[id(c)] + c.num_tokens - c.num_logits, first_row[id(c)] + c.num_tokens)
    ]
    return PagedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.cat(slot_parts).to(device),
        groups=groups,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        max_position=max(positions),
        order=short + long,
    )


def lone_decode(
    chunk: ScheduledChunk, block_size: int, windows: Seq[int | None], device: torch.device
) -> PagedBatch | None:
    """The batch of a step that decodes one sequence's next token (one client), in five small tensors instead
    of ``build_paged_batch``'s fifty (about 0.5 ms at batch 1); None where a mask would be needed (a window
    shorter than the context, released KV), a draft or a longer chunk (the general path builds it).

    The result is the general path's: one group of one row reading every position before it, no mask."""
    start = chunk.start
    ctx = start + 1
    drop_start, drop_end = chunk.released
    if chunk.num_tokens != 1 or chunk.num_draft or drop_end > drop_start:
        return None
    if any(window is not None and ctx > window for window in windows):
        return None
    table = chunk.seq.block_table
    blocks = torch.tensor([table[: -(-ctx // block_size)]], dtype=torch.long)
    slot = table[start // block_size] * block_size + start % block_size
    group = AttentionGroup(slice(0, 1), blocks.to(device), ctx, dict.fromkeys(windows), 1, 1)
    return PagedBatch(
        input_ids=torch.tensor(chunk.token_ids, dtype=torch.long, device=device),
        positions=torch.tensor([start], dtype=torch.long, device=device),
        slot_mapping=torch.tensor([slot], dtype=torch.long, device=device),
        groups=[group],
        sample_rows=torch.tensor([0] if chunk.num_logits else [], dtype=torch.long, device=device),
        max_position=start,
        order=[chunk],
    )


def shared_prefix(
    table: torch.Tensor,
    min_ctx: int,
    keeps: dict[int | None, torch.Tensor],
    block_size: int,
    device: torch.device,
) -> SharedPrefix | None:
    """The leading blocks every row of a decode batch reads, where attending to them once pays.

    ``table`` holds the rows' block ids ``[batch, width]``, ``keeps`` the
    visibility of each key position per sliding window ``[batch, 1, ctx]``.
    The shared part must be whole blocks every row sees in full (no window or
    released range cuts into it) and leave each row at least its own token.
    """
    if table.shape[0] < 2:
        return None
    same = (table == table[0]).all(0).to(torch.int32)
    blocks = min(int(same.cumprod(0).sum()), (min_ctx - 1) // block_size)
    tokens = blocks * block_size
    if tokens < SHARED_PREFIX_MIN_TOKENS or not all(bool(keep[:, :, :tokens].all()) for keep in keeps.values()):
        return None
    ids = table[0, :blocks]
    first = int(ids[0])
    if bool((ids == torch.arange(first, first + blocks)).all()):  # consecutive blocks: the arena rows as they lie
        keys: slice | torch.Tensor = slice(first * block_size, (first + blocks) * block_size)
    else:
        keys = ids.to(device)
    own_keeps: dict[int | None, torch.Tensor | None] = {}
    for window, keep in keeps.items():
        own = keep[:, :, tokens:]
        own_keeps[window] = None if bool(own.all()) else own.reshape(own.shape[0], -1)
    return SharedPrefix(keys, tokens, own_keeps)


def additive_mask(keep: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """``keep: [batch, keys]`` as the additive mask ``[batch, 1, 1, keys]`` that torch's attention with
    log-sum-exp takes (it has no boolean form): 0 where visible, -inf elsewhere."""
    if keep is None:
        return None
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))
    return mask[:, None, None].to(device)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over ``[n, heads, len, head_dim]``; ``k``/``v`` may have fewer (grouped) heads.

    ``mask`` is boolean (True = attend) or additive. With ``softcap`` (Gemma 2's
    ``attn_logit_softcapping``) the scores pass through ``softcap * tanh(s / softcap)``
    first, which torch's fused kernels cannot do, so that case runs in plain math.
    """
    if softcap is None:
        grouped = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=grouped)  # fmt: skip
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        length = scores.shape[-1]
        mask = torch.ones(q.shape[-2], length, dtype=torch.bool, device=q.device).tril(length - q.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output ``[n, heads, q, d]`` and its float32 log-sum-exp ``[n, heads, q, 1]``; ``mask`` is additive.

    Two such partial results over disjoint key sets merge exactly into the
    attention over their union (``merge_attention``).
    """
    if q.device.type == "cpu" and softcap is None:  # torch's CPU flash kernel hands back the log-sum-exp it computes
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        return out, lse.unsqueeze(-1).float()
    return attention_with_lse_math(q, k, v, mask, scale, softcap)


def attention_with_lse_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_lse`` in plain float32 tensor math, for devices (or soft-capping) without a kernel."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, -1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v.float()).to(q.dtype), lse


def merge_attention(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """The attention over two disjoint key sets from each set's output and log-sum-exp."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return ((a.float() * weight_a + b.float() * weight_b) / (weight_a + weight_b)).to(a.dtype)


def lazy_zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose CPU memory is committed as it is first written: an anonymous memory map, which the
    kernel hands out as zero pages on first touch. The arena is sized for ``kv_cache.l1_capacity`` blocks, but a
    server holds in memory only the blocks its requests have used (as llama.cpp's KV buffer does), instead of
    writing zeros over all of it at load (``torch.zeros``: the whole pool resident from the start)."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    with warnings.catch_warnings():  # the map is writable; torch warns about buffers in general
        warnings.simplefilter("ignore")
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


class KVArena:
    """Every layer's keys and values in blocks: ``[num_blocks * block_size, kv_heads, head_dim]`` per layer.

    What the tiers move between steps is whole blocks, ``[n, layers, 2,
    block_size, kv_heads, head_dim]`` on the CPU (``read_blocks``/``write_blocks``).
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        own_kernels: bool = True,
    ) -> None:
        self.own_kernels = own_kernels  # decode attention through tierserve's CPU kernel (cpu_gemm) where it runs
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.block_size = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * block_size * self.kv_heads * self.head_dim * element

    def allocate(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks * block_size, self.kv_heads, self.head_dim)
        self.block_size = block_size
        self.k = [lazy_zeros(shape, self.device, self.dtype) for _ in range(self.layers)]
        self.v = [lazy_zeros(shape, self.device, self.dtype) for _ in range(self.layers)]

    def clear(self) -> None:
        self.k.clear()
        self.v.clear()

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """CPU copy ``[n, layers, 2, block_size, kv_heads, head_dim]`` of whole blocks."""
        bs = self.block_size
        shape = (-1, bs, self.kv_heads, self.head_dim)
        out = torch.empty(
            (len(block_ids), self.layers, 2, bs, self.kv_heads, self.head_dim),
            dtype=self.dtype,
            device="cpu",
            pin_memory=self.device.type == "cuda",
        )
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            out[:, layer, 0].copy_(k.view(shape).index_select(0, block_ids), non_blocking=True)
            out[:, layer, 1].copy_(v.view(shape).index_select(0, block_ids), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def write_blocks(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Copy ``[n, layers, 2, block_size, kv_heads, head_dim]`` into whole blocks."""
        shape = (-1, self.block_size, self.kv_heads, self.head_dim)
        data = data.to(device=self.device, dtype=self.dtype)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k.view(shape).index_copy_(0, block_ids, data[:, layer, 0])
            v.view(shape).index_copy_(0, block_ids, data[:, layer, 1])

    def move(self, block_table: list[int], sources: list[int], targets: list[int]) -> None:
        """Copy every layer's KV at token positions ``sources`` to ``targets`` of one sequence's table."""
        bs = self.block_size
        table = torch.tensor(block_table, dtype=torch.long)
        at = torch.tensor([*sources, *targets], dtype=torch.long)
        slots = (table[at // bs] * bs + at % bs).to(self.device)
        src, dst = slots[: len(sources)], slots[len(sources) :]
        for k, v in zip(self.k, self.v):
            k.index_copy_(0, dst, k.index_select(0, src))  # gathered first: a target may be a later source's slot
            v.index_copy_(0, dst, v.index_select(0, src))

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's new keys and values ``[T, kv_heads, head_dim]`` to arena rows ``slots``."""
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        groups: list[AttentionGroup],
        window: int | None,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of the batch's queries ``q: [T, heads, head_dim]`` through the groups' block tables."""
        k_cache, v_cache = self.k[layer], self.v[layer]
        heads, head_dim = q.shape[1], self.head_dim
        only = groups[0] if len(groups) == 1 else None
        # one group over all rows in order (a decode step, a lone prefill): its result is the output as it is
        direct = only is not None and isinstance(only.rows, slice) and only.rows == slice(0, q.shape[0])
        out = None if direct else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        by_block = (-1, self.block_size, self.kv_heads, head_dim)
        for group in groups:
            if group.q_len == 1:  # decodes: rows is a slice
                result = self._attend_decode(q[group.rows], k_cache, v_cache, group, window, scale, softcap)
                if direct:
                    return result
                out[group.rows] = result
                continue
            padded = isinstance(group.rows, torch.Tensor)
            if not padded and self.own_kernels and softcap is None:  # the CPU kernel reads blocks in place
                mask = None if window is None and group.causal else group.masks[window]
                # bfloat16 KV under float32 queries: a prompt's rows multiply in bfloat16; decode rows, drafts
                # and short prompt tails keep float32 queries, so speculation verifies as plain decode computes
                result = cpu_gemm.prefill_attention(
                    q[group.rows], k_cache, v_cache, group.blocks, self.block_size, group.ctx, mask, scale,
                    round_queries=group.prompt,
                )
                if result is not None:
                    if direct:
                        return result
                    out[group.rows] = result
                    continue
            if padded:
                queries = q[group.rows.clamp(min=0)].transpose(1, 2)  # [batch, heads, q_len, head_dim]
            else:
                queries = q[group.rows].view(group.batch, group.q_len, heads, head_dim).transpose(1, 2)
            ids = group.blocks.reshape(-1)
            shape = (group.batch, -1, self.kv_heads, head_dim)
            # [batch, kv_heads, ctx, head_dim]
            keys = k_cache.view(by_block).index_select(0, ids).view(shape)[:, : group.ctx].transpose(1, 2)
            values = v_cache.view(by_block).index_select(0, ids).view(shape)[:, : group.ctx].transpose(1, 2)
            if keys.dtype != queries.dtype:  # kv_cache.dtype narrower than the model's
                keys, values = keys.to(queries.dtype), values.to(queries.dtype)
            mask = group.masks[window]
            result = attention(queries, keys, values, mask, mask is None and group.q_len > 1, scale, softcap)
            result = result.transpose(1, 2)
            if direct:
                return result.reshape(-1, heads, head_dim)
            if padded:
                valid = group.rows >= 0
                out[group.rows[valid]] = result[valid]
            else:
                out[group.rows] = result.reshape(-1, heads, head_dim)
        return out

    def _attend_shared_in_place(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        window: int | None,
        scale: float,
    ) -> torch.Tensor | None:
        """A decode group with a shared prefix through the CPU kernels, both parts read from the arena in place:
        the prefix once with every row's queries as the rows of one sequence (the prefill kernel), each row's
        own blocks by the decode kernel; merged by log-sum-exp (as the fused decode does, to the bit). None
        where the kernels cannot run."""
        shared = group.shared
        bs = self.block_size
        prefix_blocks = shared.block_ids(bs)
        own_blocks = group.blocks[:, shared.tokens // bs :]
        own = cpu_gemm.decode_attention(
            q, k_cache, v_cache, own_blocks, bs, group.ctx - shared.tokens, shared.own_keeps[window], scale,
            with_lse=True,
        )  # fmt: skip
        if own is None:
            return None
        common = cpu_gemm.prefill_attention(
            q, k_cache, v_cache, prefix_blocks[None], bs, shared.tokens, None, scale, causal=False, with_lse=True
        )
        if common is None:
            return None
        (own_out, own_lse), (common_out, common_lse) = own, common
        return cpu_gemm.merge_attention(own_out, own_lse, common_out, common_lse)  # the fused decode's merge

    def _attend_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        window: int | None,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """One query token per sequence, ``q: [batch, heads, head_dim]``.

        The query heads that share a KV head become that head's query rows, so
        K and V are read once per KV head, never repeated. A prefix all rows
        share is attended once for the whole batch (every row's queries against
        one copy of its keys) and merged by log-sum-exp with each row's own part.
        """
        batch, kv_heads, head_dim = group.batch, self.kv_heads, self.head_dim
        heads = q.shape[1]
        if self.own_kernels and group.shared is None and softcap is None:  # the CPU kernel reads blocks in place
            out = cpu_gemm.decode_attention(
                q, k_cache, v_cache, group.blocks, self.block_size, group.ctx, group.masks[window], scale
            )
            if out is not None:
                return out
        shared = group.shared
        skip = 0 if shared is None else shared.tokens // self.block_size
        if self.own_kernels and shared is not None and softcap is None:
            found = self._attend_shared_in_place(q, k_cache, v_cache, group, window, scale)
            if found is not None:
                return found
        queries = q.view(batch, kv_heads, -1, head_dim)  # [batch, kv_heads, heads per kv head, head_dim]
        ids = group.blocks[:, skip:].reshape(-1)
        by_block = (-1, self.block_size, kv_heads, head_dim)
        shape = (batch, -1, kv_heads, head_dim)
        ctx = group.ctx - (0 if shared is None else shared.tokens)
        keys = k_cache.view(by_block).index_select(0, ids).view(shape)[:, :ctx].transpose(1, 2)
        values = v_cache.view(by_block).index_select(0, ids).view(shape)[:, :ctx].transpose(1, 2)
        if keys.dtype != queries.dtype:  # kv_cache.dtype narrower than the model's
            keys, values = keys.to(queries.dtype), values.to(queries.dtype)
        if shared is None:
            out = attention(queries, keys, values, group.masks[window], False, scale, softcap)
            return out.reshape(batch, heads, head_dim)
        own_mask = additive_mask(shared.own_keeps[window], queries.dtype, queries.device)
        own, own_lse = attention_with_lse(queries, keys, values, own_mask, scale, softcap)
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
            rows, prefix_k.transpose(0, 1)[None], prefix_v.transpose(0, 1)[None], None, scale, softcap
        )
        common = common.view(kv_heads, batch, -1, head_dim).transpose(0, 1)
        common_lse = common_lse.view(kv_heads, batch, -1, 1).transpose(0, 1)
        return merge_attention(own, own_lse, common, common_lse).reshape(batch, heads, head_dim)
