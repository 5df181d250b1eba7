"""Per-request sampling parameters, validated with errors that name the field and the allowed values."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from tierserve.core.errors import RequestError
from tierserve.core.grammar import GrammarSpec


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``logprobs=None`` returns none,
    ``0`` the chosen token's, ``N`` also the top ``N`` alternatives.
    ``prompt_logprobs``: the same for every prompt token after the first (the
    model's raw distribution at the position before it); ``max_tokens`` may
    then be 0, to score the prompt and generate nothing.
    ``min_tokens``: eos (unless ``ignore_eos``) and ``stop_token_ids`` cannot be
    sampled before that many output tokens (stop strings still apply).
    ``logit_bias``: token id -> value added to its logit (OpenAI's, -100 to
    100; the engine checks the ids against the vocabulary).
    ``stop_token_ids`` becomes a frozenset, so the per-token stop check is O(1).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: Collection[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # the output must match it (constrained decoding)

    MAX_LOGPROBS = 20
    # every list is walked on the engine's step thread, which all running requests share
    MAX_STOP = 16
    MAX_STOP_CHARS = 256
    MAX_STOP_TOKEN_IDS = 1024
    MAX_LOGIT_BIAS = 1024
    MAX_BIAS = 100.0

    def __post_init__(self) -> None:
        self.validate()
        self.stop_token_ids = frozenset(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise ``RequestError`` (a ``ValueError``) naming the field and the allowed values, for any value out of range."""

        def bad(name: str, allowed: str) -> RequestError:
            return RequestError(f"{name}: got {getattr(self, name)!r}, allowed: {allowed}", param=name)

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if self.max_tokens < 1 and not (self.max_tokens == 0 and self.prompt_logprobs is not None):
            raise bad("max_tokens", "an integer >= 1, or 0 with prompt_logprobs (score the prompt only)")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "0 (greedy) to 100")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "greater than 0 and at most 1")
        if self.top_k < -1:
            raise bad("top_k", "-1 or 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "0 to 1")
        if not 0.01 <= self.repetition_penalty <= 10.0:
            # a penalty near 0 divides logits into inf/NaN and would poison the shared step
            raise bad("repetition_penalty", "0.01 to 10 (1 = off)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "-2 to 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "-2 to 2")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            # a torch generator takes a 64-bit seed; a larger one raised inside the engine step
            raise bad("seed", "an integer from -2**63 to 2**64 - 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise bad("logprobs", f"0 to {self.MAX_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"0 to {self.MAX_LOGPROBS}")
        if len(self.stop) > self.MAX_STOP:
            raise RequestError(f"stop: {len(self.stop)} strings, allowed: at most {self.MAX_STOP}", param="stop")
        if any(not isinstance(s, str) or not s or len(s) > self.MAX_STOP_CHARS for s in self.stop):
            raise bad("stop", f"non-empty strings of at most {self.MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            message = f"stop_token_ids: {len(self.stop_token_ids)} ids, allowed: at most {self.MAX_STOP_TOKEN_IDS}"
            raise RequestError(message, param="stop_token_ids")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "non-negative token ids")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"0 to max_tokens ({self.max_tokens})")
        if self.grammar is not None and self.ignore_eos:
            raise RequestError(
                f"ignore_eos: a constrained output ({self.grammar.param}) ends where its grammar does; "
                "send it without ignore_eos", param="ignore_eos",
            )  # fmt: skip
        if self.grammar is not None and self.min_tokens:
            raise RequestError(
                f"min_tokens: a constrained output ({self.grammar.param}) ends where its grammar does; "
                "send it without min_tokens", param="min_tokens",
            )  # fmt: skip
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            message = f"logit_bias: {len(self.logit_bias)} entries, allowed: at most {self.MAX_LOGIT_BIAS}"
            raise RequestError(message, param="logit_bias")
        for token, value in self.logit_bias.items():
            if not is_int(token) or token < 0:
                message = f"logit_bias: token id {token!r}, allowed: non-negative token ids"
                raise RequestError(message, param="logit_bias")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or abs(value) > self.MAX_BIAS:
                raise RequestError(
                    f"logit_bias: {value!r} for token {token}, allowed: -{self.MAX_BIAS:g} to {self.MAX_BIAS:g}",
                    param="logit_bias",
                )
