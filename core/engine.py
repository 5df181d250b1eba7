"""The engine: requests in, token deltas out, one model step at a time on a background thread.

    submit() ─► incoming ─► scheduler.schedule() ─► backend.forward() ─► sampler
                                 ▲                                         │
                      aborts ────┘           detokenizer ◄─────────────────┘
                                                  │
                                 per-request stream (asyncio queue or blocking queue)

HTTP handlers ``async for`` over ``add_request``; scripts and tests call
``generate``. Everything that touches the scheduler or the KV arena runs on
the step thread (or inline in ``generate`` when no thread is running), so
they need no locks; other threads talk to it through thread-safe deques.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence as Seq
from concurrent.futures import Future
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch

from tierserve.cache.block_pool import BlockPool, KVCacheManager
from tierserve.cache.store import StoreTier, TieredStore
from tierserve.core.backend import ModelBackend
from tierserve.core.config import Settings
from tierserve.core.errors import ConfigError
from tierserve.core.detokenizer import IncrementalDetokenizer
from tierserve.core.plugins import PluginManager, load_plugins
from tierserve.core.sampler import SampledToken, Sampler, SamplingRow
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.scheduler import QueueFullError, ScheduledChunk, Scheduler
from tierserve.core.speculation import Proposal, SpeculationStats, Speculator, verify
from tierserve.core.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    from tierserve.core.beam_search import BeamResult, BeamSearchParams

log = structlog.get_logger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve as asked; the message names the field."""


def read_warm_prompts(path: str) -> list[str]:
    """Prompts to warm at start-up: a JSON list of strings, or one prompt per non-empty line."""
    import json

    text = Path(path).expanduser().read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        prompts = json.loads(text)
        if not all(isinstance(p, str) for p in prompts):
            raise RequestError(f"kv_cache.warm_prompts_file: {path} must hold a JSON list of strings")
        return prompts
    return [line for line in text.splitlines() if line.strip()]


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """What one step added to a request (a streaming delta), plus running totals."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    timings: RequestTimings | None = None  # on the final output only


@dataclass(slots=True)
class RequestTimings:
    """Measured per request (seconds, monotonic clock) for the server's performance report."""

    queued: float  # arrival -> first scheduled
    cache_lookup: float  # time spent finding and loading cached prefix blocks
    inference: float  # first scheduled -> finished
    time_to_first_token: float | None
    peak_kv_bytes: int
    accepted_drafts: int = 0  # speculative draft tokens this request accepted
    windows_slid: int = 0  # times a sliding window released this request's old KV


@dataclass(slots=True)
class CompletedRequest:
    """The whole result of ``generate``: deltas folded together."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None


class RequestStream:
    """Carries a request's deltas from the step thread to its consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        self._async: asyncio.Queue[RequestOutput] | None = asyncio.Queue() if loop else None
        self._sync: queue.SimpleQueue[RequestOutput] | None = None if loop else queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, output)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass
        else:
            self._sync.put(output)

    async def get_async(self) -> RequestOutput:
        return await self._async.get()

    def get(self, timeout: float | None = None) -> RequestOutput:
        return self._sync.get(timeout=timeout)


@dataclass(slots=True, eq=False)
class RequestState:
    seq: Sequence
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    logprobs: bool


@dataclass
class WindowStats:
    """Sliding-window counters: slides, tokens whose KV was dropped, blocks released."""

    windows_slid: int = 0
    tokens_dropped: int = 0
    blocks_released: int = 0


@dataclass
class EngineStats:
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)


