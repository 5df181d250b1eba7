"""Tool calling: what a tool parser plugin does, and choosing one for a model by its chat template.

A model writes tool calls in its own format (Hermes/Qwen2.5 ``<tool_call>``
JSON, Llama 3's bare JSON, ...). A ``ToolParser`` (registered with the
``register_tool_parsers`` hook) knows one format: it says whether a chat
template is its format, turns generated text into OpenAI ``tool_calls``, and
writes the grammar that forces a valid call (``tool_choice`` ``required`` or a
named function). The first registered parser whose ``matches`` accepts the
template is used; a template that knows no tools gets the first one
(``hermes``), with the tools written into a system message for it.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tierserve.core.grammar import JSON_OPTIONS, GrammarSpec


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call as OpenAI returns it: ``arguments`` is JSON text."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id or f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def call_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """A JSON schema of one call to any of ``tools``: ``{"name": <const>, arguments_key: <its parameters>}``."""
    options = []
    for tool in tools:
        function = function_of(tool)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        options.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })  # fmt: skip
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


class ToolParser(ABC):
    """One model family's tool-call format. ``start`` is what every call in the output begins with."""

    name: str = ""
    start: str = ""
    anywhere: bool = True  # a call may follow some text (False: only the whole output is a call)

    @abstractmethod
    def matches(self, chat_template: str) -> bool:
        """Whether a chat template writes (and so the model reads and writes) this format."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Generated text → (the text that is not a call, or None; the calls). No call found: ``(text, [])``."""

    @abstractmethod
    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
        """A grammar whose every sentence is one valid call to one of ``tools`` (several when ``parallel``)."""

    @abstractmethod
    def render_call(self, name: str, arguments: Any) -> str:
        """An earlier assistant call as the model wrote it (for templates that render no ``tool_calls``)."""

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The tools described for a template that has no place for them (Hermes's wording)."""
        listed = "\n".join(json.dumps(tool) for tool in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{self.start} XML tags:\n{self.start}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
            f"{self.start.replace('<', '</')}"
        )


def choose_tool_parser(parsers: list[ToolParser], chat_template: str | None) -> ToolParser:
    """The parser for a model's template: the first that matches it, else the first registered."""
    template = chat_template or ""
    for parser in parsers:
        if parser.matches(template):
            return parser
    return parsers[0]
