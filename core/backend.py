"""The model backend interface: what the engine needs from a model, whatever runs it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from tierserve.cache.kv_manager import KVSpec
from tierserve.core.batch import ScheduledChunk
from tierserve.core.sequence import Sequence

if TYPE_CHECKING:  # torch loads with the backend, not with the plugin list
    import torch


class ModelBackend(ABC):
    """A loaded checkpoint that runs one engine step at a time.

    The engine calls, in this order: ``kv_spec`` and ``allocate_kv_cache``
    once (paged backends), then per step ``forward`` over the scheduled
    chunks, and ``release`` whenever a sequence leaves the running set. The
    tiered cache moves whole blocks with ``read_blocks``/``write_blocks``
    between steps. Everything runs on the engine core's thread.

    Attributes set by implementations:
        tokenizer: the checkpoint's Hugging Face tokenizer (chat template included).
        eos_token_ids: ids that end generation (config + generation_config).
        max_model_len: longest prompt + output the model accepts.
        vocab_size: width of the logits.
        device, dtype: where and how it computes.
        fingerprint: identifies the weights, dtype and backend; cache keys
            include it so KV is never shared across models.
        paged: True if the backend keeps KV in the engine's block arena
            (block tables matter); False if it keeps its own per-sequence cache.
        supports_released_kv: True if ``forward`` honours ``chunk.released``
            (key positions a sliding window freed), so streaming mode can run.
        attention_kernel: which attention kernels run, in words (``ModelInfo``,
            ``/health``); built-in backends follow ``[sliding_window] use_flash_attention``.
        quantization: how the weights are stored (``model.quantization``: ``"none"``, ``"int8"``).
        supports_lora: ``load_lora`` runs adapters (per request, mixed in one batch).
        linear_kernel: what runs the dense matmuls, in words (``"onednn"``, ``"int8-fbgemm"``, ...).
        kv_dtype: how the KV arena holds keys and values (``kv_cache.dtype``; the model's dtype by default).
        backend_name: the name the backend was registered under; the engine builder sets it
            (with ``model.backend = "auto"`` it is the backend auto chose).
        supports_token_trees: ``forward`` honours ``chunk.tree_parents`` (tree attention) and ``move_kv``
            works, so tree speculators may run.
        supports_hidden_states: with ``keep_hidden_states`` set, ``forward`` leaves the final hidden
            states (after the last norm) of its logits rows in ``last_hidden_states`` (Medusa heads read them).
    """

    tokenizer: object
    eos_token_ids: frozenset[int]
    max_model_len: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    fingerprint: str
    paged: bool = True
    supports_released_kv: bool = False
    attention_kernel: str = "unreported"
    quantization: str = "none"
    linear_kernel: str = "unreported"
    kv_dtype: torch.dtype | None = None
    backend_name: str = "unnamed"  # the registered name it was built under (set by the engine builder)
    supports_lora: bool = False  # load_lora works (model.max_loras > 0 is refused at load otherwise)
    supports_token_trees: bool = False
    supports_hidden_states: bool = False
    keep_hidden_states: bool = False  # set by the engine builder when a speculator reads hidden states
    last_hidden_states: torch.Tensor | None = None

    def kv_spec(self, block_size: int) -> KVSpec:
        """The KV layout the engine's KV manager needs: bytes per block, and a trained sliding
        window that every layer obeys (its older blocks are released), if there is one."""
        return KVSpec(self.kv_bytes_per_block(block_size))

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of ``block_size`` tokens takes across all layers (0 if not paged)."""
        return 0

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Preallocate the arena for ``num_blocks`` blocks (paged backends)."""

    @abstractmethod
    def forward(self, chunks: Seq[ScheduledChunk]) -> torch.Tensor:
        """Run the model over every scheduled chunk and return next-token logits.

        Chunk ``c`` feeds ``c.token_ids`` (the sequence's own tokens, then
        ``c.num_draft`` speculative drafts) at positions ``c.start,
        c.start + 1, ...``. A paged backend writes their KV to the slots
        ``block_table[p // block_size] * block_size + p % block_size`` of
        ``c.seq.block_table`` (already allocated) and attends causally to
        positions ``0 .. p`` through that table, skipping ``c.released``
        (and, per layer, what its own sliding window excludes). Chunks are
        independent sequences: a chunk never attends to another's tokens.

        Returns a float tensor of ``c.num_logits`` rows per chunk, in chunk
        order: the logits after each of its last ``c.num_logits`` tokens (for
        a chunk that samples, its last ``num_draft + 1``; a prompt whose
        log-probabilities are asked for adds rows before those, at most
        ``PROMPT_LOGITS_PER_STEP`` in a step, ``core.scheduler``'s bound).
        """

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """CPU copy of whole arena blocks, ``[n, layers, 2, block_size, kv_heads, head_dim]``
        (paged backends; this is what the cache tiers store, and, with ``write_blocks``, how L1 copies a
        block a prompt shares in part: a backend that keeps the default reuses whole blocks only)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no paged KV arena")

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Copy ``data`` (as ``read_blocks`` returns it) into arena blocks (paged backends)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no paged KV arena")

    def move_kv(self, block_table: list[int], sources: list[int], targets: list[int]) -> None:
        """Copy every layer's keys and values at token positions ``sources`` of a sequence (through its
        ``block_table``) to positions ``targets`` (a tree's accepted path into consecutive slots)."""
        raise NotImplementedError(f"{type(self).__name__} cannot move KV between slots (no token trees)")

    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Embedding vectors: each input's final hidden states (after the model's final norm),
        mean-pooled over all its tokens and L2-normalised.

        Each input attends only to itself; nothing is read from or written to
        the KV arena or any per-sequence cache. Returns float32 ``[n, hidden_size]``.
        """
        raise NotImplementedError(
            f"the {type(self).__name__} backend cannot compute embeddings; "
            "serve the model with model.backend = \"native\" or \"transformers\""
        )

    def load_lora(self, name: str, path: str) -> dict[str, object]:
        """Load a PEFT LoRA adapter into a free slot, named ``name`` (requests naming it in
        ``Sequence.lora_name`` run with it); returns what ``/v1/models`` shows of it (``rank``,
        ``modules``, ``fingerprint``, which goes into its requests' cache keys).

        Raises ``RequestError``: LoRA off (``model.max_loras = 0``), no free slot, a rank over
        ``model.max_lora_rank``, or an unreadable or unsupported adapter. Backends without
        LoRA support keep this default.
        """
        from tierserve.core.errors import RequestError

        raise RequestError(
            f"lora_name: the {self.backend_name} backend runs no LoRA adapters; serve the model with "
            "model.backend = \"native\" (Llama, Mistral, Qwen2, Qwen3)",
            param="lora_name",
        )

    def unload_lora(self, name: str) -> None:
        """Free an adapter's slot (the engine calls this once no sequence uses it)."""

    def release(self, seq: Sequence) -> None:
        """Forget per-sequence state (finished, aborted or preempted; a preempted sequence
        comes back later from position 0)."""

    def close(self) -> None:
        """Release the model and arena memory."""


def kernel_variant(backend: str, linear_kernel: str, forced_attention, dtype, kv_dtype) -> str:
    """How a paged backend computes, as its fingerprint names it: e.g. ``native/onednn``,
    ``transformers-paged/int8-fbgemm/MATH/kv-bfloat16``.

    Kernels change summation order, so KV is not bit-identical across them: the
    matmul kernel, a forced attention kernel (torch's own choice adds nothing)
    and a KV dtype narrower than the weights' (the KV itself is rounded
    differently) are all named.
    """
    variant = f"{backend}/{linear_kernel}" + "".join(f"/{kernel.name}" for kernel in forced_attention)
    if kv_dtype != dtype:
        variant += f"/kv-{str(kv_dtype).removeprefix('torch.')}"
    return variant