class Engine:
    """Continuous-batching inference over one backend, scheduler and block pool."""

    def __init__(
        self,
        settings: Settings,
        backend: ModelBackend,
        scheduler: Scheduler,
        pool: BlockPool,
        plugins: PluginManager,
        store: TieredStore | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.scheduler = scheduler
        self.pool = pool
        self.plugins = plugins
        self.store = store
        self.speculator = speculator
        self.spec_stats = SpeculationStats()
        self.window_stats = WindowStats()
        self.tokenizer = backend.tokenizer
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._requests: dict[str, RequestState] = {}
        self._incoming: deque[RequestState] = deque()
        self._aborts: deque[str] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._seq_ids = itertools.count()
        self._rng = random.Random()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- construction -----------------------------------------------------

    @classmethod
    def from_settings(cls, settings: Settings, plugins: PluginManager | None = None) -> Engine:
        """Build the backend, block pool and scheduler that ``settings`` name."""
        plugins = plugins or load_plugins()
        backend_factory = plugins.registry("backends").get(settings.model.backend).factory
        backend: ModelBackend = backend_factory(settings)
        kv = settings.kv_cache
        num_blocks = kv.l1_capacity
        block_bytes = backend.kv_bytes_per_block(kv.block_size)
        if kv.l1_max_bytes is not None and block_bytes:
            num_blocks = max(1, kv.l1_max_bytes // block_bytes)
        policies = plugins.registry("eviction_policies")
        pool = BlockPool(num_blocks, kv.block_size, policies.get(kv.eviction_policy).factory(num_blocks))
        backend.allocate_kv_cache(num_blocks, kv.block_size)
        store = cls._build_store(settings, plugins, backend, pool)
        scheduler_factory = plugins.registry("schedulers").get(settings.scheduler.name).factory
        scheduler = scheduler_factory(settings.scheduler, KVCacheManager(pool, store))
        speculator = None
        if settings.speculative.method and not backend.paged:
            raise ConfigError(
                f"speculative.method = {settings.speculative.method!r} needs a paged backend (drafts are rolled "
                f"back in the block arena); model.backend {settings.model.backend!r} keeps its own cache"
            )
        if settings.speculative.method:
            speculator = plugins.registry("speculators").get(settings.speculative.method).factory(settings, backend)
        engine = cls(settings, backend, scheduler, pool, plugins, store, speculator)
        warm = list(kv.warm_prompts)
        if kv.warm_prompts_file:
            warm += read_warm_prompts(kv.warm_prompts_file)
        if warm:
            engine.warm(warm)
        log.info(
            "engine_ready",
            model=str(getattr(backend, "path", settings.model.path)),
            device=str(backend.device),
            dtype=str(backend.dtype),
            kv_blocks=num_blocks,
            block_size=kv.block_size,
            prefix_cache=store is not None,
            tiers=store.tier_names[1:] if store else [],
        )
        return engine

    @staticmethod
    def _build_store(settings: Settings, plugins: PluginManager, backend: ModelBackend, pool: BlockPool):
        """The tiered prefix store, or None when prefix caching is off or the backend is not paged."""
        kv = settings.kv_cache
        if not kv.enable_prefix_caching or not backend.paged:
            return None
        policies = plugins.registry("eviction_policies")
        tiers = plugins.registry("cache_tiers")
        lower: list[StoreTier] = []
        if kv.l2_capacity > 0 and kv.max_memory_bytes > 0:
            policy = policies.get(kv.l2_eviction_policy or kv.eviction_policy).factory
            l2 = tiers.get(kv.l2_tier).factory(kv, policy, backend.fingerprint)
            lower.append(StoreTier("l2", l2))
        if kv.disk_path:
            policy = policies.get(kv.l3_eviction_policy or kv.eviction_policy).factory
            l3 = tiers.get(kv.l3_tier).factory(kv, policy, backend.fingerprint)
            lower.append(StoreTier("l3", l3, write_through=kv.persistence))
        return TieredStore(pool, backend, backend.fingerprint, lower)

    # ---- requests -----------------------------------------------------------

    def encode_prompt(self, prompt: str | Seq[int] | None = None, messages: Seq[dict[str, Any]] | None = None) -> list[int]:
        """Token ids for a text prompt, token ids, or chat messages (the checkpoint's chat template)."""
        if messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError("messages: this model's tokenizer has no chat template; send a prompt instead")
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if prompt is None:
            raise RequestError("prompt: required (a string or a list of token ids)")
        ids = list(prompt)
        if any(not isinstance(t, int) or not 0 <= t < self.backend.vocab_size for t in ids):
            raise RequestError(f"prompt: token ids must be integers in [0, {self.backend.vocab_size})")
        return ids

    def submit(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        use_prefix_cache: bool = True,
        speculate: bool | None = None,
        sliding_window: bool | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> tuple[str, RequestStream]:
        """Queue a tokenised request from any thread; deltas arrive on the returned stream.

        ``speculate``: ``None`` follows the settings (on when ``[speculative] method``
        is set); requests with penalties or logprobs decode without drafts.

        Raises:
            RequestError: empty prompt, or prompt + max_tokens beyond the context or KV capacity.
            QueueFullError: the waiting queue is full (back-pressure).
        """
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError("prompt: must contain at least one token")
        streaming = self.settings.sliding_window.enabled if sliding_window is None else sliding_window
        if streaming and not (self.backend.paged and hasattr(self.backend, "model")):
            raise RequestError("enable_sliding_window: needs the native backend (paged KV); allowed: false")
        limit = self.backend.max_model_len
        if streaming:
            window = self.settings.sliding_window
            needed = window.sink_tokens + window.window_size + window.window_overlap + 2 * self.pool.block_size
            if len(ids) > limit or needed + len(ids) > self.pool.num_blocks * self.pool.block_size:
                raise RequestError(
                    f"prompt: {len(ids)} tokens; with sliding_window the prompt must fit the context ({limit}) "
                    f"and the KV cache with room for the window"
                )
        elif len(ids) + params.max_tokens > limit:
            raise RequestError(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the model's context length ({limit})"
            )
        capacity = self.pool.num_blocks * self.pool.block_size
        if not streaming and len(ids) + params.max_tokens > capacity:
            raise RequestError(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the KV cache capacity ({capacity} tokens)"
            )
        waiting = self.scheduler.num_waiting + len(self._incoming)
        if waiting >= self.settings.scheduler.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} requests are waiting (max_waiting_requests = "
                f"{self.settings.scheduler.max_waiting_requests}); retry later"
            )
        if speculate and self.speculator is None:
            raise RequestError("enable_speculation: no speculator is configured ([speculative] method); allowed: false")
        speculate = self.speculator is not None if speculate is None else speculate
        speculate = speculate and not params.has_penalties and params.logprobs is None
        request_id = request_id or f"req-{next(self._seq_ids)}-{self._rng.getrandbits(32):08x}"
        if request_id in self._requests:
            raise RequestError(f"request_id: {request_id!r} is already in flight")
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            token_ids=ids,
            num_prompt_tokens=len(ids),
            params=params,
            priority=priority,
            generator=self._make_generator(params),
            cache_salt=cache_salt,
            use_prefix_cache=use_prefix_cache,
            speculate=speculate,
            spec_k=self.settings.speculative.num_speculative_tokens,
            streaming=streaming,
        )
        state = RequestState(
            seq=seq,
            stream=RequestStream(loop),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                ids,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
            ),
            logprobs=params.logprobs is not None,
        )
        self._requests[request_id] = state
        self._incoming.append(state)
        self._wakeup.set()
        return request_id, state.stream

    def _make_generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        generator = torch.Generator(device=self.backend.device)
        generator.manual_seed(params.seed if params.seed is not None else self._rng.getrandbits(63))
        return generator

    async def add_request(
        self,
        prompt: str | Seq[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Seq[dict[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        use_prefix_cache: bool = True,
        speculate: bool | None = None,
        sliding_window: bool | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas; leaving the loop early (client gone) aborts it."""
        ids = self.encode_prompt(prompt, messages)
        request_id, stream = self.submit(
            ids,
            params or SamplingParams(),
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
            use_prefix_cache=use_prefix_cache,
            speculate=speculate,
            sliding_window=sliding_window,
            loop=asyncio.get_running_loop(),
        )
        async for output in self.outputs(request_id, stream):
            yield output

    async def outputs(self, request_id: str, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """A submitted request's deltas; leaving early (client gone, cancelled) aborts it and frees its blocks."""
        finished = False
        try:
            while not finished:
                output = await stream.get_async()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step and free its blocks (thread-safe; unknown ids are ignored)."""
        self._aborts.append(request_id)
        self._wakeup.set()

    # ---- the step -------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._incoming or self._aborts or self._commands or self.scheduler.has_unfinished)

    # ---- cache management (runs on the step thread, between steps) ---------------------

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` between steps on the step thread (inline when no thread runs) and return its result."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        self._commands.append((fn, future))
        self._wakeup.set()
        return future.result()

    def _run_commands(self) -> None:
        while self._commands:
            fn, future = self._commands.popleft()
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def warm(self, prompts: Seq[str | Seq[int]], cache_salt: str | None = None) -> int:
        """Prefill ``prompts`` and keep their KV in the cache tiers; returns the tokens now cached."""
        if self.store is None:
            raise RequestError("warm: prefix caching is off (kv_cache.enable_prefix_caching) or the backend is not paged")
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        ids = [self.encode_prompt(p) for p in prompts]
        submitted = [self.submit(i, params, cache_salt=cache_salt) for i in ids]
        for _, stream in submitted:
            while not self._next_output(stream).finished:
                pass
        self._call(self.store.flush)
        return sum((len(i) // self.pool.block_size) * self.pool.block_size for i in ids)

    def clear_cache(self, tier: str = "all") -> dict[str, int]:
        """Drop cached prefixes of ``l1``, ``l2``, ``l3`` or ``all`` tiers; safe while requests run."""
        if self.store is None:
            return {}
        return self._call(lambda: self.store.clear(tier))

    def offload_cache(self) -> int:
        """Move idle L1 prefix blocks down to L2 (or L3), freeing the live pool; returns blocks moved."""
        if self.store is None:
            return 0
        return self._call(self.store.offload)

    def cache_stats(self) -> dict[str, Any]:
        """Per-tier and index statistics plus the engine's token counters, as plain data."""
        def collect() -> dict[str, Any]:
            snapshot = self.store.snapshot().as_dict() if self.store is not None else {"tiers": {}}
            snapshot["speculation"] = {
                "enabled": self.speculator is not None,
                "method": self.settings.speculative.method,
                **self.spec_stats.as_dict(),
            }
            snapshot["sliding_window"] = {
                "enabled": self.settings.sliding_window.enabled,
                "windows_slid": self.window_stats.windows_slid,
                "tokens_dropped": self.window_stats.tokens_dropped,
                "blocks_released": self.window_stats.blocks_released,
                "blocks_in_use": self.pool.num_used_blocks,
            }
            snapshot["engine"] = {
                "prompt_tokens": self.stats.prompt_tokens,
                "generation_tokens": self.stats.generation_tokens,
                "preemptions": self.stats.preemptions,
            }
            return snapshot

        return self._call(collect)

    def embed(self, inputs: Seq[str | Seq[int]]) -> tuple[torch.Tensor, int]:
        """Mean-pooled, L2-normalised final hidden states of each input, and the tokens they took.

        Inputs are texts or token ids; each is embedded on its own (no KV is
        read or cached). The backend runs between steps on the step thread, in
        batches of at most ``scheduler.max_num_batched_tokens`` tokens, so a large
        request delays running generations by at most about one step per batch.

        Returns:
            ``(vectors, prompt_tokens)``: float32 ``[len(inputs), hidden_size]`` on
            the CPU, and the number of tokens across all inputs.

        Raises:
            RequestError: an input that is empty, holds invalid token ids, or is
                longer than the model's context length.
        """
        if not inputs:
            raise RequestError("input: must hold at least one text or list of token ids")
        token_ids: list[list[int]] = []
        for index, item in enumerate(inputs):
            try:
                ids = self.encode_prompt(item)
            except RequestError as exc:  # encode_prompt names the field "prompt"
                raise RequestError(f"input: item {index}: {str(exc).partition(': ')[2]}") from None
            if not ids:
                raise RequestError(f"input: item {index} is empty; send at least one token of text")
            if len(ids) > self.backend.max_model_len:
                raise RequestError(
                    f"input: item {index} has {len(ids)} tokens, which exceeds the model's context length "
                    f"{self.backend.max_model_len}; shorten or split it"
                )
            token_ids.append(ids)
        budget = self.settings.scheduler.max_num_batched_tokens
        batches: list[list[list[int]]] = []
        room = 0
        for ids in token_ids:
            if len(ids) > room:
                batches.append([])
                room = budget
            batches[-1].append(ids)
            room -= len(ids)
        vectors = [self._call(lambda batch=batch: self.backend.embed(batch).cpu()) for batch in batches]
        return torch.cat(vectors), sum(len(ids) for ids in token_ids)

    def beam_search(self, prompt: str | Seq[int], params: BeamSearchParams) -> list[BeamResult]:
        """Beam search, equal to transformers' ``generate(num_beams=params.beam_width, do_sample=False)``.

        The beams share the prompt's KV blocks (see ``core/beam_search.py``). The
        whole search runs as one command between steps on the step thread, so a
        beam request occupies the engine from prefill to its last token: running
        generations pause meanwhile.

        Returns:
            ``params.num_return_sequences`` hypotheses, highest score first.

        Raises:
            RequestError: an empty prompt, a backend without a paged KV arena, or
                prompt + max_tokens beyond the context length or beyond what the
                whole KV cache can hold for ``beam_width`` beams.
            QueueFullError: too few KV blocks are free now; retry later.
        """
        from tierserve.core.beam_search import beam_search_blocks, run_beam_search

        ids = self.encode_prompt(prompt)
        if not ids:
            raise RequestError("prompt: must contain at least one token")
        if not self.backend.paged:
            raise RequestError(
                f"beam_width: beam search needs a paged KV arena, which the {self.settings.model.backend!r} "
                'backend does not keep; serve the model with model.backend = "native"'
            )
        limit = self.backend.max_model_len
        if len(ids) + params.max_tokens > limit:
            raise RequestError(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the model's context length ({limit})"
            )
        needed = beam_search_blocks(len(ids), params, self.pool.block_size)
        if needed > self.pool.num_blocks:
            raise RequestError(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) over "
                f"{params.beam_width} beams may need {needed} KV blocks, more than the cache holds "
                f"({self.pool.num_blocks}); lower max_tokens or beam_width"
            )
        eos = self.backend.eos_token_ids
        return self._call(lambda: run_beam_search(self, ids, params, eos))

    def step(self) -> int:
        """Run one scheduling + forward + sampling step; returns the number of tokens computed."""
        self._run_commands()
        self._admit()
        self._apply_aborts()
        drafted = self._propose_drafts()
        output = self.scheduler.schedule()
        for seq in output.preempted:
            self.stats.preemptions += 1
            self.backend.release(seq)
            if seq.streaming and seq.num_tokens > self.pool.num_blocks * self.pool.block_size // 2:
                # its dropped KV cannot be recomputed within the budget: end it rather than loop
                self._finish(self._requests[seq.request_id], FinishReason.LENGTH, "")
                continue
            if self.speculator is not None:
                self.speculator.release(seq)
        self._settle_drafts(output.chunks, drafted)
        if not output.chunks:
            return 0
        self.stats.steps += 1
        now = time.monotonic()
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            seq.peak_blocks = max(seq.peak_blocks, len(seq.block_table))
        logits = self.backend.forward(output.chunks)
        plain: list[tuple[ScheduledChunk, int]] = []  # (chunk, its logits row)
        speculative: list[tuple[ScheduledChunk, int]] = []
        row = 0
        for chunk in output.chunks:
            rows_of_chunk, samples = chunk.num_logits, chunk.samples  # before the sequence advances
            chunk.seq.num_computed_tokens += chunk.num_tokens
            if chunk.num_draft:
                speculative.append((chunk, row))
            else:
                self.scheduler.kv.cache_computed(chunk.seq)
                if samples:
                    plain.append((chunk, row))
            row += rows_of_chunk
        if plain:
            rows = [self._sampling_row(c.seq) for c, _ in plain]
            picked = logits[[r for _, r in plain]] if len(plain) != logits.shape[0] else logits
            for (chunk, _), sampled in zip(plain, self.sampler(picked, rows)):
                self._append_token(self._requests[chunk.seq.request_id], sampled)
        for chunk, first in speculative:
            self._accept_drafts(chunk, logits[first : first + chunk.num_draft + 1], drafted[chunk.seq.seq_id])
        for chunk in output.chunks:
            if not chunk.seq.is_finished:
                self._slide_window(chunk.seq)
        return output.num_tokens

    def _slide_window(self, seq: Sequence) -> None:
        """Release KV blocks no future token will attend to (a trained window, or streaming mode)."""
        bs = self.pool.block_size
        trained = getattr(getattr(self.backend, "model", None), "trained_window", None) if self.backend.paged else None
        if trained is not None:
            start, end = 0, max(0, (seq.num_computed_tokens - trained) // bs) * bs
        elif seq.streaming:
            window = self.settings.sliding_window
            start = -(-window.sink_tokens // bs) * bs  # sinks are kept in whole blocks
            kept_from = max(seq.kv_drop_end, start)
            if seq.num_computed_tokens - kept_from <= window.window_size + window.window_overlap:
                return
            end = max(start, (seq.num_computed_tokens - window.window_size) // bs * bs)
        else:
            return
        if end <= seq.kv_drop_end or end <= start:
            return
        released = self.scheduler.kv.drop(seq.block_table, max(start, seq.kv_drop_end) // bs, end // bs)
        self.window_stats.windows_slid += 1
        seq.windows_slid += 1
        self.window_stats.tokens_dropped += end - max(start, seq.kv_drop_end)
        self.window_stats.blocks_released += released
        seq.kv_drop_start, seq.kv_drop_end = start, end

    @staticmethod
    def _sampling_row(seq: Sequence) -> SamplingRow:
        if seq.params.has_penalties:
            return SamplingRow(seq.params, seq.generator, seq.prompt_token_ids, seq.output_token_ids)
        return SamplingRow(seq.params, seq.generator, [], [])

    # ---- speculative decoding ----------------------------------------------------

    def _propose_drafts(self) -> dict[int, Proposal]:
        """Append drafts to the decoding sequences that speculate; the scheduler then schedules them."""
        if self.speculator is None:
            return {}
        seqs, budgets = [], []
        for state in self._requests.values():
            seq = state.seq
            if not seq.speculate or seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            room = min(
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.backend.max_model_len - seq.num_tokens - 1,
            )
            k = min(seq.spec_k, room)
            if k > 0:
                seqs.append(seq)
                budgets.append(k)
        if not seqs:
            return {}
        drafted = {}
        for seq, proposal in zip(seqs, self.speculator.propose(seqs, budgets)):
            if proposal.token_ids:
                seq.token_ids.extend(proposal.token_ids)
                drafted[seq.seq_id] = proposal
        return drafted

    def _settle_drafts(self, chunks: list[ScheduledChunk], drafted: dict[int, Proposal]) -> None:
        """Mark fully scheduled drafts for verification; take back the others (budget cut, preempted)."""
        if not drafted:
            return
        by_seq = {chunk.seq.seq_id: chunk for chunk in chunks}
        seqs = {state.seq.seq_id: state.seq for state in self._requests.values()}
        for seq_id, proposal in drafted.items():
            seq = seqs[seq_id]
            chunk = by_seq.get(seq_id)
            if chunk is not None and chunk.num_tokens == seq.num_uncomputed_tokens:
                chunk.num_draft = len(proposal.token_ids)
                continue
            del seq.token_ids[len(seq.token_ids) - len(proposal.token_ids) :]
            if chunk is not None:
                chunk.num_tokens = min(chunk.num_tokens, seq.num_uncomputed_tokens)
            if seq.block_table:
                self.scheduler.kv.trim(seq.block_table, seq.num_tokens)

    def _accept_drafts(self, chunk: ScheduledChunk, logits, proposal: Proposal) -> None:
        seq = chunk.seq
        state = self._requests[seq.request_id]
        k = chunk.num_draft
        base = seq.num_tokens - k  # tokens before the drafts
        emitted = verify(logits, proposal, self._sampling_row(seq), seq.params.greedy)
        accepted = len(emitted) - 1
        stats = self.spec_stats
        stats.verifications += 1
        stats.proposed += k
        stats.accepted += accepted
        stats.emitted += len(emitted)
        seq.accepted_drafts += accepted
        # forget the drafts; the accepted ones come back with their KV already in place
        del seq.token_ids[base:]
        seq.num_computed_tokens = base + accepted
        self.scheduler.kv.trim(seq.block_table, base + accepted + 1)
        if self.settings.speculative.adaptive:
            limit = self.settings.speculative.num_speculative_tokens
            seq.spec_k = min(limit, seq.spec_k + 1) if accepted == k else max(1, accepted)
        for position, token in enumerate(emitted):
            self._append_token(state, SampledToken(token, None, None))
            if seq.is_finished:
                if position < len(emitted) - 1:
                    stats.early_stops += 1
                return
        self.scheduler.kv.cache_computed(seq)

    def _admit(self) -> None:
        while self._incoming:
            state = self._incoming.popleft()
            if state.seq.request_id not in self._requests:
                continue
            try:
                self.scheduler.add(state.seq)
            except QueueFullError:
                self._finish(state, FinishReason.ABORT, "")
                continue
            self.stats.requests_added += 1
            self.stats.prompt_tokens += state.seq.num_prompt_tokens

    def _apply_aborts(self) -> None:
        while self._aborts:
            state = self._requests.get(self._aborts.popleft())
            if state is not None and not state.seq.is_finished:
                self.stats.requests_aborted += 1
                self._finish(state, FinishReason.ABORT, "")

    def _append_token(self, state: RequestState, sampled: SampledToken) -> None:
        seq = state.seq
        token = sampled.token_id
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        self.stats.generation_tokens += 1
        params = seq.params
        reason: FinishReason | None = None
        text = ""
        if (token in self.backend.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = FinishReason.STOP  # the stop token's text is not part of the output
        else:
            delta = state.detokenizer.add([token])
            text = delta.text
            if delta.stopped:
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= params.max_tokens or (
                seq.num_tokens >= self.backend.max_model_len and not seq.streaming
            ):
                reason = FinishReason.LENGTH
        if reason is not None and state.detokenizer.stop_reason is None:
            text += state.detokenizer.flush()
            if state.detokenizer.stop_reason is not None:  # held-back text completed a stop string
                reason = FinishReason.STOP
        logprobs = None
        if state.logprobs:
            logprobs = [TokenLogprob(token, sampled.logprob, sampled.top_logprobs or [])]
        if reason is not None:
            self._finish(state, reason, text, [token], logprobs)
        else:
            state.stream.put(self._output(state, text, [token], None, logprobs))

    def _output(self, state, text, token_ids, reason, logprobs) -> RequestOutput:
        seq = state.seq
        timings = None
        if reason is not None:
            now = time.monotonic()
            scheduled = seq.first_scheduled_time or now
            timings = RequestTimings(
                queued=scheduled - seq.arrival_time,
                cache_lookup=seq.cache_lookup_seconds,
                inference=now - scheduled,
                time_to_first_token=(seq.first_token_time - seq.arrival_time) if seq.first_token_time else None,
                peak_kv_bytes=seq.peak_blocks * self.backend.kv_bytes_per_block(self.pool.block_size),
                accepted_drafts=seq.accepted_drafts,
                windows_slid=seq.windows_slid,
            )
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=token_ids,
            finished=reason is not None,
            finish_reason=reason.value if reason is not None else None,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
            timings=timings,
        )

    def _finish(self, state: RequestState, reason: FinishReason, text: str, token_ids=(), logprobs=None) -> None:
        seq = state.seq
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq)
            self.backend.release(seq)
            if self.speculator is not None:
                self.speculator.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.stats.requests_finished += 1
        self.stats.finish_reasons[reason.value] = self.stats.finish_reasons.get(reason.value, 0) + 1
        self._requests.pop(seq.request_id, None)
        state.stream.put(self._output(state, text, list(token_ids), reason, logprobs))

    # ---- running ---------------------------------------------------------------

    def start(self) -> None:
        """Run steps on a background thread until ``shutdown``."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="tierserve-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.has_work():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                self.step()
            except Exception:
                log.exception("engine_step_failed")
                self._fail_all()

    def _fail_all(self) -> None:
        """After a step failed, end every request rather than leave clients hanging."""
        for state in list(self._requests.values()):
            self._finish(state, FinishReason.ABORT, "")

    def shutdown(self, abort_running: bool = True) -> None:
        """Stop the step thread; with ``abort_running`` every unfinished request ends as aborted."""
        if self._thread is not None:
            self._stop.set()
            self._wakeup.set()
            self._thread.join()
            self._thread = None
        if abort_running:
            for request_id in list(self._requests):
                self.abort(request_id)
            self._admit()
            self._apply_aborts()
        self._run_commands()

    def close(self) -> None:
        """Shut down, flush queued L3 writes and release the tiers and the model."""
        self.shutdown()
        if self.store is not None:
            self.store.close()
        if self.speculator is not None:
            self.speculator.close()
        self.backend.close()

    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        priorities: Seq[int] | None = None,
    ) -> list[CompletedRequest]:
        """Run prompts to completion (all submitted at once, batched continuously)."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        submitted = []
        for index, prompt in enumerate(prompts):
            ids = self.encode_prompt(prompt)
            priority = priorities[index] if priorities else 0
            submitted.append((ids, *self.submit(ids, params_list[index], priority=priority)))
        results = []
        for ids, request_id, stream in submitted:
            tokens: list[int] = []
            text: list[str] = []
            logprobs: list[TokenLogprob] = []
            while True:
                output = self._next_output(stream)
                tokens.extend(output.token_ids)
                text.append(output.text)
                logprobs.extend(output.logprobs or [])
                if output.finished:
                    break
            results.append(
                CompletedRequest(
                    request_id, ids, tokens, "".join(text), output.finish_reason, output.cached_tokens,
                    logprobs if logprobs else None,
                )
            )
        return results

    def _next_output(self, stream: RequestStream) -> RequestOutput:
        if self._thread is not None:
            return stream.get()
        while True:
            try:
                return stream.get(timeout=0)
            except queue.Empty:
                self.step()
