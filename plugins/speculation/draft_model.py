"""``draft_model``: a smaller checkpoint with the same tokenizer drafts k tokens ahead on its own paged KV."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tierserve.cache.block_pool import BlockPool
from tierserve.cache.kv_manager import KVCacheManager
from tierserve.core.batch import ScheduledChunk
from tierserve.core.errors import ConfigError
from tierserve.core.hookspecs import hookimpl
from tierserve.core.sequence import Sequence
from tierserve.core.speculation import Proposal, Speculator
from tierserve.plugins.eviction.lru import LRUPolicy


class DraftModelSettings(BaseModel):
    """``[plugins.draft_model]``: which checkpoint drafts."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="checkpoint directory or builtin:NAME; same tokenizer as the target")


class DraftModelSpeculator(Speculator):
    """Runs the draft model autoregressively for k steps over all speculating sequences at once.

    Each target sequence has a shadow sequence in the draft's own block pool.
    Before drafting, the shadow is brought in line with the target's history:
    positions after the first difference (rejected drafts, the target's own
    token) are forgotten and recomputed, so the draft's KV never goes stale.
    """

    def __init__(self, settings, target) -> None:
        super().__init__(settings, target)
        from tierserve.plugins.backends.native import NativeBackend

        path = settings.plugin_options("draft_model", DraftModelSettings).path
        if not path:
            raise ConfigError(
                "plugins.draft_model.path (formerly speculative.draft_model): set it to a checkpoint directory "
                "(or builtin:NAME) when [speculative] method is draft_model"
            )
        draft_settings = settings.model_copy(deep=True)
        draft_settings.model.path = path
        draft_settings.model.max_model_len = None
        self.draft = NativeBackend(draft_settings)
        if self.draft.vocab_size != target.vocab_size:
            raise ConfigError(
                f"plugins.draft_model.path: {path} has a vocabulary of {self.draft.vocab_size} tokens, "
                f"the target {target.vocab_size}; the draft must share the target's tokenizer"
            )
        block_size = settings.kv_cache.block_size
        num_blocks = settings.kv_cache.l1_capacity
        self.draft.allocate_kv_cache(num_blocks, block_size)
        self.kv = KVCacheManager(BlockPool(num_blocks, block_size, LRUPolicy(num_blocks)))
        self.shadows: dict[int, Sequence] = {}

    def _sync(self, seq: Sequence, history: list[int]) -> Sequence:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Sequence(
                seq_id=seq.seq_id, request_id=seq.request_id, token_ids=[], num_prompt_tokens=0, params=seq.params
            )
        common = 0
        limit = min(shadow.num_computed_tokens, len(history))
        while common < limit and shadow.token_ids[common] == history[common]:
            common += 1
        shadow.token_ids = list(history)
        shadow.num_computed_tokens = common
        self.kv.trim(shadow, common)
        return shadow

    def propose(self, requests):
        import torch

        from tierserve.core.sampler import SamplingRow, draw, filtered_probs

        seqs = [r.seq for r in requests]
        num_tokens = [r.num_tokens for r in requests]
        shadows = [self._sync(r.seq, r.token_ids) for r in requests]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = list(range(len(seqs)))
        for step in range(max(num_tokens)):
            live = [i for i in live if step < num_tokens[i]]
            chunks, owners = [], []
            for i in live:
                shadow = shadows[i]
                if self.kv.allocate_slots(shadow, shadow.num_tokens):
                    chunks.append(ScheduledChunk(shadow, shadow.num_uncomputed_tokens))
                    owners.append(i)
            if not chunks:
                break
            with torch.inference_mode():
                logits = self.draft.forward(chunks)
            for chunk, i, row in zip(chunks, owners, logits):
                seq, shadow = seqs[i], shadows[i]
                shadow.num_computed_tokens += chunk.num_tokens
                if seq.params.greedy:
                    token = int(row.argmax())
                else:
                    sampling = SamplingRow(seq.params, seq.generator, [], [])
                    distribution = filtered_probs(row[None].float(), [sampling])[0]
                    distribution = distribution / distribution.sum()
                    token = int(draw(distribution[None], [sampling])[0])
                    probs[i].append(distribution)
                shadow.token_ids.append(token)
                drafts[i].append(token)
            live = owners
        return [
            Proposal(drafts[i], torch.stack(probs[i]) if probs[i] else None)
            for i in range(len(seqs))
        ]

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def close(self) -> None:
        for shadow in self.shadows.values():
            self.kv.free(shadow)
        self.shadows.clear()
        self.draft.close()


@hookimpl
def register_speculators(register):
    register(
        "draft_model",
        DraftModelSpeculator,
        settings=DraftModelSettings,
        aliases={"speculative.draft_model": "path"},
        description="a smaller checkpoint with the same tokenizer drafts k tokens",
    )
