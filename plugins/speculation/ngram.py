"""``ngram``: prompt-lookup decoding. Find the latest earlier occurrence of the sequence's last n
tokens (n from ``ngram_max`` down to ``ngram_min``) and propose the tokens that followed it."""

from __future__ import annotations

from array import array

from tierserve.core.hookspecs import hookimpl
from tierserve.core.speculation import Proposal, Speculator


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
        spec = settings.speculative
        if spec.ngram_min > spec.ngram_max:
            raise ValueError(f"speculative.ngram_min ({spec.ngram_min}) must not exceed ngram_max ({spec.ngram_max})")
        self.ngram_min, self.ngram_max = spec.ngram_min, spec.ngram_max

    def propose(self, requests):
        return [Proposal(lookup(r.token_ids, self.ngram_min, self.ngram_max, r.num_tokens)) for r in requests]


@hookimpl
def register_speculators(register):
    register("ngram", NgramSpeculator, description="prompt lookup: propose what followed the last n-gram earlier")
