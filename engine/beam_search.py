"""Beam search on the paged KV arena: beams fork by sharing blocks, and copy a shared partial block on write.

The selection rules are transformers' ``GenerationMixin._beam_search`` (5.24),
replayed step for step on the backend's logits, so the result equals
``generate(num_beams=k, do_sample=False, ...)`` wherever the logits agree.

    prompt      [p0][p1][p2··]        p2 is partial; after the fork every beam holds p0, p1, p2
    beam 0      [p0][p1][c0···]       p2 ref_count 3 > 1: copy it to c0, then write
    beam 1      [p0][p1][c1···]       p2 ref_count 2 > 1: copy it to c1, then write
    beam 2      [p0][p1][p2···]       p2 ref_count 1: the last holder writes in place

The prompt is looked up in the prefix cache like any request's: its cached
blocks are shared (or promoted from a lower tier, read off the step thread
first), only the rest is prefilled, and the full prompt blocks it computes are
published for later requests. The beams' own blocks are never published.

A search (``BeamSearch``) runs in slices between the engine core's steps, one
forward each (a prefill chunk, or the beams' next token): running
generations keep decoding while it runs, and a search whose client left is
cancelled at its next slice, its blocks freed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tierserve.core.batch import ScheduledChunk
from tierserve.core.errors import RequestError
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.scheduler import QueueFullError
from tierserve.core.sequence import Sequence

if TYPE_CHECKING:
    from tierserve.cache.kv_manager import KVCacheManager
    from tierserve.cache.lookup_info import RequestCacheInfo
    from tierserve.core.backend import ModelBackend

# transformers marks impossible candidates by adding this, not -inf; the same constant keeps ties and order identical.
_NEG = -1.0e9


@dataclass(slots=True)
class BeamSearchParams:
    """What a beam request asks for; the names follow transformers' ``generate`` where they differ.

    ``max_tokens`` is ``max_new_tokens``, ``min_tokens`` is ``min_new_tokens``
    (eos is suppressed until that many tokens exist), ``beam_width`` is ``num_beams``.
    ``length_penalty`` divides a finished hypothesis' summed log-probability by
    (generated tokens, eos included) ** ``length_penalty``. ``early_stopping``:
    ``True`` stops once ``beam_width`` hypotheses are finished; ``False`` stops
    when the best running beam, scored at its current length, cannot beat the
    worst finished one; ``"never"`` scores it at ``max_tokens`` instead (when
    ``length_penalty > 0``).
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    min_tokens: int = 0

    MAX_BEAM_WIDTH = 16
    MAX_LENGTH_PENALTY = 10.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``RequestError`` (a ``ValueError``) ``"field: got ..., allowed: ..."`` for any value out of range."""

        def bad(name: str, allowed: str) -> RequestError:
            return RequestError(f"{name}: got {getattr(self, name)!r}, allowed: {allowed}", param=name)

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= self.MAX_BEAM_WIDTH:
            raise bad("beam_width", f"1 to {self.MAX_BEAM_WIDTH}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if (
            isinstance(self.length_penalty, bool)
            or not isinstance(self.length_penalty, (int, float))
            or not -self.MAX_LENGTH_PENALTY <= self.length_penalty <= self.MAX_LENGTH_PENALTY
        ):
            # length ** penalty must stay a float: a huge exponent overflows (found by the API fuzzer)
            raise bad(
                "length_penalty",
                f"-{self.MAX_LENGTH_PENALTY} to {self.MAX_LENGTH_PENALTY} (1 = average log-probability per token, 0 = none)",
            )
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise bad("early_stopping", 'true, false or "never"')
        if not is_int(self.num_return_sequences) or not 1 <= self.num_return_sequences <= self.beam_width:
            raise bad("num_return_sequences", f"1 to beam_width ({self.beam_width})")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"0 to max_tokens ({self.max_tokens})")


@dataclass(slots=True)
class BeamResult:
    """One returned hypothesis: generated ids (eos included), its length-penalised score, and why it ended.

    ``score`` is what transformers reports as ``sequences_scores``: the summed
    log-probability divided by ``len(token_ids) ** length_penalty``.
    ``finish_reason`` is ``"stop"`` when the last token is an eos, else ``"length"``.
    """

    token_ids: list[int]
    score: float
    finish_reason: str


@dataclass(slots=True)
class BeamSearchOutput:
    """A finished search: the hypotheses (best first) and what it cost.

    ``peak_blocks`` is the most KV blocks the search held at once (measured at
    every forward); ``seconds`` the wall time from prefill to the last step.
    ``cache`` is the prompt's prefix lookup (cached tokens, blocks per tier);
    ``steps`` how many tokens each beam generated; ``stopped_early`` that the
    search ended before ``max_tokens`` steps because no running beam could beat
    the finished hypotheses any more (or, ``early_stopping=True``,
    ``beam_width`` of them had finished).
    """

    hypotheses: list[BeamResult]
    peak_blocks: int = 0
    seconds: float = 0.0
    cache: RequestCacheInfo | None = None
    steps: int = 0
    stopped_early: bool = False


def beam_search_blocks(prompt_len: int, params: BeamSearchParams, block_size: int) -> int:
    """The most KV blocks a search can hold at once.

    Full prompt blocks are shared by every beam; each beam owns at most the
    rest of the blocks of ``prompt_len + max_tokens - 1`` tokens (the last
    token is returned, never fed back).
    """
    shared = prompt_len // block_size
    per_beam = -(-(prompt_len + params.max_tokens - 1) // block_size) - shared
    return shared + params.beam_width * per_beam


class BeamSearch:
    """Beam-search ``prompt_ids`` on a paged backend and the scheduler's KV manager, one forward at a time.

    The engine core advances it between its steps (``EngineCore.beam_search`` hands the loop a busy
    ``Deferred``), so running generations keep decoding while a search runs, and ``cancel`` (its client left)
    ends it at the next slice. Every block it takes is freed when it finishes, fails or is cancelled.

    Args:
        backend: a paged backend.
        kv: the KV manager the scheduler uses.
        prompt_ids: the prompt, at least one token.
        params: the request.
        eos_token_ids: tokens that finish a hypothesis (transformers' ``eos_token_id``).
        prefill_budget: tokens per prefill forward (the scheduler's token budget).
        new_seq_id: hands out sequence ids, so a backend keyed by id never confuses a beam with a request.
        cache_salt: the request's cache scope (tenant and ``cache_salt``), as a request's ``Sequence`` has it.
        use_prefix_cache: False: the prompt neither reuses cached blocks nor publishes its own.

    Raises:
        QueueFullError: fewer free blocks than the search may need (running requests hold them); also from
            ``advance`` when requests that arrived since took the blocks it needs next.
    """

    def __init__(
        self,
        backend: ModelBackend,
        kv: KVCacheManager,
        prompt_ids: Seq[int],
        params: BeamSearchParams,
        eos_token_ids: Collection[int],
        *,
        prefill_budget: int,
        new_seq_id: Callable[[], int],
        cache_salt: str | None = None,
        use_prefix_cache: bool = True,
    ) -> None:
        self.started = time.perf_counter()
        if not prompt_ids:
            raise RequestError("prompt: must contain at least one token", param="prompt")
        needed = beam_search_blocks(len(prompt_ids), params, kv.block_size)
        if needed > kv.num_free_blocks:
            raise QueueFullError(
                f"beam_width: {params.beam_width} beams over prompt ({len(prompt_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) may need {needed} KV blocks and {kv.num_free_blocks} are free "
                "now; retry later, or lower beam_width or max_tokens"
            )
        self.params = params
        self.scorer = _BeamScorer(params, eos_token_ids)
        self.beams = _ArenaBeams(backend, kv, params, prefill_budget, new_seq_id)
        self.beams.start(list(prompt_ids), cache_salt, use_prefix_cache)
        self.logits: torch.Tensor | None = None  # the running beams' next-token logits, once prefilled
        self.output: BeamSearchOutput | None = None
        self.cancelled = False

    @property
    def loading(self) -> bool:
        """The prompt waits for its cached prefix to be read below L1 (a slice does nothing meanwhile)."""
        return not self.beams.admitted and not self.cancelled

    def advance(self) -> bool:
        """One slice: the prompt's prefix lookup once its blocks below L1 are read, a prefill chunk, or a
        scoring step and the beams' forward. True once the search is over (finished, cancelled or failed:
        ``result`` then answers)."""
        if self.output is not None or self.cancelled:
            return True
        try:
            if not self.beams.admitted:
                self.beams.admit()
                return False
            if self.logits is None:
                logits = self.beams.prefill_chunk()
                if logits is not None:
                    self.logits = logits.expand(self.params.beam_width, -1)
                return False
            parents, tokens, done = self.scorer.step(self.logits)
            if done:
                hypotheses = self.scorer.results()[: self.params.num_return_sequences]
                steps = self.scorer.num_generated
                self.output = BeamSearchOutput(
                    hypotheses, self.beams.peak_blocks, time.perf_counter() - self.started, self.beams.cache,
                    steps, steps < self.params.max_tokens,
                )  # fmt: skip
                self.beams.release()
                return True
            self.beams.fork(parents, tokens)
            self.logits = self.beams.forward()
            return False
        except BaseException:
            self.beams.release()
            raise

    def run(self) -> BeamSearchOutput:
        """The whole search, slice after slice, here (a caller that owns the core's thread)."""
        while not self.advance():
            pass
        return self.result()

    def cancel(self) -> None:
        """Stop at once and free the blocks (its client left)."""
        self.cancelled = True
        self.beams.release()

    def result(self) -> BeamSearchOutput:
        """The best hypotheses, best first, with the search's peak KV blocks and its wall time.

        Raises:
            RequestError: the search was cancelled."""
        if self.output is None:
            raise RequestError("beam_width: the beam search was cancelled (its client left)", param="beam_width")
        return self.output


class _BeamScorer:
    """transformers' beam bookkeeping for one prompt (batch size 1), on the logits of ``beam_width`` running beams.

    Line references are to transformers 5.24 ``generation/utils.py``.
    """

    def __init__(self, params: BeamSearchParams, eos_token_ids: Collection[int]) -> None:
        k = params.beam_width
        self.k = k
        self.max_tokens = params.max_tokens
        self.min_tokens = params.min_tokens
        self.length_penalty = params.length_penalty
        # generate(num_beams=1) is greedy search, which ignores early_stopping; beam search with one
        # beam and early_stopping False picks the same tokens.
        self.early_stopping = params.early_stopping if k > 1 else False
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.keep = max(2, 1 + len(self.eos)) * k  # beams_to_keep (l. 3647)
        self.top_k_mask = torch.arange(self.keep) < k  # top_num_beam_mask
        self.num_generated = 0  # cur_len - decoder_prompt_len
        self.running_scores = torch.full((k,), _NEG, dtype=torch.float32)
        self.running_scores[0] = 0.0  # only the first copy of the prompt proposes tokens (l. 3694)
        self.running_tokens: list[list[int]] = [[] for _ in range(k)]
        self.finished_scores = torch.full((k,), _NEG, dtype=torch.float32)
        self.finished_tokens: list[list[int]] = [[] for _ in range(k)]
        self.is_finished = torch.zeros(k, dtype=torch.bool)
        self.improvable = torch.tensor(True)  # is_early_stop_heuristic_unsatisfied

    def step(self, logits: torch.Tensor) -> tuple[list[int], list[int], bool]:
        """Score ``[beam_width, vocab]`` next-token logits of the running beams.

        Returns ``(parents, tokens, done)``: the running beams of the next step
        are ``running[parents[i]] + [tokens[i]]``, best first; ``done`` says the
        search is over (then nothing needs computing for them).
        """
        log_probs = torch.log_softmax(logits.to(device="cpu", dtype=torch.float32), dim=-1)
        if self.num_generated < self.min_tokens and len(self.eos):
            # MinNewTokensLengthLogitsProcessor, applied to log-probabilities as generate does (l. 3749-3750)
            log_probs = torch.where(torch.isin(torch.arange(log_probs.shape[-1]), self.eos), -math.inf, log_probs)
        vocab = log_probs.shape[-1]
        log_probs = (log_probs + self.running_scores[:, None]).reshape(-1)

        # _get_top_k_continuations (l. 3444)
        top_scores, top_indices = torch.topk(log_probs, k=self.keep)
        parents = top_indices // vocab
        tokens = top_indices % vocab
        generated = self.num_generated + 1
        candidates = [self.running_tokens[p] + [t] for p, t in zip(parents.tolist(), tokens.tolist())]
        # EosTokenCriteria and MaxLengthCriteria on each candidate
        hits = torch.isin(tokens, self.eos) | (generated >= self.max_tokens)

        # _get_running_beams_for_next_iteration (l. 3501)
        running_log_probs = top_scores + hits.to(torch.float32) * _NEG
        next_indices = torch.topk(running_log_probs, k=self.k)[1]
        next_scores = running_log_probs[next_indices]

        # _update_finished_beams (l. 3523), with the heuristic of the previous step
        just_finished = hits & self.top_k_mask
        finished_scores = top_scores / (generated**self.length_penalty)
        full = self.is_finished.all() & (self.early_stopping is True)
        finished_scores += full.to(torch.float32) * _NEG
        finished_scores += (~self.improvable).to(torch.float32) * _NEG
        finished_scores += (~just_finished) * _NEG
        merged_scores = torch.cat((self.finished_scores, finished_scores))
        merged_tokens = self.finished_tokens + candidates
        merged_finished = torch.cat((self.is_finished, just_finished))
        keep = torch.topk(merged_scores, k=self.k)[1]
        self.finished_scores = merged_scores[keep]
        self.finished_tokens = [merged_tokens[i] for i in keep.tolist()]
        self.is_finished = merged_finished[keep]

        self.running_scores = next_scores
        self.running_tokens = [candidates[i] for i in next_indices.tolist()]
        self.num_generated = generated

        # _check_early_stop_heuristic (l. 3375)
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = generated
        best_running = self.running_scores[:1] / (best_length**self.length_penalty)
        worst_finished = torch.where(self.is_finished, torch.min(self.finished_scores), _NEG)
        self.improvable = self.improvable & torch.any(best_running > worst_finished)

        # _beam_search_has_unfinished_sequences (l. 3422)
        all_done = bool(self.is_finished.all()) and self.early_stopping is True
        done = not bool(self.improvable) or all_done or bool(hits.all())
        return parents[next_indices].tolist(), tokens[next_indices].tolist(), done

    def results(self) -> list[BeamResult]:
        """The finished hypotheses, best first (generate's ``sequences[:num_return_sequences]``)."""
        eos = set(self.eos.tolist())
        return [
            BeamResult(tokens, float(score), "stop" if tokens and tokens[-1] in eos else "length")
            for tokens, score in zip(self.finished_tokens, self.finished_scores.tolist())
        ]


class _ArenaBeams:
    """The running beams as private sequences on the arena: one prefill, then forks and one forward per step.

    Every beam holds one reference to each block of its table; the sequences
    never enter the scheduler.
    """

    def __init__(
        self,
        backend: ModelBackend,
        kv: KVCacheManager,
        params: BeamSearchParams,
        prefill_budget: int,
        new_seq_id: Callable[[], int],
    ) -> None:
        self.backend = backend
        self.kv = kv
        self.pool = kv.pool
        self.prefill_budget = prefill_budget
        self.new_seq_id = new_seq_id
        self.width = params.beam_width
        self.params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
        self.running: list[Sequence] = []
        self.peak_blocks = 0  # the most blocks the beams held at once
        self.admitted = False  # the prompt holds its blocks: its cached prefix shared, the rest allocated
        self.cache: RequestCacheInfo | None = None  # the prompt's prefix lookup

    def _sequence(self, token_ids: list[int], num_prompt_tokens: int) -> Sequence:
        seq_id = self.new_seq_id()
        return Sequence(seq_id, f"beam-{seq_id}", token_ids, num_prompt_tokens, self.params)

    def start(self, prompt_ids: list[int], cache_salt: str | None, use_prefix_cache: bool) -> None:
        """Every beam starts as the prompt, which takes its blocks at ``admit``."""
        seq = self._sequence(prompt_ids, len(prompt_ids))
        seq.cache_salt, seq.use_prefix_cache = cache_salt, use_prefix_cache
        self.running = [seq] * self.width

    def admit(self) -> None:
        """Once the prompt's cached prefix below L1 is read (at once when nothing is to be read off host
        memory), share its cached blocks and allocate the rest, as the scheduler admits a request."""
        seq = self.running[0]
        if not self.kv.prefix_loaded(seq):
            return
        self.kv.match_prefix(seq)
        self.cache = seq.cache_info
        self._allocate(seq)
        self.admitted = True

    def prefill_chunk(self) -> torch.Tensor | None:
        """Compute the next chunk of the prompt's KV (the scheduler's token budget) and publish its completed
        blocks; its next-token logits ``[1, vocab]`` once the whole prompt is in, else None."""
        seq = self.running[0]
        n = min(self.prefill_budget, seq.num_tokens - seq.num_computed_tokens)
        logits = self.backend.forward([ScheduledChunk(seq, n)])
        seq.num_computed_tokens += n
        self.kv.cache_computed(seq)
        return logits if seq.num_computed_tokens == seq.num_tokens else None

    def fork(self, parents: list[int], tokens: list[int]) -> None:
        """Make ``running[parents[i]] + [tokens[i]]`` the running beams, sharing the parents' blocks."""
        children = []
        for parent_index, token in zip(parents, tokens):
            parent = self.running[parent_index]
            child = self._sequence(parent.token_ids + [token], parent.num_prompt_tokens)
            child.block_table = list(parent.block_table)
            child.num_computed_tokens = parent.num_computed_tokens
            for block_id in child.block_table:
                self.pool.share(block_id)
            children.append(child)
        previous, self.running = self.running, children
        for seq in previous:
            self._drop(seq)  # the prompt is listed once per beam; a second drop finds its table empty
        copies: list[tuple[int, int]] = []
        for child in children:
            self._make_writable(child, copies)
        if copies:
            sources, targets = zip(*copies)
            self.backend.write_blocks(list(targets), self.backend.read_blocks(list(sources)))

    def _make_writable(self, seq: Sequence, copies: list[tuple[int, int]]) -> None:
        """Give ``seq`` a slot for its newest token: a fresh block, or its own copy of a shared partial one."""
        position = seq.num_computed_tokens
        if position % self.pool.block_size == 0:
            self._allocate(seq)
            return
        last = seq.block_table[-1]
        if self.pool.blocks[last].ref_count > 1:
            # the block stays referenced by another beam until the forward, so it can be read after the swap
            [copy] = self.pool.allocate(1)
            self.pool.free([last])
            seq.block_table[-1] = copy
            copies.append((last, copy))

    def _allocate(self, seq: Sequence) -> None:
        if not self.kv.allocate_slots(seq, seq.num_tokens):
            raise QueueFullError(f"beam search ran out of KV blocks ({self.pool.num_free_blocks} free); retry later")

    def forward(self) -> torch.Tensor:
        """One backend step over every running beam's newest token; logits ``[beam_width, vocab]``."""
        chunks = [ScheduledChunk(seq, 1) for seq in self.running]
        held = len({block_id for seq in self.running for block_id in seq.block_table})
        self.peak_blocks = max(self.peak_blocks, held)
        logits = self.backend.forward(chunks)
        for seq in self.running:
            seq.num_computed_tokens += 1
        return logits

    def _drop(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.kv_load = None  # a prefix read still under way is forgotten (KVCacheManager.wait_for_loads)
        self.backend.release(seq)

    def release(self) -> None:
        """Free every block the search still holds."""
        for seq in self.running:
            self._drop(seq)
        self.running = []
