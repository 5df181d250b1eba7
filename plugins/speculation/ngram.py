"""``ngram``: prompt-lookup decoding. Find the latest earlier occurrence of the sequence's last n
tokens (n from ``max_n`` down to ``min_n``, ``[plugins.ngram]``) and propose the tokens that followed it."""

from __future__ import annotations

from array import array

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tierserve.core.hookspecs import hookimpl
from tierserve.core.speculation import Proposal, Speculator


class NgramSettings(BaseModel):
    """``[plugins.ngram]``: the n-gram lengths matched, longest first."""

    model_config = ConfigDict(extra="forbid")

    min_n: int = Field(1, ge=1, description="shortest suffix n-gram looked up")
    max_n: int = Field(4, ge=1, description="longest suffix n-gram looked up (tried first)")

    @model_validator(mode="after")
    def _ordered(self) -> NgramSettings:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


def lookup(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """``k`` tokens continuing the latest earlier match of the longest suffix n-gram
    (what followed it, then what followed that, as a repeating text would go on)."""
    if len(tokens) < 2:
        return []
    packed = array("i", tokens).tobytes()  # searched in C: 4 bytes per token
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        pattern = packed[-4 * n :]
        end = len(packed) - 4  # an earlier match ends at least one token before the end
        while True:
            at = packed.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                # continue the copy past the end with its own output: a loop of
                # period d keeps proposing k tokens even when the match is recent
                history = list(tokens)
                start = at // 4 + n
                for offset in range(k):
                    history.append(history[start + offset])
                return history[len(tokens) :]
            end = at + 4 * n - 1  # a match across token boundaries: look further left
    return []


class NgramSpeculator(Speculator):
    """Deterministic drafts from the sequence's own history; no extra model, no extra memory."""

    def __init__(self, settings, target) -> None:
        super().__init__(settings, target)
        options = settings.plugin_options("ngram", NgramSettings)
        self.ngram_min, self.ngram_max = options.min_n, options.max_n

    def propose(self, requests):
        return [Proposal(lookup(r.token_ids, self.ngram_min, self.ngram_max, r.num_tokens)) for r in requests]


@hookimpl
def register_speculators(register):
    register(
        "ngram",
        NgramSpeculator,
        settings=NgramSettings,
        aliases={"speculative.ngram_min": "min_n", "speculative.ngram_max": "max_n"},
        description="prompt lookup: propose what followed the last n-gram earlier",
    )
