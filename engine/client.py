"""``EngineClient``: the one object the server, the CLI and scripts use to talk to an engine core.

    tokenize, validate ─► submit ─► driver queue ─► EngineCore (thread or child process)
                                                        │ StepOutputs (token ids, snapshot)
    request streams ◄── output processor (detokenize, stop strings) ◄──┘

It never reads the core's pool, scheduler or backend: static facts come in a
``ModelInfo`` at start, statistics in the snapshots the core publishes, and
everything else is a message. ``EngineClient.from_settings`` picks where the
core runs (``[server] engine_process``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
import threading
from collections.abc import AsyncIterator, Sequence as Seq
from typing import TYPE_CHECKING, Any

from tierserve.cache.warm_writes import WarmedPrompts
from tierserve.engine.chat_prompt import encode_chat
from tierserve.engine.detokenizer import IncrementalDetokenizer
from tierserve.engine.messages import Abort, ModelInfo, StepOutputs
from tierserve.engine.output_processor import OutputProcessor, RequestState, RequestStream
from tierserve.engine.profiling import CLIENT_PHASES, PhaseClock, with_client_phases
from tierserve.engine.requests import (
    EngineRequest,
    RequestError,
    batch_by_tokens,
    check_fits,
    check_request,
    window_mode,
)
from tierserve.engine.stats import EngineSnapshot, empty_snapshot
from tierserve.core.errors import EngineFault, RequestTimeoutError
from tierserve.core.grammar import GrammarSpec
from tierserve.core.outputs import CompletedRequest, RequestOutput, TokenLogprob
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.scheduler import QueueFullError

CHECKED_GRAMMARS = 256  # compiled output constraints remembered (a repeated schema compiles once)

if TYPE_CHECKING:
    import torch

    from tierserve.cache.frequency import PrefixUse
    from tierserve.cache.kv_events import KVEvents
    from tierserve.cache.named_prefixes import NamedPrefix
    from tierserve.cache.warming import WarmReport
    from tierserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
    from tierserve.engine.supervisor import SupervisorStatus
    from tierserve.settings.config import Settings
    from tierserve.core.plugins import PluginManager


class EngineClient:
    """Submit, stream, abort, manage the cache and read statistics of one engine core.

    Built with ``from_settings``; ``driver`` is where the core runs (see
    ``drivers.py`` and ``process.py``), ``tokenizer`` the checkpoint's.
    """

    def __init__(self, settings: Settings, info: ModelInfo, tokenizer: Any) -> None:
        self.settings = settings
        self.info = info
        self._tokenizer = tokenizer
        self.driver: Any = None  # attached by the builder before any request
        self._clock = PhaseClock(CLIENT_PHASES) if settings.monitoring.detailed_profiling else None
        self._processor = OutputProcessor(info.eos_token_ids, info.kv_block_bytes, self._abort_in_core, self._clock)
        self._snapshot = empty_snapshot(info.kv_blocks)
        self._core_waiting = 0
        self._unacknowledged = 0
        self._counter = itertools.count()
        self._rng = random.Random()
        self._lock = threading.Lock()
        self.loras: dict[str, dict[str, object]] = dict(info.loras)  # LoRA adapters requests may name
        self._checked_grammars: set[GrammarSpec] = set()  # output constraints already compiled once

    @classmethod
    def from_settings(
        cls, settings: Settings, plugins: PluginManager | None = None, *, process: bool | None = None
    ) -> EngineClient:
        """Build the core (in this process, or in a child process when ``process`` or
        ``settings.server.engine_process`` says so) and a client attached to it; warm the preset prompts."""
        from tierserve.engine.connect import connect

        return connect(settings, plugins, process=settings.server.engine_process if process is None else process)

    # ---- prompts ----------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template (tool calling picks its parser by it)."""
        template = getattr(self._tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def encode_prompt(
        self,
        prompt: str | Seq[int] | None = None,
        messages: Seq[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids for a text prompt, token ids, or chat messages (the checkpoint's chat template, with ``tools``)."""
        if messages is not None:
            if not getattr(self._tokenizer, "chat_template", None):
                raise RequestError("messages: this model's tokenizer has no chat template; send a prompt instead", param="messages")
            try:
                return encode_chat(self._tokenizer, messages, tools)  # a message's text never becomes a control token
            except Exception as exc:
                if type(exc).__name__ != "TemplateError":  # jinja2's: the template refused this conversation
                    raise
                raise RequestError(f"messages: the model's chat template refused them: {exc}", param="messages") from None
        if isinstance(prompt, str):
            return list(self._tokenizer(prompt)["input_ids"])
        if prompt is None:
            raise RequestError("prompt: required (a string or a list of token ids)", param="prompt")
        ids = list(prompt)
        vocab = self.info.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt: token ids must be integers in [0, {vocab})", param="prompt")
        return ids

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` leaves out the BOS (and the like) a prompt gets."""
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's special tokens, chat template and limits (what ``GET /tokenizer_info`` answers)."""
        tokenizer = self._tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            value = getattr(tokenizer, name, None)
            info[name] = value if isinstance(value, str) else None
        info["chat_template"] = self.chat_template
        info["model_max_length"] = self.info.max_model_len
        info["vocab_size"] = self.info.vocab_size
        return info

    def decode(self, token_ids: Seq[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def text_pieces(self, token_ids: Seq[int]) -> list[str]:
        """The text each token adds to the decoded text of ``token_ids``, in order; joined, they are that text
        (special tokens kept, no space cleanup), so their lengths give each token's ``text_offset`` into it.
        A character split across tokens belongs to the token that completes it."""
        detokenizer = IncrementalDetokenizer(self._tokenizer, [], skip_special_tokens=False)
        pieces = [detokenizer.add([token]).text for token in token_ids]
        if pieces:
            pieces[-1] += detokenizer.flush()
        return pieces

    # ---- requests -----------------------------------------------------------------------

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
        window_size: int | None = None,
        cache_key: str | None = None,
        cache_namespace: str = "",
        warm: str | None = None,
        lora_name: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> tuple[str, RequestStream]:
        """Queue a tokenised request from any thread; deltas arrive on the returned stream.

        ``speculate``: ``None`` follows the settings (on when ``[speculative] method``
        is set); ``True`` asks for it (prompt lookup when no method is configured);
        requests with penalties or logprobs decode without drafts. ``speculation_method``
        tells which method a request would get. ``cache_key`` names the prompt's
        cached prefix within ``cache_namespace`` (the tenant): when the request ends
        normally its full prompt blocks are pinned under that key (``check_cache_key``).
        ``warm``: the prompt warm (``EngineClient.warm``) the request is part of; its
        write-through waits for room in write queues and is counted for that warm.
        ``lora_name``: a loaded LoRA adapter (``load_lora``) the request runs with; its prefix
        cache entries are its own.

        An asyncio consumer (``loop``) that leaves more than ``[server] max_stream_backlog``
        deltas unread has its request aborted (its stream ends with ``finish_reason="abort"``).

        Raises:
            RequestError: empty prompt, prompt + max_tokens beyond the context or KV capacity, or
                ``sliding_window=True`` where ``[sliding_window]`` neither enables nor allows it, or a
                ``window_size`` (the request's own window in streaming mode) outside 64-1024 tokens.
            QueueFullError: the waiting queue is full (back-pressure).
        """
        ids = list(prompt_token_ids)
        if params.grammar is not None:
            self.check_grammar(params.grammar)  # RequestError naming the field, before anything is queued
        streaming = window_mode(self.settings.sliding_window, sliding_window, window_size)
        spec_method = check_request(
            self.info, self.settings.sliding_window, ids, params, speculate, streaming, window_size
        )
        if cache_key is not None:
            self.check_cache_key(len(ids), use_prefix_cache)
        if lora_name is not None and lora_name not in self.loras:
            raise RequestError(
                f"model: no LoRA adapter named {lora_name!r} is loaded (loaded: {', '.join(sorted(self.loras)) or 'none'})",
                param="model",
                code="model_not_found",
            )
        request_id = request_id or f"req-{next(self._counter)}-{self._rng.getrandbits(32):08x}"
        with self._lock:
            waiting = self._core_waiting + self._unacknowledged
            limit = self.settings.scheduler.max_waiting_requests
            if waiting >= limit:
                raise QueueFullError(f"{waiting} requests are waiting (max_waiting_requests = {limit}); retry later")
            if request_id in self._processor.requests:
                raise RequestError(f"request_id: {request_id!r} is already in flight", param="request_id")
            stream = RequestStream(loop, self.settings.server.max_stream_backlog)
            request = EngineRequest(
                request_id, ids, params, priority, cache_salt, use_prefix_cache, spec_method, streaming,
                window_size=window_size if streaming else None, cache_key=cache_key, cache_namespace=cache_namespace, warm=warm, lora_name=lora_name,
            )  # fmt: skip
            detokenizer = IncrementalDetokenizer(
                self._tokenizer,
                ids,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
            )
            self._processor.add(
                RequestState(request_id, stream, detokenizer, params, len(ids), request.arrival_time, spec_method)
            )
            self._unacknowledged += 1
        try:
            self.driver.send(request)
        except BaseException:
            with self._lock:
                self._processor.requests.pop(request_id, None)
                self._unacknowledged -= 1
            raise
        return request_id, stream

    def check_grammar(self, grammar: GrammarSpec) -> None:
        """Raise ``RequestError`` naming the field unless ``grammar`` compiles; one already checked is not compiled again."""
        if grammar in self._checked_grammars:
            return
        grammar.check()
        if len(self._checked_grammars) >= CHECKED_GRAMMARS:
            self._checked_grammars.clear()
        self._checked_grammars.add(grammar)

    def check_cache_key(self, num_prompt_tokens: int, use_prefix_cache: bool = True) -> None:
        """Raise ``RequestError`` (param ``cache_key``) unless a prompt this long can be named:
        prefix caching is on, for the request too, and its blocks fit the cap on pinned bytes."""
        info = self.info
        if not info.key_max_pinned_bytes:
            raise RequestError(
                "cache_key: names a cached prefix, and prefix caching is off (kv_cache.enable_prefix_caching) "
                "or the backend keeps no paged cache", param="cache_key",
            )  # fmt: skip
        if not use_prefix_cache:
            raise RequestError("cache_key: names a cached prefix; allowed only with enable_caching: true", param="cache_key")
        blocks = num_prompt_tokens // info.block_size
        needed = blocks * info.kv_block_bytes
        if needed > info.key_max_pinned_bytes:
            raise RequestError(
                f"cache_key: the prompt's prefix takes {needed} bytes of KV ({blocks} blocks), more than "
                f"kv_cache.cache_keys_max_pinned_bytes ({info.key_max_pinned_bytes}); use a shorter prompt or no key",
                param="cache_key",
            )

    async def add_request(
        self,
        prompt: str | Seq[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Seq[dict[str, Any]] | None = None,
        **options: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas; leaving the loop early (client gone) aborts it.

        ``options`` are ``submit``'s keyword arguments (``request_id``, ``priority``, ...).
        """
        ids = self.encode_prompt(prompt, messages)
        request_id, stream = self.submit(ids, params or SamplingParams(), loop=asyncio.get_running_loop(), **options)
        async for output in self.outputs(request_id, stream):
            yield output

    async def outputs(
        self, request_id: str, stream: RequestStream, *, deadline: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """A submitted request's deltas; leaving early (client gone, cancelled) aborts it and frees its blocks.

        ``deadline`` (the event loop's clock): past it, the request is aborted
        and ``RequestTimeoutError`` raised.
        """
        loop = asyncio.get_running_loop()
        finished = False
        try:
            while not finished:
                if deadline is None:
                    output = await stream.get_async()
                else:
                    try:
                        output = await asyncio.wait_for(stream.get_async(), max(0.0, deadline - loop.time()))
                    except TimeoutError:
                        raise RequestTimeoutError(f"request {request_id!r} ran past its deadline") from None
                    # 3.11's wait_for returns a delta that came with a cancel and drops the cancel: honour it
                    if asyncio.current_task().cancelling():
                        raise asyncio.CancelledError
                finished = output.finished
                if output.failure is not None:
                    raise output.failure
                if output.error is not None:
                    if output.error_param is not None:
                        raise RequestError(output.error, param=output.error_param)
                    raise EngineFault(output.error)
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step and free its blocks (thread-safe; unknown ids are ignored). With the
        core process gone (dead, or being restarted) there is nothing to stop: its requests ended with it."""
        from tierserve.engine.process import EngineProcessError

        try:
            self.driver.send(Abort([request_id]))
        except EngineProcessError:
            pass

    def in_flight(self) -> list[str]:
        """Ids of the requests this client is still streaming."""
        return list(self._processor.requests)

    def fail(self, request_id: str, failure: Exception | None = None) -> None:
        """End a request's stream as aborted without asking the core (its core is gone); ``outputs``
        raises ``failure`` to its reader."""
        self._processor.fail(request_id, failure)

    def reattach(self, info: ModelInfo) -> None:
        """A new core process took over from a dead one (``supervisor.py``): its facts, and nothing counted
        by the old one. LoRA adapters loaded since start are gone with it; those the settings name are back."""
        with self._lock:
            self.info = info
            self._snapshot = empty_snapshot(info.kv_blocks)
            self._core_waiting = 0
            self._unacknowledged = 0
            self.loras = dict(info.loras)

    def supervision(self) -> SupervisorStatus | None:
        """How the core process fares: running, restarting or given up, its restarts and last exit
        (``None``: the core runs in this process and is never restarted)."""
        from tierserve.engine.supervisor import EngineSupervisor

        return self.driver.status() if isinstance(self.driver, EngineSupervisor) else None

    def _abort_in_core(self, request_id: str, reason: str) -> None:
        """The client ended a request itself: the core stops it too (``"stop"``: a stop string, not counted
        as an abort; ``"abort"``: its stream's reader fell ``[server] max_stream_backlog`` outputs behind)."""
        self.driver.send(Abort([request_id], reason))

    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        priorities: Seq[int] | None = None,
        cache_salt: str | None = None,
        lora_names: Seq[str | None] | None = None,
    ) -> list[CompletedRequest]:
        """Run prompts to completion (all submitted at once, batched continuously); ``lora_names``
        gives each prompt's adapter (``None``: the base model)."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        submitted = []
        for index, prompt in enumerate(prompts):
            ids = self.encode_prompt(prompt)
            priority = priorities[index] if priorities else 0
            lora_name = lora_names[index] if lora_names else None
            submitted.append(
                (ids, *self.submit(ids, params_list[index], priority=priority, cache_salt=cache_salt, lora_name=lora_name))
            )
        results = []
        for ids, request_id, stream in submitted:
            tokens: list[int] = []
            text: list[str] = []
            logprobs: list[TokenLogprob] = []
            prompt_logprobs = None
            while True:
                output = self.next_output(stream)
                tokens.extend(output.token_ids)
                text.append(output.text)
                logprobs.extend(output.logprobs or [])
                if output.prompt_logprobs is not None:
                    prompt_logprobs = output.prompt_logprobs
                if output.finished:
                    break
            results.append(
                CompletedRequest(
                    request_id, ids, tokens, "".join(text), output.finish_reason, output.cached_tokens,
                    logprobs if logprobs else None, prompt_logprobs,
                )
            )
        return results

    def next_output(self, stream: RequestStream) -> RequestOutput:
        """The next delta of a blocking stream, stepping the core meanwhile if nothing else drives it."""
        import queue

        if self.driver.threaded or self.driver.running:
            return stream.get()
        while True:
            try:
                return stream.get(timeout=0)
            except queue.Empty:
                self.driver.step()

    def receive(self, message: StepOutputs) -> None:
        """Called by the driver (on the core's thread, or the pipe reader's) with each round's outputs."""
        with self._lock:
            if message.snapshot is not None:
                self._snapshot = message.snapshot
            self._unacknowledged -= message.num_added
            self._core_waiting = message.requests_waiting
        self._processor.process(message.outputs)

    # ---- cache and statistics --------------------------------------------------------------

    def warm(
        self,
        prompts: Seq[str | Seq[int]],
        cache_salt: str | None = None,
        *,
        cache_key: str | None = None,
        cache_namespace: str = "",
    ) -> WarmedPrompts:
        """Prefill ``prompts`` and keep their KV in the cache tiers; returns the tokens now cached
        and what became of the blocks written through, per write-through tier.

        Unlike a request's, these writes wait for room in a full write queue, and the warm waits
        until they are stored: ``[kv_cache] warm_write_timeout_seconds`` bounds both together;
        what is still queued then is reported ``pending``. ``cache_key`` (with exactly one prompt)
        names and pins the warmed prefix, as a request's key does.
        """
        if not self.info.tier_names:
            raise RequestError(
                "warm: prefix caching is off (kv_cache.enable_prefix_caching) or the backend is not paged", param="prompts"
            )
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        ids = [self.encode_prompt(p) for p in prompts]
        if cache_key is not None and len(ids) != 1:
            raise RequestError("cache_key: names one prefix; warm exactly one prompt with it", param="cache_key")
        named = {"cache_key": cache_key, "cache_namespace": cache_namespace} if cache_key is not None else {}
        warm = f"warm-{next(self._counter)}-{self._rng.getrandbits(32):08x}"
        try:
            streams = [self.submit(i, params, cache_salt=cache_salt, warm=warm, **named)[1] for i in ids]
            for stream in streams:
                while not self.next_output(stream).finished:
                    pass
        except BaseException:
            with contextlib.suppress(Exception):  # the core forgets the warm; the first error is the one to see
                self.driver.call("finish_warm", warm)
            raise
        writes = self.driver.call("finish_warm", warm)
        bs = self.info.block_size
        return WarmedPrompts(sum((len(i) // bs) * bs for i in ids), writes)

    def warm_frequent(self, limit_blocks: int | None = None) -> WarmReport:
        """Promote the most used cached prefixes from the lower tiers into the faster ones (no prompts
        needed); at most ``limit_blocks`` blocks (default ``[kv_cache] warm_frequent_blocks``)."""
        limit_blocks = limit_blocks or self.settings.kv_cache.warm_frequent_blocks
        if not self.info.tier_names:
            raise RequestError(
                "warm: prefix caching is off (kv_cache.enable_prefix_caching) or the backend is not paged", param="prompts"
            )
        return self.driver.call("warm_frequent", limit_blocks)

    def kv_events(self, epoch: str | None, seq: int) -> KVEvents | None:
        """The cache's block events after batch ``seq`` of ``epoch``, or a snapshot (``cache.kv_events``); None
        without prefix caching. What a fleet replica publishes for the router."""
        return self.driver.call("kv_events", epoch, seq)

    def top_prefixes(self, limit: int) -> list[PrefixUse]:
        """The ``limit`` cached prefixes used most (uses in every tier counted), best first."""
        return self.driver.call("top_prefixes", limit)

    def list_cache_keys(self, namespace: str | None = None) -> list[NamedPrefix]:
        """Named prefixes (``cache_key``) of one namespace, or of all with ``None``."""
        return self.driver.call("list_cache_keys", namespace)

    def delete_cache_key(self, namespace: str, name: str) -> bool:
        """Unpin a named prefix and evict its blocks (those no other key pins); False for an unknown key."""
        return self.driver.call("delete_cache_key", namespace, name)

    def load_lora(self, name: str, path: str) -> dict[str, object]:
        """Load a PEFT LoRA adapter directory under ``name`` (between steps; requests keep running).
        ``RequestError``: LoRA off, no free slot, a duplicate name, or a bad adapter."""
        info = self.driver.call("load_lora", name, path)
        self.loras[name] = info
        return info

    def unload_lora(self, name: str) -> int:
        """Refuse new requests for an adapter at once; its slot frees when the requests using it end
        (returns how many are still running). ``RequestError`` for an unknown name."""
        self.loras.pop(name, None)  # first: no new request may name it while the core drains it
        return self.driver.call("unload_lora", name)

    def clear_cache(self, tier: str = "all") -> dict[str, int]:
        """Drop cached prefixes of one tier (a name from ``info.tier_names``) or ``all``; safe while requests run."""
        return self.driver.call("clear_cache", tier)

    def offload_cache(self) -> int:
        """Move idle L1 prefix blocks down to the next tier, freeing the live pool; returns blocks moved."""
        return self.driver.call("offload_cache")

    def flush_cache(self) -> None:
        """Wait until queued tier writes are stored."""
        self.driver.call("flush_cache")

    def stats(self) -> EngineSnapshot:
        """The latest statistics the core published (never waits for a step), with this
        client's own phase timings (``detokenize``) merged into ``profiling``."""
        if not (self.driver.threaded or self.driver.running):
            snapshot = self.driver.call("snapshot")  # nothing else drives the core: read it now
        else:
            snapshot = self._snapshot
        if snapshot.profiling is not None and self._clock is not None:
            snapshot = dataclasses.replace(snapshot, profiling=with_client_phases(snapshot.profiling, self._clock))
        return snapshot

    cache_stats = stats

    def check_integrity(self) -> None:
        """Assert the pool's, index's and tiers' invariants (between steps)."""
        self.driver.call("check_integrity")

    def embed(self, inputs: Seq[str | Seq[int]]) -> tuple[torch.Tensor, int]:
        """Mean-pooled, L2-normalised final hidden states of each input, and the tokens they took.

        Inputs are texts or token ids; each is embedded on its own (no KV is read
        or cached), between steps, in batches of at most
        ``scheduler.max_num_batched_tokens`` tokens.

        Raises:
            RequestError: an input that is empty, holds invalid token ids, or is
                longer than the model's context length.
        """
        import torch

        if not inputs:
            raise RequestError("input: must hold at least one text or list of token ids", param="input")
        token_ids: list[list[int]] = []
        for index, item in enumerate(inputs):
            try:
                ids = self.encode_prompt(item)
            except RequestError as exc:  # encode_prompt names the field "prompt"
                raise RequestError(f"input: item {index}: {exc.message.partition(': ')[2]}", param="input") from None
            if not ids:
                raise RequestError(f"input: item {index} is empty; send at least one token of text", param="input")
            if len(ids) > self.info.max_model_len:
                raise RequestError(
                    f"input: item {index} has {len(ids)} tokens, which exceeds the model's context length "
                    f"{self.info.max_model_len}; shorten or split it",
                    param="input",
                    code="context_length_exceeded",
                )
            token_ids.append(ids)
        batches = batch_by_tokens(token_ids, self.settings.scheduler.max_num_batched_tokens)
        vectors = [self.driver.call("embed", batch) for batch in batches]
        return torch.cat(vectors), sum(len(ids) for ids in token_ids)

    def beam_search(
        self, prompt: str | Seq[int], params: BeamSearchParams, search_id: str | None = None, *,
        cache_salt: str | None = None, use_prefix_cache: bool = True,
    ) -> BeamSearchOutput:
        """Beam search, equal to transformers' ``generate(num_beams=params.beam_width, do_sample=False)``.

        The search runs a forward at a time between the engine's steps, so
        other requests keep decoding meanwhile; ``cancel_beam_search(search_id)``
        (from another thread) stops it. The prompt reuses its cached prefix and
        publishes the blocks it computes, as ``submit``'s requests do
        (``cache_salt``, ``use_prefix_cache`` as there). Returns the hypotheses
        (best first) with the search's peak KV blocks, wall time and prefix lookup.

        Raises:
            RequestError: an empty prompt, a backend without a paged KV arena, or
                prompt + max_tokens beyond the context length or beyond what the
                whole KV cache can hold for ``beam_width`` beams.
            QueueFullError: too few KV blocks are free now; retry later.
            RequestError: the search was cancelled.
        """
        from tierserve.engine.beam_search import beam_search_blocks

        info = self.info
        ids = self.encode_prompt(prompt)
        if not ids:
            raise RequestError("prompt: must contain at least one token", param="prompt")
        if not info.paged:
            raise RequestError(
                f"beam_width: beam search needs a paged KV arena, which the {info.backend!r} "
                'backend does not keep; serve the model with model.backend = "auto" (a paged backend)',
                param="beam_width",
            )
        check_fits(len(ids), params.max_tokens, info.max_model_len, None)
        needed = beam_search_blocks(len(ids), params, info.block_size)
        if needed > info.kv_blocks:
            raise RequestError(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) over "
                f"{params.beam_width} beams may need {needed} KV blocks, more than the cache holds "
                f"({info.kv_blocks}); lower max_tokens or beam_width",
                param="max_tokens",
            )
        return self.driver.call("beam_search", ids, params, search_id, cache_salt, use_prefix_cache)

    def cancel_beam_search(self, search_id: str) -> bool:
        """Stop the beam search running under ``search_id`` and free its blocks (False: none runs)."""
        return self.driver.call("cancel_beam_search", search_id)

    # ---- running --------------------------------------------------------------------------

    def start(self) -> None:
        """Run the core on its own (a background thread; a child process already runs)."""
        self.driver.start()

    def step(self) -> None:
        """Run one step on the caller's thread (a core nothing else drives: scripts and tests)."""
        self.driver.step()

    def has_work(self) -> bool:
        return self.driver.has_work()

    @property
    def alive(self) -> bool:
        """Whether the core still runs (a core process can be killed; then every call fails clearly)."""
        return self.driver.alive

    def shutdown(self) -> None:
        """Stop driving the core; every unfinished request ends as aborted."""
        self.driver.shutdown()

    def close(self) -> None:
        """Shut down, flush queued tier writes and release the tiers and the model."""
        self.driver.close()
