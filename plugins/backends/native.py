"""The ``native`` backend: Llama-family checkpoints on tierserve's paged KV arena."""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from tierserve.cache.kv_manager import KVSpec
from tierserve.core.backend import ModelBackend, checkpoint_fingerprint
from tierserve.core.batch import ScheduledChunk
from tierserve.core.config import Settings
from tierserve.core.hookspecs import hookimpl

# torch, transformers and the model load when a backend is built, so listing
# plugins or validating settings stays fast.
if TYPE_CHECKING:
    import torch

    from tierserve.plugins.backends.llama import PagedBatch, SharedPrefix


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


SHORT_CHUNK_TOKENS = 16  # chunks this short share one padded attention call
# a decode batch reads a prefix its sequences share once, when it is at least this long
SHARED_PREFIX_MIN_TOKENS = 64


def shared_prefix(
    table: torch.Tensor,
    min_ctx: int,
    keeps: dict[int | None, torch.Tensor],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> SharedPrefix | None:
    """The leading blocks every row of a decode batch reads, where attending to them once pays.

    ``table`` holds the rows' block ids ``[batch, width]``, ``keeps`` the
    visibility of each key position per sliding window ``[batch, 1, ctx]``.
    The shared part must be whole blocks every row sees in full (no window or
    released range cuts into it) and leave each row at least its own token.
    """
    import torch

    from tierserve.plugins.backends.llama import SharedPrefix

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
    own_masks: dict[int | None, torch.Tensor | None] = {}
    for window, keep in keeps.items():
        own = keep[:, :, tokens:]
        # additive: the kernel that also returns log-sum-exp takes no boolean mask
        own_masks[window] = None if bool(own.all()) else torch.zeros(own.shape, dtype=dtype).masked_fill_(
            ~own, float("-inf")
        )[:, None].to(device)
    return SharedPrefix(keys, tokens, own_masks)


class NativeSettings(BaseModel):
    """``[plugins.native]``: how the native backend runs."""

    model_config = ConfigDict(extra="forbid")

    linear_kernel: Literal["auto", "onednn", "torch"] = Field(
        "auto", description="dense matmuls: oneDNN prepacked weights on CPU (auto), or torch's F.linear"
    )


class NativeBackend(ModelBackend):
    """Loads a Hugging Face Llama/Mistral/Qwen2/Qwen3 directory and runs it paged."""

    paged = True
    supports_released_kv = True

    def __init__(self, settings: Settings) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from tierserve.core.attention import attention_kernel
        from tierserve.core.checkpoints import context_length, load_generation_eos_ids, resolve_model_path
        from tierserve.core.devices import resolve_device, resolve_dtype
        from tierserve.plugins.backends.llama import PagedLlama

        model = settings.model
        self.path = resolve_model_path(model.path)
        self.device = resolve_device(model.device)
        self.dtype = resolve_dtype(model.dtype, self.device)
        kv_dtype = self.dtype if settings.kv_cache.dtype == "auto" else resolve_dtype(settings.kv_cache.dtype, self.device)
        self.attention = attention_kernel(settings.sliding_window.use_flash_attention, self.device)
        self.attention_kernel = self.attention.name
        self.config = AutoConfig.from_pretrained(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = PagedLlama(
            self.config,
            load_safetensors(self.path),
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
        eos = load_generation_eos_ids(self.path)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # kernels change summation order, so KV is not bit-identical across kernels
        # (a forced attention kernel is named; torch's own choice keeps the fingerprint it always had)
        kernels = f"native/{self.model.linear_kernel}" + "".join(f"/{k.name}" for k in self.attention.forced)
        if kv_dtype != self.dtype:  # the KV itself is rounded differently (int8 is in the kernel's name)
            kernels += f"/kv-{str(kv_dtype).removeprefix('torch.')}"
        self.fingerprint = checkpoint_fingerprint(self.path, str(self.dtype), kernels)
        self.block_size = settings.kv_cache.block_size

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
        return self.model.read_blocks(ids, self.block_size)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        import torch

        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.model.write_blocks(ids, self.block_size, data)

    def forward(self, chunks: Seq[ScheduledChunk]) -> torch.Tensor:
        import torch

        with torch.inference_mode(), self.attention.scope():
            return self.model.forward(self._build_batch(chunks))

    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        with torch.inference_mode(), self.attention.scope():
            sequences = [torch.tensor(ids, dtype=torch.long) for ids in token_ids]
            hidden = self.model.final_hidden_states(sequences)
            return F.normalize(torch.stack([h.float().mean(0) for h in hidden]), dim=-1)

    def _build_batch(self, chunks: Seq[ScheduledChunk]) -> PagedBatch:
        """Flatten the step's tokens; short chunks (decodes, draft verification, the last few
        prompt tokens after a prefix hit) attend in one padded batch, long prefills one by one."""
        import torch

        from tierserve.plugins.backends.llama import AttentionGroup, PagedBatch

        device, bs = self.device, self.block_size
        short = [c for c in chunks if c.num_tokens <= SHORT_CHUNK_TOKENS]
        short_ids = {id(c) for c in short}
        long = [c for c in chunks if id(c) not in short_ids]

        input_ids: list[int] = []
        positions: list[int] = []
        first_row: dict[int, int] = {}
        for chunk in short + long:
            start = chunk.start
            first_row[id(chunk)] = len(input_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, start + chunk.num_tokens))
        groups: list[AttentionGroup] = []
        slot_parts: list[torch.Tensor] = []
        windows = self.model.windows

        if short:
            tables = [c.seq.block_table for c in short]
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            starts = torch.tensor([c.start for c in short], dtype=torch.long)
            lengths = torch.tensor([c.num_tokens for c in short], dtype=torch.long)
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
            released = torch.tensor([c.released for c in short])
            drop_start, drop_end = released[:, 0, None, None], released[:, 1, None, None]
            causal &= (pos[None, None, :] < drop_start) | (pos[None, None, :] >= drop_end)  # released by a window
            keeps = {
                window: causal if window is None else causal & (pos[None, None, :] > q_pos[:, :, None] - window)
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
            rows = torch.where(
                q_valid, torch.tensor([first_row[id(c)] for c in short])[:, None] + offsets[None, :], -1
            )
            rows_index = slice(0, len(short)) if q_len == 1 else rows.to(device)
            blocks = table[:, : -(-int(ctx.max()) // bs)]
            group = AttentionGroup(rows_index, blocks.to(device), int(ctx.max()), masks, len(short), q_len)
            if q_len == 1:
                group.shared = shared_prefix(table, int(ctx.min()), keeps, bs, self.dtype, device)
            groups.append(group)

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
            groups.append(AttentionGroup(slice(row, row + n), blocks.to(device), start + n, masks, 1, n))

        self.model.ensure_positions(max(positions) + 1)
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
        )

    def close(self) -> None:
        self.model.k_cache.clear()
        self.model.v_cache.clear()


@hookimpl
def register_backends(register):
    register(
        "native",
        NativeBackend,
        settings=NativeSettings,
        aliases={"model.linear_kernel": "linear_kernel"},
        description="Llama/Mistral/Qwen2/Qwen3 on the paged KV arena (fast path)",
    )
