"""The client's side of outputs: core token ids in, text deltas and usage out, per request stream.

Detokenization, stop strings and timings happen here, in the process that
serves HTTP, so the engine core only ever deals in token ids. When a stop
string ends a request the core does not know about it: the processor
finishes the stream at once and asks the core to abort the sequence.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from tierserve.engine.detokenizer import IncrementalDetokenizer
from tierserve.engine.profiling import PhaseClock
from tierserve.core.outputs import CoreOutput, RequestCacheInfo, RequestOutput, RequestTimings, TokenLogprob
from tierserve.core.sampling_params import SamplingParams


class RequestStream:
    """Carries a request's deltas to its consumer: an asyncio queue on ``loop``, else a blocking queue.

    ``max_backlog`` bounds an asyncio consumer: once more deltas than that were
    put and not yet taken, ``overflowing`` is true (its reader stopped reading).
    A blocking consumer is not bounded: ``generate`` reads its streams one after another.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None, max_backlog: int | None = None) -> None:
        self._loop = loop
        self._async: asyncio.Queue[RequestOutput] | None = asyncio.Queue() if loop else None
        self._sync: queue.SimpleQueue[RequestOutput] | None = None if loop else queue.SimpleQueue()
        self.max_backlog = max_backlog if loop else None
        # two counters, each written by one thread only, so no lock is needed to compare them
        self._put = 0
        self._taken = 0

    @property
    def overflowing(self) -> bool:
        """More than ``max_backlog`` deltas wait for a consumer that is not taking them."""
        return self.max_backlog is not None and self._put - self._taken > self.max_backlog

    def put(self, output: RequestOutput) -> None:
        self._put += 1
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, output)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass
        else:
            self._sync.put(output)

    async def get_async(self) -> RequestOutput:
        output = await self._async.get()
        self._taken += 1
        return output

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next delta; ``queue.Empty`` after ``timeout`` seconds."""
        return self._sync.get(timeout=timeout)


@dataclass(slots=True, eq=False)
class RequestState:
    """What the client keeps for a request in flight."""

    request_id: str
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    params: SamplingParams
    num_prompt_tokens: int
    arrival_time: float
    spec_method: str | None = None
    error: tuple[str, str | None] | None = None  # the core failed the request: CoreOutput.error, error_param
    num_output_tokens: int = 0
    first_token_time: float | None = None
    cache: RequestCacheInfo | None = None
    last: CoreOutput | None = None  # the latest core record (its running counters)


class OutputProcessor:
    """Turns ``CoreOutput`` records into each request's ``RequestOutput`` deltas.

    Args:
        eos_token_ids: the model's eos ids (a "stop" on one of them emits no text).
        kv_block_bytes: bytes per KV block, for the reported peak KV memory.
        abort_in_core: called with a request id the client ended on its own, and the reason the core
            should record: ``"stop"`` (a stop string) or ``"abort"`` (a stream whose reader stopped reading).
        clock: times each round of ``process`` as the ``detokenize`` phase
            (``[monitoring] detailed_profiling``), or ``None``.
    """

    def __init__(
        self,
        eos_token_ids: Collection[int],
        kv_block_bytes: int,
        abort_in_core: Callable[[str, str], None],
        clock: PhaseClock | None = None,
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.kv_block_bytes = kv_block_bytes
        self.abort_in_core = abort_in_core
        self.clock = clock
        self.requests: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state

    def process(self, outputs: list[CoreOutput]) -> None:
        if self.clock is not None and outputs:
            started = time.perf_counter()
            self._process_all(outputs)
            self.clock.observe("detokenize", time.perf_counter() - started)
        else:
            self._process_all(outputs)

    def _process_all(self, outputs: list[CoreOutput]) -> None:
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is not None:
                self._process_one(state, output)

    def fail(self, request_id: str, failure: Exception | None = None) -> None:
        """End a request that the core will never answer (its core is gone); its reader raises ``failure``."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            output = self._delta(state, "", [], "abort", None)
            output.failure = failure
            state.stream.put(output)

    def _process_one(self, state: RequestState, output: CoreOutput) -> None:
        state.last = output
        if output.cache is not None:
            state.cache = output.cache
        params = state.params
        detokenizer = state.detokenizer
        texts: list[str] = []
        tokens: list[int] = []
        reason: str | None = None
        new = output.new_token_ids
        for index, token in enumerate(new):
            if state.first_token_time is None:
                state.first_token_time = time.monotonic()
            tokens.append(token)
            core_reason = output.finish_reason if index == len(new) - 1 else None
            if core_reason == "stop" and (
                (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
            ):
                reason = "stop"  # the stop token's text is not part of the output
                break
            delta = detokenizer.add([token])
            texts.append(delta.text)
            if delta.stopped:
                reason = "stop"
                break
            reason = core_reason
        state.num_output_tokens += len(tokens)
        if reason is not None and detokenizer.stop_reason is None:
            texts.append(detokenizer.flush())
            if detokenizer.stop_reason is not None:  # held-back text completed a stop string
                reason = "stop"
        if reason is None and not new and output.finish_reason is not None:
            reason = output.finish_reason  # ended without a token: aborted, or a window that could not recompute
        state.error = (output.error, output.error_param) if output.error is not None else None
        logprobs = output.logprobs[: len(tokens)] if output.logprobs is not None else None
        if reason is None:
            state.stream.put(self._delta(state, "".join(texts), tokens, None, logprobs, output.prompt_logprobs))
            if state.stream.overflowing:  # nobody reads: free the engine instead of queueing without end
                self.abort_in_core(state.request_id, "abort")
                self._finish(state, "", [], "abort", None)
            return
        if output.finish_reason is None:
            self.abort_in_core(state.request_id, "stop")  # a stop string: the core would go on
        self._finish(state, "".join(texts), tokens, reason, logprobs, output.prompt_logprobs)

    def _finish(
        self, state: RequestState, text: str, tokens: list[int], reason: str, logprobs: list[TokenLogprob] | None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        del self.requests[state.request_id]
        state.stream.put(self._delta(state, text, tokens, reason, logprobs, prompt_logprobs))

    def _delta(
        self, state: RequestState, text: str, tokens: list[int], reason: str | None, logprobs: list[TokenLogprob] | None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        cached = state.cache.cached_tokens if state.cache is not None else 0
        timings = None
        if reason is not None:
            timings = self._timings(state)
        return RequestOutput(
            request_id=state.request_id,
            text=text,
            token_ids=tokens,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=state.num_prompt_tokens,
            completion_tokens=state.num_output_tokens,
            cached_tokens=cached,
            logprobs=logprobs,
            timings=timings,
            cache=state.cache if reason is not None else None,
            speculation_method=state.spec_method,
            error=state.error[0] if reason is not None and state.error else None,
            error_param=state.error[1] if reason is not None and state.error else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _timings(self, state: RequestState) -> RequestTimings:
        now = time.monotonic()
        last = state.last
        scheduled = last.first_scheduled_time if last is not None and last.first_scheduled_time else now
        return RequestTimings(
            queued=scheduled - state.arrival_time,
            cache_lookup=state.cache.lookup_seconds if state.cache is not None else 0.0,
            inference=now - scheduled,
            time_to_first_token=(state.first_token_time - state.arrival_time) if state.first_token_time else None,
            peak_kv_bytes=(last.peak_blocks if last is not None else 0) * self.kv_block_bytes,
            accepted_drafts=last.accepted_drafts if last is not None else 0,
            windows_slid=last.windows_slid if last is not None else 0,
        )
