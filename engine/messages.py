"""What travels between an ``EngineClient`` and its engine core, in either direction.

    client ──► core:  EngineRequest | Abort | Call | Shutdown
    core ──► client:  ModelInfo (once, at start) | StepOutputs | CallResult

Every message is a plain picklable dataclass, so the same protocol runs over
an in-process queue or a pipe to a child process.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tierserve.engine.stats import EngineSnapshot
from tierserve.core.outputs import CoreOutput


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The static facts about the served model the client needs (it never looks inside the core)."""

    path: str  # the checkpoint directory (the client loads the tokenizer from it)
    backend: str
    device: str
    dtype: str
    fingerprint: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    paged: bool
    block_size: int
    kv_blocks: int
    kv_block_bytes: int
    tier_names: tuple[str, ...]  # ("l1", ...) when prefix caching is on, else ()
    speculator: str | None  # the configured speculation method, if any
    fallback_speculator: str | None  # what a request asking for speculation gets when none is configured
    supports_streaming_window: bool
    attention_kernel: str  # e.g. "flash/math (torch picks)", or "math" ([sliding_window] use_flash_attention = false)
    quantization: str = "none"  # model.quantization
    linear_kernel: str = "unreported"  # e.g. "onednn", "int8-fbgemm"
    kv_dtype: str = ""  # how the KV arena holds keys and values (kv_cache.dtype resolved)
    key_max_pinned_bytes: int = 0  # the most KV one cache_key may pin; 0: cache keys unavailable (no prefix cache)
    lora_slots: int = 0  # model.max_loras where the backend runs adapters; 0: LoRA off
    loras: dict[str, dict[str, object]] = field(default_factory=dict)  # adapters loaded at start: name -> description

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks * self.block_size


@dataclass(slots=True)
class Abort:
    """End these requests and free their blocks (unknown ids are ignored).

    ``reason`` is ``"abort"`` (client gone, cancelled) or ``"stop"`` (the client
    found a stop string: the request ended normally, the core just did not know).
    """

    request_ids: list[str]
    reason: str = "abort"


@dataclass(slots=True)
class Call:
    """Run ``EngineCore.<method>(*args)`` between steps and answer with a ``CallResult``."""

    call_id: int
    method: str
    args: tuple[Any, ...] = ()


@dataclass(slots=True)
class Deferred:
    """A call's answer that waits for something off the step thread (queued tier writes to be stored): the
    loop answers once ``ready()`` says so (``result()``), running steps meanwhile instead of blocking them."""

    ready: Callable[[], bool]
    result: Callable[[], Any]
    busy: bool = False  # ``ready`` does work each time (a beam search's slice): the loop comes back at once

    def wait(self, poll: float = 0.005) -> Any:
        """The answer, waited for here (a caller that drives the core itself)."""
        while not self.ready():
            time.sleep(poll)
        return self.result()


@dataclass(slots=True)
class CallResult:
    call_id: int
    value: Any = None
    error: BaseException | None = None


class PendingCalls:
    """The futures of calls sent to a core, by call id: a caller waits on one, whoever reads the core's answers resolves it."""

    def __init__(self) -> None:
        self._futures: dict[int, Future] = {}
        self._ids = itertools.count()

    def new(self, method: str, args: tuple[Any, ...]) -> tuple[Call, Future]:
        """A ``Call`` message to send, and the future its ``CallResult`` will settle."""
        call = Call(next(self._ids), method, args)
        future: Future = Future()
        self._futures[call.call_id] = future
        return call, future

    def resolve(self, result: CallResult) -> None:
        future = self._futures.pop(result.call_id)
        if result.error is not None:
            future.set_exception(result.error)
        else:
            future.set_result(result.value)

    def fail_all(self, error: BaseException) -> None:
        """Settle every call still waiting with ``error`` (the core is gone)."""
        futures, self._futures = self._futures, {}
        for future in futures.values():
            future.set_exception(error)


@dataclass(slots=True)
class Shutdown:
    """Abort everything, flush the tiers, release the model, and stop."""


@dataclass(slots=True)
class StepOutputs:
    """What one round of the core loop produced.

    Attributes:
        outputs: per-request records of this round (steps, aborts, refused adds).
        snapshot: fresh statistics, when the round published some.
        num_added: requests the core took off its queue this round.
        requests_waiting: the scheduler's waiting queue after the round (back-pressure).
    """

    outputs: list[CoreOutput] = field(default_factory=list)
    snapshot: EngineSnapshot | None = None
    num_added: int = 0
    requests_waiting: int = 0


@dataclass(slots=True)
class LoadFailed:
    """The core could not be built (sent instead of ``ModelInfo``)."""

    error: str
