"""A request in flight: token ids, sampling parameters, block table and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tierserve.cache.warm_writes import WarmWrites
    from tierserve.core.outputs import RequestCacheInfo, TokenLogprob
    from tierserve.core.speculation import Proposal


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # client gone or cancelled


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation: the prompt, what was generated, and where its KV lives.

    ``num_computed_tokens`` counts tokens whose KV is in the arena; the
    scheduler brings it up to ``num_tokens`` (prefill, possibly in chunks),
    after which each step adds one sampled token (decode). Speculative drafts
    for the next step wait in ``spec_token_ids``, apart from ``token_ids``,
    until verification accepts them.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    cache_salt: str | None = None  # the tenant's salt, with the LoRA adapter's fingerprint when one runs
    lora_name: str | None = None  # the LoRA adapter this sequence runs with (None: the base model)
    grammar: Any = None  # its llguidance matcher when params.grammar constrains the output
    use_prefix_cache: bool = True  # False: neither reuse cached blocks nor publish this sequence's
    first_scheduled_time: float | None = None
    cache_lookup_seconds: float = 0.0
    peak_blocks: int = 0
    spec_method: str | None = None  # the speculator proposing drafts while it decodes (None: no speculation)
    spec_k: int = 0  # current number of drafts per step (adapts to acceptance)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify at the next step
    spec_proposal: Proposal | None = None  # where the drafts came from (their distributions)
    accepted_drafts: int = 0
    cache_info: RequestCacheInfo | None = None  # the latest prefix lookup's accounting
    cache_info_pending: bool = False  # a lookup ran since the last CoreOutput
    # KV positions in [kv_drop_start, kv_drop_end) were dropped (sliding window): their blocks
    # are released (block table entries point at a placeholder) and attention skips them
    kv_drop_start: int = 0
    kv_drop_end: int = 0
    released_blocks: tuple[int, int] = (0, 0)  # block-table entries [first, end) released (placeholders)
    streaming: bool = False  # opt-in long-sequence mode: sink tokens + the last window_size tokens
    window_size: int | None = None  # the request's own window in streaming mode (None: [sliding_window]'s)
    warm_writes: WarmWrites | None = None  # a prompt warm's: its write-through waits for room and is counted
    windows_slid: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_registered_blocks: int = 0  # leading full blocks already published to the prefix cache
    blocks_wanted: int = 0  # free blocks its last admission lacked (a waiting prompt is not looked up before)
    kv_load: Any = None  # a waiting prompt's read of its prefix below L1 (KVCacheManager.prefix_loaded)
    # params.prompt_logprobs: those of prompt tokens 1, 2, ... computed so far (entry i from position i's logits)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt positions still lack the logits its ``prompt_logprobs`` ask for."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether a lookup may start it from cached blocks: not while its prompt needs logits, which a cached
        block does not keep (it recomputes them, as vLLM does; its own blocks are still published)."""
        return self.use_prefix_cache and not self.needs_prompt_logits
