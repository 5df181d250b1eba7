"""Tool calls in a chat stream: text goes out as content until a call begins; calls go out as tool-call deltas.

Text that could still be the start of a call (a prefix of the parser's
``start`` marker) is held back; once a call begins, the rest is held until the
choice ends, then parsed into OpenAI tool-call deltas (each call whole: its
id, name and arguments in one delta) with ``finish_reason: "tool_calls"``.
Output that turns out to be no call is sent as content after all.
"""

from __future__ import annotations

from typing import Any

from tierserve.core.tool_calls import ToolCall, ToolParser


def finish_with_calls(parser: ToolParser, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
    """A finished choice's (content, calls, finish_reason): ``tool_calls`` when it ended in calls."""
    content, calls = parser.parse(text)
    if calls and finish_reason == "stop":
        return content, calls, "tool_calls"
    return text, [], finish_reason


class ToolStream:
    """One choice's stream: ``feed`` each delta, get back what to send now."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of ``text`` already sent as content
        self.text = ""
        self.in_call = False

    def feed(self, delta: str, finish_reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """``(content to send, tool-call deltas, finish_reason)`` for this piece of output."""
        self.text += delta
        content = ""
        if not self.in_call:
            found = self._marker_at()
            if found is not None:
                self.in_call = True
                content, self.sent = self.text[self.sent : found], found
            else:
                safe = len(self.text) if finish_reason is not None else self._safe_end()
                if safe > self.sent:
                    content, self.sent = self.text[self.sent : safe], safe
        if finish_reason is None or not self.in_call:
            return content, [], finish_reason
        held = self.text[self.sent :]  # the calls, from their first marker on
        _, calls = self.parser.parse(held)
        if calls and finish_reason == "stop":
            return content, [call.as_openai(index=i) for i, call in enumerate(calls)], "tool_calls"
        return content + held, [], finish_reason  # not a call after all: the text is content

    def _marker_at(self) -> int | None:
        """Where a call begins in the text not yet sent, if it does."""
        marker = self.parser.start
        if self.parser.anywhere:
            index = self.text.find(marker, self.sent)
            return index if index >= 0 else None
        stripped = self.text.lstrip()
        if self.sent == 0 and stripped.startswith(marker):
            return len(self.text) - len(stripped)
        return None

    def _safe_end(self) -> int:
        """How much text may go out: all but a tail that could still grow into the marker."""
        marker = self.parser.start
        if not self.parser.anywhere:
            stripped = self.text.lstrip()
            if self.sent == 0 and marker.startswith(stripped):
                return 0  # the whole output so far could be the start of a call
            return len(self.text)
        for keep in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if marker.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)
