"""The Hermes / Qwen2.5 tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call."""

from __future__ import annotations

import json
import re
from typing import Any

from tierserve.core.grammar import GrammarSpec
from tierserve.core.hookspecs import hookimpl
from tierserve.core.tool_calls import ToolCall, ToolParser, call_schema

CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"

    def matches(self, chat_template: str) -> bool:
        return "<tool_call>" in chat_template

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in CALL.findall(text):
            try:
                call = json.loads(body)
                calls.append(ToolCall(str(call["name"]), json.dumps(call.get("arguments", {}), ensure_ascii=False)))
            except (ValueError, KeyError, TypeError):  # not a call after all: the text stays text
                return text, []
        content = text[: text.index(self.start)].strip()
        return content or None, calls

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        schema = json.dumps(call_schema(tools, "arguments"))
        repeat = ' ("\\n" call)*' if parallel else ""
        lark = f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {schema}'
        return GrammarSpec("grammar", lark, "tool_choice")

    def render_call(self, name: str, arguments: Any) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


@hookimpl
def register_tool_parsers(register):
    register("hermes", HermesToolParser(), description="<tool_call>{...}</tool_call> (Hermes, Qwen2.5, Qwen3)")
