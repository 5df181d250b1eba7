r"""Incremental detokenization for streaming: UTF-8 safe deltas and stop strings.

Tokens are decoded in a small sliding window (vLLM's prefix/read offsets)::

    ids:  ... | prefix_offset ......... read_offset ......... end |
                \__ prefix_text: already released __/\__ new __/

Each step decodes ``ids[prefix_offset:]`` and releases what lies past
``prefix_text``. Decoding a few tokens of context rather than the new tokens
alone keeps decoder-dependent spacing right (SentencePiece strips the space of
the first token of a decode). Text ending in U+FFFD may be an incomplete
multi-byte character, so that tail is held until a later token completes it;
the window only slides forward at a clean character boundary, so the cost per
token is independent of output length.

Released text then passes the stop-string matcher, which holds back the
longest tail that could still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 5
_PROMPT_CONTEXT_SCAN = 64  # how far back a context of special tokens only is widened to find text


@dataclass(slots=True)
class DetokenizedDelta:
    # New text safe to emit now (may be "").
    text: str
    # A stop string was found; text excludes it unless include_stop_str_in_output.
    stopped: bool
    # The stop string matched.
    stop_reason: str | None


class IncrementalDetokenizer:
    """Streams one sequence's output text.

    The concatenation of every delta's ``text`` and :meth:`flush` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)`` when no stop string hits (a
    character left incomplete at the very end comes out of :meth:`flush` as
    U+FFFD, as ``decode`` writes it). Two knowing differences: the space
    cleanup heuristic is never applied (it rewrites text across token
    boundaries, so it cannot stream; it is off by default for BPE tokenizers),
    and with SentencePiece-style tokenizers the space that separates the output
    from the prompt is kept, where decoding the output ids alone strips it.

    Args:
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``.
        prompt_token_ids: only the last few are used, as decoding context.
        stop: stop strings; the first to complete in the text wins (on a tie
            the longer one, which started earlier).
        include_stop_str_in_output: keep the matched stop string in the output.
        skip_special_tokens: passed to ``decode``.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop: got {list(stop)!r}, allowed: non-empty strings")
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output

        start = max(0, len(prompt_token_ids) - _PROMPT_CONTEXT_TOKENS)
        context = list(prompt_token_ids[start:])
        context_text = self._decode(context) if context else ""
        while not context_text and 0 < start and len(context) < _PROMPT_CONTEXT_SCAN:
            # the window decoded to nothing (special tokens only): as context it would make the output's first
            # word look like the text's first, and a SentencePiece decoder would drop its leading space
            start = max(0, start - _PROMPT_CONTEXT_TOKENS)
            context = list(prompt_token_ids[start:])
            context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt may end inside a character the output completes; as
            # context it would glue prompt bytes onto output text.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text
        self._window_released = 0  # characters past prefix_text released while the window could not slide
        self._held = ""  # released by decoding, held back by stop-string matching
        self._parts: list[str] = []
        self._stop_reason: str | None = None
        self._flushed = False

    @property
    def text(self) -> str:
        """Output text emitted so far: every delta and flush, not what is still held back."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, if one did (also set by :meth:`flush`)."""
        return self._stop_reason

    def add(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Append new output tokens and return the text they make safe to emit.

        After a stop string has matched, further tokens are ignored and every
        call returns an empty, stopped delta.
        """
        if self._flushed:
            raise RuntimeError("add() after flush(): the output is already finished")
        if self._stop_reason is not None:
            return DetokenizedDelta("", True, self._stop_reason)
        if len(token_ids):
            self._ids.extend(map(int, token_ids))
            text = self._emit(self._decode_new(), final=False)
        else:
            text = ""
        return DetokenizedDelta(text, self._stop_reason is not None, self._stop_reason)

    def flush(self) -> str:
        """Emit everything held back, at the end of a sequence not ended by a stop string.

        A stop string found in that last text still truncates it (see
        :attr:`stop_reason`). Calling it again returns "".
        """
        if self._flushed or self._stop_reason is not None:
            self._flushed = True
            return ""
        self._flushed = True
        window = self._decode(self._ids[self._prefix_offset :])
        return self._emit(window[len(self._prefix_text) + self._window_released :], final=True)

    def _decode_new(self) -> str:
        """Text past what was released, up to the last complete character."""
        window = self._decode(self._ids[self._prefix_offset :])
        start = len(self._prefix_text) + self._window_released
        if window.endswith(_REPLACEMENT):
            # Release the settled text before the unfinished character, but
            # keep the window: it can only slide at a character boundary.
            end = len(window.rstrip(_REPLACEMENT))
            if end <= start:
                return ""
            self._window_released += end - start
            return window[start:end]
        if len(window) <= len(self._prefix_text):
            return ""  # the new tokens decode to nothing (e.g. skipped special tokens)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._window_released = 0
        return window[start:]

    def _emit(self, new_text: str, *, final: bool) -> str:
        """Run released text through stop-string matching; return what may be shown."""
        pending = self._held + new_text
        self._held = ""
        if self._stop:
            hit = self._find_stop(pending)
            if hit is not None:
                start, stop = hit
                self._stop_reason = stop
                pending = pending[: start + len(stop) if self._include_stop else start]
            elif not final:
                keep = self._partial_stop_length(pending)
                if keep:
                    pending, self._held = pending[:-keep], pending[-keep:]
        if pending:
            self._parts.append(pending)
        return pending

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first, the longer one on a tie."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
