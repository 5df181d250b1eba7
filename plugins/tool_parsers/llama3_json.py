"""Llama 3.1+'s JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``; several joined by ``;``."""

from __future__ import annotations

import json
from typing import Any

from tierserve.core.grammar import GrammarSpec
from tierserve.core.hookspecs import hookimpl
from tierserve.core.tool_calls import ToolCall, ToolParser, call_schema

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start = "{"
    anywhere = False

    def matches(self, chat_template: str) -> bool:
        return PYTHON_TAG in chat_template or ('"parameters"' in chat_template and "<|start_header_id|>" in chat_template)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(body):
            try:
                call, end = decoder.raw_decode(body, position)
                calls.append(ToolCall(str(call["name"]), json.dumps(call.get("parameters", call.get("arguments", {})))))
            except (ValueError, KeyError, TypeError):
                return text, []
            position = end
            while position < len(body) and body[position] in " \n;":
                position += 1
        return None, calls

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        schema = json.dumps(call_schema(tools, "parameters"))
        repeat = ' ("; " call)*' if parallel else ""
        return GrammarSpec("grammar", f"start: call{repeat}\ncall: %json {schema}", "tool_choice")

    def render_call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


@hookimpl
def register_tool_parsers(register):
    register("llama3_json", Llama3JsonToolParser(), description='{"name": ..., "parameters": {...}} (Llama 3.1+)')
