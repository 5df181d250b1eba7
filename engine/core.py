"""The engine core: one step at a time, three calls, on one thread (or in its own process).

    step():  batch  = scheduler.schedule()                    which tokens of which sequences, KV slots allocated
             result = runner.execute(batch)                   forward, sampling, draft verification, next drafts
             outputs = scheduler.update_from_output(batch, result)   append, stop checks, free, publish blocks

Everything else arrives between steps as a command from the client: add,
abort, cache management, embeddings, beam search. Nothing here is touched
by any other thread, so nothing needs a lock.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import structlog
import torch

from tierserve.cache.warm_writes import WarmWrites
from tierserve.engine.messages import Deferred
from tierserve.engine.profiling import PhaseClock, core_timings
from tierserve.engine.requests import EngineRequest, RequestError
from tierserve.engine.runner import ModelRunner
from tierserve.engine.stats import EngineCounters, EngineSnapshot, SpeculationSnapshot, WindowSnapshot
from tierserve.core.outputs import CoreOutput
from tierserve.core.scheduler import QueueFullError, Scheduler
from tierserve.core.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    from tierserve.cache.frequency import PrefixUse
    from tierserve.cache.kv_events import KVEvents
    from tierserve.cache.named_prefixes import Key, NamedPrefix, NamedPrefixes
    from tierserve.cache.store import TieredStore
    from tierserve.core.batch import SchedulerOutput
    from tierserve.engine.beam_search import BeamSearch, BeamSearchParams
    from tierserve.settings.config import Settings
    from tierserve.cache.figures import FigureSource
    from tierserve.core.sampling_params import SamplingParams

log = structlog.get_logger(__name__)

KEY_EXPIRY_INTERVAL_SECONDS = 1.0  # how often the step loop unpins cache keys past their TTL
LOAD_POLL_SECONDS = 0.005  # an idle step waits this long at most for a prompt prefix being read below L1


def raised_in(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost frame's module and qualified name (which plugin's code, when a
    scheduler's step calls into an eviction policy of another plugin)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "an unknown place"
    frame = tb.tb_frame
    return f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_qualname}"


def mixed_seed(seed: int) -> int:
    """``seed`` (64 bits) through splitmix64's finalizer: torch's CPU generator keeps only a seed's low 32 bits,
    so seeds that differ above them (s and s + 2**32, s and s + 2**63) drew the same numbers; mixed, every bit
    of the seed moves the low 32."""
    z = (seed + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


class EngineCore:
    """Requests, a scheduler (which owns the KV manager) and a model runner, stepped together.

    Args:
        settings: all settings (budgets, speculation and window defaults).
        scheduler: the scheduler plugin, already holding its ``KVCacheManager``.
        runner: the model runner over the backend (and speculator).
        store: the tiered prefix store, or ``None`` when prefix caching is off.
        clock: the phase clock the runner shares (``[monitoring] detailed_profiling``), or ``None``.
        keys: the registry of named prefixes (requests' ``cache_key``), or ``None`` without a store.
    """

    def __init__(
        self,
        settings: Settings,
        scheduler: Scheduler,
        runner: ModelRunner,
        store: TieredStore | None = None,
        clock: PhaseClock | None = None,
        keys: NamedPrefixes | None = None,
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.phase = "engine"  # the part of a step running: "scheduler", "backend" (the model runner), "engine"
        self.runner = runner
        self.store = store
        self.clock = clock
        self.keys = keys
        self.figure_sources: list[FigureSource] = []  # components publishing figures of their own (engine.builder sets them)
        self._keyed: dict[str, Key] = {}  # request id -> the cache key it registers when it ends normally
        self._warms: dict[str, WarmWrites] = {}  # prompt warms in progress, until finish_warm
        self._beams: dict[str, BeamSearch] = {}  # beam searches running between steps, by search id
        self._keys_expired_at = 0.0
        self.kv = scheduler.kv
        self.counters = EngineCounters()
        self.requests: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._rng = random.Random(settings.model.seed)  # seeds requests that bring no seed of their own
        scheduler.on_release = runner.release
        self.loras: dict[str, dict[str, object]] = {}  # loaded LoRA adapters: name -> what load_lora returned
        self._lora_users: dict[str, int] = {}  # adapter -> sequences running or waiting with it
        self._lora_draining: set[str] = set()  # unloaded adapters whose slot frees when their last sequence ends

    @property
    def backend(self):
        return self.runner.backend

    # ---- requests ------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> list[CoreOutput]:
        """Queue a request; a full queue or a duplicate id ends it at once (an ``abort`` output)."""
        if request.request_id in self.requests:
            log.warning("request_id_in_flight", request_id=request.request_id)
            return [CoreOutput(request.request_id, [], FinishReason.ABORT.value)]
        salt = request.cache_salt
        if request.lora_name is not None:
            adapter = self.loras.get(request.lora_name)
            if adapter is None:  # unloaded after the client accepted the request
                return [CoreOutput(request.request_id, [], FinishReason.ABORT.value)]
            # no prefix is shared across adapters: the adapter's weights change every block's KV
            salt = f"{salt or ''}\0lora:{request.lora_name}:{adapter['fingerprint']}"
        seq = Sequence(
            seq_id=self.next_seq_id(),
            request_id=request.request_id,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            params=request.params,
            priority=request.priority,
            arrival_time=request.arrival_time,
            generator=self._generator(request.params),
            cache_salt=salt,
            lora_name=request.lora_name,
            use_prefix_cache=request.use_prefix_cache,
            spec_method=request.spec_method,
            spec_k=self.runner.max_draft_tokens,
            streaming=request.streaming,
            window_size=request.window_size,
        )
        if request.params.grammar is not None:
            try:
                seq.grammar = self.runner.grammar.matcher(request.params.grammar)
            except Exception as exc:  # the client compiled it already; a tokenizer-specific failure ends it here
                log.warning("grammar_refused", request_id=request.request_id, error=str(exc))
                return [CoreOutput(request.request_id, [], FinishReason.ABORT.value)]
        if request.warm is not None and self.store is not None:
            timeout = self.settings.kv_cache.warm_write_timeout_seconds
            seq.warm_writes = self._warms.setdefault(request.warm, WarmWrites(timeout))
        try:
            self.scheduler.add(seq)
        except QueueFullError:
            return [CoreOutput(request.request_id, [], FinishReason.ABORT.value)]
        self.requests[request.request_id] = seq
        if seq.lora_name is not None:
            self._lora_users[seq.lora_name] = self._lora_users.get(seq.lora_name, 0) + 1
        if request.cache_key is not None and self.keys is not None:
            self._keyed[request.request_id] = (request.cache_namespace, request.cache_key)
        self.counters.requests_added += 1
        self.counters.prompt_tokens += seq.num_prompt_tokens
        return []

    def abort(
        self, request_ids: Iterable[str], reason: FinishReason = FinishReason.ABORT, error: str | None = None
    ) -> list[CoreOutput]:
        """End requests now and free their blocks (unknown or finished ids are ignored).

        ``reason`` is ``STOP`` when the client ended the request itself (a stop string); ``error``: the engine
        failed them (``CoreOutput.error``).
        """
        outputs = []
        for request_id in request_ids:
            seq = self.requests.pop(request_id, None)
            if seq is None or seq.is_finished:
                continue
            try:
                self.scheduler.finish_sequence(seq, reason)
            except Exception:  # noqa: BLE001 - a plugin raising as the blocks are freed: the request ends anyway
                log.exception("request_end_failed", request_id=request_id, part=self.phase)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            self._ended(seq, reason.value)
            if reason is FinishReason.ABORT:
                self.counters.requests_aborted += 1
            self.counters.requests_finished += 1
            outputs.append(CoreOutput(request_id, [], reason.value, error=error))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[CoreOutput]:
        """One schedule → execute → update round; the outputs of every request it advanced."""
        if self.clock is not None:
            batch, outputs = self._profiled_round()
        else:
            self.phase = "scheduler"
            batch = self.scheduler.schedule()
            self.phase = "backend"
            result = self.runner.execute(batch)
            self.phase = "scheduler"
            outputs = self.scheduler.update_from_output(batch, result)
        self.phase = "engine"
        if not batch.is_empty:
            self.counters.steps += 1
        else:  # nothing could run: perhaps prompts whose prefixes are being read below L1; wait, do not spin
            self.kv.wait_for_loads(LOAD_POLL_SECONDS)
        for output in outputs:
            if output.finish_reason is not None:
                seq = self.requests.pop(output.request_id, None)
                if seq is not None:
                    self._ended(seq, output.finish_reason)
                self.counters.requests_finished += 1
        if self.keys is not None and time.monotonic() - self._keys_expired_at >= KEY_EXPIRY_INTERVAL_SECONDS:
            self._keys_expired_at = time.monotonic()
            self.keys.expire(time.time())
        return outputs

    def _ended(self, seq: Sequence, finish_reason: str) -> None:
        """A keyed request that ended normally names its prompt's full blocks (counting its hit
        first when the key is known); an aborted one registers nothing. The last sequence of a
        draining LoRA adapter frees its slot."""
        if seq.lora_name is not None:
            left = self._lora_users[seq.lora_name] - 1
            self._lora_users[seq.lora_name] = left
            if left == 0:
                del self._lora_users[seq.lora_name]
                if seq.lora_name in self._lora_draining:
                    self._lora_draining.discard(seq.lora_name)
                    self.backend.unload_lora(seq.lora_name)
                    log.info("lora_unloaded", lora_name=seq.lora_name)
        key = self._keyed.pop(seq.request_id, None)
        if key is None or self.keys is None or finish_reason not in ("stop", "length"):
            return
        now = time.time()
        hit_blocks = seq.cache_info.hit_blocks if seq.cache_info is not None else 0
        self.keys.use(*key, hit_blocks, now)
        blocks = seq.block_hashes[: seq.num_prompt_tokens // self.kv.block_size]
        try:
            self.keys.register(*key, blocks, now)
        except ValueError as exc:  # the client checks the cap first; a changed cap lands here
            log.warning("cache_key_not_registered", cache_key=key[1], reason=str(exc))

    # ---- named prefixes (cache_key) -----------------------------------------------------

    def list_cache_keys(self, namespace: str | None = None) -> list[NamedPrefix]:
        """The named prefixes of one namespace (``None``: all), with where their blocks are now."""
        if self.keys is None:
            return []
        self.keys.expire(time.time())
        return self.keys.list(namespace)

    def delete_cache_key(self, namespace: str, name: str) -> bool:
        """Unpin a named prefix and evict the blocks no other key pins; False for an unknown key."""
        return self.keys.delete(namespace, name) if self.keys is not None else False

    def top_prefixes(self, limit: int) -> list[PrefixUse]:
        """The cached prefixes used most (every tier counted), best first; none without prefix caching."""
        return self.store.top_prefixes(limit) if self.store is not None else []

    def kv_events(self, epoch: str | None, seq: int) -> KVEvents | None:
        """The blocks stored in and removed from L1 and the private tiers after batch ``seq`` of ``epoch``, or a
        snapshot to start over from (``cache.kv_events``); None without prefix caching."""
        return self.store.events.since(epoch, seq) if self.store is not None else None

    def warm_frequent(self, limit_blocks: int) -> Deferred:
        """Promote the most used cached prefixes into the faster tiers (at most ``limit_blocks`` blocks); the
        report comes once the writes it queued are stored (at most ``warm_write_timeout_seconds``), waited for
        off the step: steps run meanwhile."""
        if self.store is None:
            raise RequestError("warm: prefix caching is off (kv_cache.enable_prefix_caching)", param="prompts")
        report = self.store.warm_frequent(limit_blocks)
        return self._once_stored(self.settings.kv_cache.warm_write_timeout_seconds, lambda: report)

    def _once_stored(self, timeout: float | None, result: Callable[[], Any]) -> Deferred:
        """``result()`` once every queued tier write is stored, or ``timeout`` seconds from now."""
        store = self.store
        deadline = None if timeout is None else time.monotonic() + timeout
        return Deferred(lambda: store.writes_stored() or (deadline is not None and time.monotonic() >= deadline),
                        result)  # fmt: skip

    def _profiled_round(self) -> tuple[SchedulerOutput, list[CoreOutput]]:
        """``step``'s three calls, timed: scheduler work less prefix matching, and prefix matching
        (the store's own lookup clock, so nothing here times a lookup twice); the runner times the rest."""
        clock = self.clock
        looked_up = self._lookup_seconds()
        started = time.perf_counter()
        self.phase = "scheduler"
        batch = self.scheduler.schedule()
        scheduled = time.perf_counter()
        self.phase = "backend"
        result = self.runner.execute(batch)
        executed = time.perf_counter()
        self.phase = "scheduler"
        outputs = self.scheduler.update_from_output(batch, result)
        lookup = self._lookup_seconds() - looked_up
        clock.observe("schedule", (scheduled - started) + (time.perf_counter() - executed) - lookup)
        if lookup:
            clock.observe("cache_lookup", lookup)
        return batch, outputs

    def _lookup_seconds(self) -> float:
        return self.store.stats.lookup_seconds if self.store is not None else 0.0

    def fail_all(self, exc: BaseException | None = None) -> list[CoreOutput]:
        """After a step failed (``exc``), end every request rather than leave clients waiting; each is told
        which plugin raised (the part of the step that was running) and what."""
        error = None
        if exc is not None:
            owner = {"scheduler": self.scheduler, "backend": self.backend}.get(self.phase)
            where = f"the {self.phase} plugin {type(owner).__module__}.{type(owner).__name__}" if owner else "the engine"
            error = (f"{where} raised {type(exc).__name__}: {str(exc)[:200]} (in {raised_in(exc)}); every request "
                     "of that step was ended (the server log has the traceback)")  # fmt: skip
        return self.abort(list(self.requests), error=error)

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        generator = torch.Generator(device=self.backend.device)
        seed = params.seed % 2**64 if params.seed is not None else self._rng.getrandbits(64)
        generator.manual_seed(mixed_seed(seed))
        return generator

    # ---- commands (between steps) ----------------------------------------------------

    def load_lora(self, name: str, path: str) -> dict[str, object]:
        """Load a LoRA adapter under ``name`` (``RequestError`` when it cannot be); returns its description."""
        if name in self.loras:
            raise RequestError(f"lora_name: an adapter named {name!r} is already loaded", param="lora_name")
        if name in self._lora_draining:
            raise RequestError(
                f"lora_name: {name!r} is still unloading ({self._lora_users.get(name, 0)} requests finishing); retry",
                param="lora_name",
            )
        info = self.backend.load_lora(name, path)
        self.loras[name] = info
        log.info("lora_loaded", lora_name=name, path=str(info.get("path")), rank=info.get("rank"))
        return info

    def unload_lora(self, name: str) -> int:
        """Stop accepting requests for an adapter; its slot frees once the requests using it end.
        Returns how many are still running (0: freed now). ``RequestError`` for an unknown name."""
        if self.loras.pop(name, None) is None:
            raise RequestError(
                f"lora_name: no adapter named {name!r} is loaded (loaded: {', '.join(sorted(self.loras)) or 'none'})",
                param="lora_name",
                code="lora_not_found",
            )
        running = self._lora_users.get(name, 0)
        if running:
            self._lora_draining.add(name)
        else:
            self.backend.unload_lora(name)
            log.info("lora_unloaded", lora_name=name)
        return running

    def clear_cache(self, tier: str = "all") -> dict[str, int]:
        """Drop cached prefixes of one tier or ``all``; blocks in use keep their data."""
        if self.store is None:
            return {}
        try:
            return self.store.clear(tier)
        except ValueError as exc:
            raise RequestError(str(exc), param="tiers") from None

    def offload_cache(self) -> int:
        """Move idle L1 prefix blocks down a tier, freeing the live pool; returns blocks moved."""
        return self.store.offload() if self.store is not None else 0

    def flush_cache(self) -> Deferred | None:
        """Answers once queued tier writes are stored (waited for off the step: steps run meanwhile)."""
        if self.store is not None:
            return self._once_stored(None, lambda: None)
        return None

    def finish_warm(self, warm: str) -> dict[str, dict[str, int]] | Deferred:
        """After a prompt warm's requests ended: what became of its writes, per write-through tier, once the
        queued tier writes are stored or what is left of its time is over (waited for off the step)."""
        writes = self._warms.pop(warm, None)
        if self.store is None:
            return {}
        if writes is None:  # none of its requests computed anything here
            writes = WarmWrites(self.settings.kv_cache.warm_write_timeout_seconds)
        names = self.store.write_through_names
        return self._once_stored(max(0.0, writes.wait_seconds), lambda: writes.report(names))

    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """Embeddings of token id lists (each attends to itself only; no KV is read or kept)."""
        return self.backend.embed(batch).cpu()

    def beam_search(
        self, prompt_ids: list[int], params: BeamSearchParams, search_id: str | None = None,
        cache_salt: str | None = None, use_prefix_cache: bool = True,
    ) -> Deferred:
        """A beam search, answered when it is done: the loop runs it a forward at a time between steps, so running
        generations go on meanwhile; ``cancel_beam_search(search_id)`` stops it (its client left). Its prompt
        reuses and publishes cached prefixes as a request's does (``cache_salt``, ``use_prefix_cache``)."""
        from tierserve.engine.beam_search import BeamSearch

        search = BeamSearch(
            self.backend, self.kv, prompt_ids, params, self.backend.eos_token_ids,
            prefill_budget=self.settings.scheduler.max_num_batched_tokens, new_seq_id=self.next_seq_id,
            cache_salt=cache_salt, use_prefix_cache=use_prefix_cache,
        )  # fmt: skip
        search_id = search_id or f"beam-{self.next_seq_id()}"
        self._beams[search_id] = search
        self.counters.prompt_tokens += len(prompt_ids)  # as a request's: its lookup counts in the cached tokens

        def ready() -> bool:
            try:
                done = search.advance()
            except BaseException:
                self._beams.pop(search_id, None)
                raise
            deferred.busy = not search.loading  # a prefix read below L1 is polled, not spun on
            if done:
                self._beams.pop(search_id, None)
                if not search.cancelled:
                    self._count_beam_search(search)
            return done

        deferred = Deferred(ready, search.result, busy=True)
        return deferred

    def _count_beam_search(self, search: BeamSearch) -> None:
        output, counters = search.result(), self.counters
        counters.beam_searches += 1
        counters.beams += search.params.beam_width
        counters.beam_tokens_generated += search.params.beam_width * output.steps
        counters.beam_early_stops += output.stopped_early

    def cancel_beam_search(self, search_id: str) -> bool:
        """Stop a running beam search and free its blocks; False if none runs under ``search_id``."""
        search = self._beams.pop(search_id, None)
        if search is None:
            return False
        search.cancel()
        log.info("beam_search_cancelled", search_id=search_id)
        return True

    def check_integrity(self) -> None:
        """The pool's, index's and tiers' invariants (``AssertionError`` on a violation)."""
        if self.store is not None:
            self.store.check_integrity()
        else:
            self.kv.pool.check_integrity()

    def snapshot(self) -> EngineSnapshot:
        """Every statistic, O(1) to build: what the client publishes to the server."""
        sched = self.scheduler.stats
        counters = self.counters
        counters.generation_tokens = sched.generation_tokens
        counters.preemptions = sched.preemptions
        counters.finish_reasons = dict(sched.finish_reasons)
        spec = self.settings.speculative
        return EngineSnapshot(
            created=time.time(),
            cache=self.store.snapshot() if self.store is not None else None,
            speculation=SpeculationSnapshot.of(
                spec.method is not None, spec.method, self.runner.spec_stats, sched.early_stops
            ),
            sliding_window=self._window_snapshot(),
            counters=EngineCounters(**{name: getattr(counters, name) for name in EngineCounters.__slots__}),
            requests_running=self.scheduler.num_running,
            requests_waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_free=self.kv.num_free_blocks,
            kv_block_size=self.kv.block_size,
            kv_block_bytes=self.kv.spec.block_bytes,
            kv_blocks_empty=self.kv.pool.num_empty_blocks,
            kv_blocks_pinned=self.kv.pool.num_pinned_idle_blocks,
            sharing_hits=self.kv.sharing.sharing_hits,
            profiling=core_timings(self.clock) if self.clock is not None else None,
            cache_keys=len(self.keys) if self.keys is not None else 0,
            cache_keys_pinned_bytes=self.keys.pinned_bytes if self.keys is not None else 0,
            plugin_figures=[source.read() for source in self.figure_sources],
            kv_events_recorded=self.store.events.recorded if self.store is not None else 0,
            kv_events_epoch=self.store.events.epoch if self.store is not None else None,
        )

    def _window_snapshot(self) -> WindowSnapshot:
        kv = self.kv
        stats = kv.window_stats
        windowed = [seq for seq in self.requests.values() if seq.block_table and kv.windowed(seq)]
        held = sum(kv.held_blocks(seq) for seq in windowed)
        allowed = sum(kv.window_blocks(seq) for seq in windowed)
        return WindowSnapshot(
            self.settings.sliding_window.enabled,
            stats.windows_slid,
            stats.tokens_dropped,
            stats.blocks_released,
            kv.pool.num_used_blocks,
            stats.cache_hits,
            stats.cache_misses,
            held * kv.spec.block_bytes,
            round(held / allowed, 4) if allowed else 0.0,
        )

    def close(self) -> None:
        """Abort what runs, flush queued tier writes, release the tiers and the model."""
        self.fail_all()
        if self.store is not None:
            self.store.close()
        self.runner.close()
