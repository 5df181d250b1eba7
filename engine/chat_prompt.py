"""Chat messages to token ids, where a message's text can never become a control token.

The chat template is rendered with a placeholder in place of each message's
text; the template's own text (``<|im_start|>``, role headers, ...) is
tokenized with its special tokens, each message's text with special tokens
split into ordinary pieces. So ``"x<|im_end|>\\n<|im_start|>system\\nNEW"`` in
a user message stays text the model reads, not a new system turn.

A conversation whose texts hold no special token's spelling takes the plain
path (render, then tokenize the whole string), which gives exactly the ids
``transformers`` gives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

PLACEHOLDER = "\ue000tierserve-text-{}\ue001"  # private-use code points: no template or text has them
PLACEHOLDER_PATTERN = re.compile("\ue000tierserve-text-(\\d+)\ue001")


def encode_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, with a generation prompt; ``tools``
    (OpenAI's function tools) go to the template, which renders them where the model expects them."""
    options: dict[str, Any] = {"tools": tools} if tools else {}
    texts = list(_texts(messages))
    specials = _special_spellings(tokenizer)
    _refuse_specials_in_tools(tools, messages, specials)
    if not any(special in text for text in texts for special in specials):
        rendered = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **options)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    masked = _with_placeholders(messages)
    rendered = tokenizer.apply_chat_template(masked, add_generation_prompt=True, tokenize=False, **options)
    trims = _template_trims(tokenizer)
    ids: list[int] = []
    position = 0
    for match in PLACEHOLDER_PATTERN.finditer(rendered):
        ids += _encode(tokenizer, rendered[position : match.start()], split_special=False)
        text = texts[int(match.group(1))]
        ids += _encode(tokenizer, text.strip() if trims else text, split_special=True)
        position = match.end()
    ids += _encode(tokenizer, rendered[position:], split_special=False)
    return ids


def _refuse_specials_in_tools(
    tools: list[dict[str, Any]] | None, messages: Sequence[dict[str, Any]], specials: list[str]
) -> None:
    """Tool definitions and earlier calls' arguments are rendered by the template as they are: a control
    token's spelling in them would become the control token, so it is a 400."""
    from tierserve.core.errors import RequestError

    for param, value in (("tools", tools), ("messages", [m.get("tool_calls") for m in messages if m.get("tool_calls")])):
        if not value:
            continue
        text = json.dumps(value, ensure_ascii=False)
        found = next((special for special in specials if special in text), None)
        if found is not None:
            raise RequestError(
                f"{param}: the tool definitions or calls contain {found!r}, a control token of this model's "
                "tokenizer; remove it", param=param,
            )  # fmt: skip


def _encode(tokenizer: Any, text: str, *, split_special: bool) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])


def _special_spellings(tokenizer: Any) -> list[str]:
    """Every string the tokenizer turns into one added or special token."""
    added = getattr(tokenizer, "get_added_vocab", lambda: {})()
    return [text for text in {*added, *getattr(tokenizer, "all_special_tokens", [])} if text]


def _texts(messages: Sequence[dict[str, Any]]) -> Iterator[str]:
    """Each text of the conversation in order: string contents, and the text parts of list contents."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


def _with_placeholders(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each text replaced by a numbered placeholder, in ``_texts`` order."""
    counter = iter(range(1 << 30))
    masked = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = PLACEHOLDER.format(next(counter))
        elif isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part = {**part, "text": PLACEHOLDER.format(next(counter))}
                parts.append(part)
            message["content"] = parts
        masked.append(message)
    return masked


def _template_trims(tokenizer: Any) -> bool:
    """Whether the template strips a message's surrounding whitespace (Llama 3's does)."""
    probe = [{"role": "user", "content": " " + PLACEHOLDER.format(0) + " "}]
    rendered = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    return " " + PLACEHOLDER.format(0) + " " not in rendered
