"""The HTTP API page of the documentation (``docs/http-api.md``) and ``docs/openapi.json``, from the app itself.

``python -m tierserve.server.api_reference > docs/http-api.md`` and ``python -m tierserve.server.api_reference
--openapi > docs/openapi.json`` write them; a test fails when either is stale. The app is built with the
production preset and no model (building it loads nothing); each route's text is its handler's docstring,
each request body's fields come from the schema Litestar derives from the request models.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("OpenAI-compatible routes", "What OpenAI's clients call; `model` names a served model or alias.",
     ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/models")),
    ("The serving spec's cached routes", "Completions that report what the cache did for each request.",
     ("/v1/cached/",)),
    ("Cache management", "Statistics, clearing, warming, offloading and named prefixes of the tiered KV cache; "
     "the routes that change the cache need the admin key once API keys are set.", ("/v1/cache/",)),
    ("Models, versions and LoRA", "Loading and unloading model versions and adapters, and switching aliases, "
     "while the server runs ([Several models](models.md)).",
     ("/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")),
    ("Operations", "Probes, metrics, plugins and the dashboard.", ("/health", "/metrics", "/v1/plugins", "/dashboard")),
    ("Tokenizer (vLLM's routes)", "Token ids as the generation routes compute them, for clients that count or score "
     "tokens themselves (lm-evaluation-harness's `tokenizer_backend=remote`).",
     ("/tokenize", "/detokenize", "/tokenizer_info")),
)  # fmt: skip
MANAGEMENT_METHODS = {("/v1/models", "POST"), ("/v1/models/{model_id}", "DELETE")}


def build_app() -> Any:
    from tierserve.core.plugins import load_plugins
    from tierserve.server.app import create_app
    from tierserve.settings.config import load_settings

    # the built-in plugins only: an installed plugin's routes are not tierserve's API
    return create_app(load_settings("production", environ={}, plugins=load_plugins(allowlist=[])))


def openapi_schema(app: Any | None = None) -> dict[str, Any]:
    """The OpenAPI document ``GET /docs/openapi.json`` serves."""
    return (app or build_app()).openapi_schema.to_schema()


def routes(app: Any) -> list[tuple[str, str, str]]:
    """``(method, path, description)`` of every tierserve route, the ones left out of the schema included."""
    found = []
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            fn = handler.fn
            if not fn.__module__.startswith("tierserve."):
                continue
            path = route.path.replace(":str}", "}")
            for method in sorted(handler.http_methods - {"OPTIONS", "HEAD"}):
                found.append((method, path, " ".join((fn.__doc__ or "").split())))
    return found


def group_of(method: str, path: str) -> int:
    if (path, method) in MANAGEMENT_METHODS or path.startswith(("/v1/models/aliases", "/v1/load_", "/v1/unload_")):
        return 3
    for index, (_, _, prefixes) in enumerate(GROUPS):
        if any(path == p or path.startswith(p if p.endswith("/") else p + "/") for p in prefixes):
            return index
    raise ValueError(f"route {method} {path} belongs to no group of the HTTP API page")


def type_of(schema: dict[str, Any]) -> str:
    """A field's type as the page shows it: ``string``, ``integer | null``, ``array of Message``, ..."""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    for combined in ("anyOf", "oneOf"):
        if combined in schema:
            return " | ".join(dict.fromkeys(type_of(part) for part in schema[combined]))
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}"
    if isinstance(kind, list):
        return " | ".join(kind)
    if "enum" in schema:
        return " | ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    return kind


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def body_table(schema: dict[str, Any], components: dict[str, Any]) -> list[str]:
    """The request body's fields as a table (name, type, default, description)."""
    ref = schema.get("$ref")
    if ref is None:
        refs = [part["$ref"] for part in schema.get("anyOf", []) if "$ref" in part]
        ref = refs[0] if refs else None
    if ref is None:
        return []
    name = ref.rsplit("/", 1)[-1]
    model = components.get(name, {})
    required = set(model.get("required", []))
    lines = [f"Body: `{name}`", "", "| field | type | default | description |", "|---|---|---|---|"]
    for field, spec in model.get("properties", {}).items():
        default = "required" if field in required else (f"`{json.dumps(spec['default'])}`" if "default" in spec else "")
        lines.append(f"| `{field}` | {cell(type_of(spec))} | {cell(default)} | {cell(spec.get('description', ''))} |")
    return lines


def render(app: Any | None = None) -> str:
    """The Markdown of ``docs/http-api.md``."""
    from tierserve.core.scheduler import PROMPT_LOGITS_PER_STEP

    app = app or build_app()
    schema = openapi_schema(app)
    components = schema.get("components", {}).get("schemas", {})
    lines = [
        "# HTTP API",
        "",
        "<!-- generated by `python -m tierserve.server.api_reference > docs/http-api.md`; do not edit -->",
        "",
        "Every route a `tierserve serve` server answers, from the app itself. A running server also serves its",
        "OpenAPI schema at `/docs/openapi.json` (browsable at `/docs`); the same schema is",
        "[openapi.json](openapi.json) here. Errors are OpenAI's shape, `{\"error\": {\"message\", \"type\",",
        "\"param\", \"code\"}}`, with the status codes in [Reliability](reliability.md). Once `[auth] api_keys` is",
        "set every route but the probes needs `Authorization: Bearer KEY`. A fleet's ingress",
        "(`tierserve fleet`, [Fleet](fleet.md)) answers the same routes and routes generation to its replicas.",
        "",
        "**400 or 501.** A request that is wrong is a 400: a value out of range or of the wrong type, one that",
        "contradicts another field (`tool_choice: \"required\"` without tools), or one this server's settings or",
        "model cannot serve (`enable_sliding_window` where the operator has not allowed it, an image part for a",
        "text-only model). A valid request for something tierserve deliberately does not build, a field or value",
        "of OpenAI's or vLLM's API or a combination of features, is a 501 with `type: \"not_implemented_error\"`",
        "and `code: \"not_implemented\"`: `best_of` other than 1 or `n`, a non-empty `suffix`, the legacy",
        "`functions` and a named `function_call`, beam search (`beam_width` > 1) with `stream`, `logit_bias`,",
        "`cache_key`, an output constraint, prompt logprobs or a LoRA adapter, `prompt_logprobs` with `stream`,",
        "embeddings from a LoRA adapter, and on",
        "`/v1/responses` `reasoning`, `background: true`, `include`, `truncation: \"auto\"`, built-in tools and",
        "their input items. Its message names the field, the value sent and what is supported; it carries",
        "`x-should-retry: false`, as OpenAI's clients would otherwise retry it. Every field's type and range is",
        "checked first, so a body with an invalid value is the 400 even when it also names something not built.",
        "",
        "**Scoring a prompt.** `/v1/completions` with `echo: true` and `logprobs: N` answers in OpenAI's legacy",
        "shape with the prompt's tokens first, then the generated ones: `tokens`, `token_logprobs` (the first",
        "prompt token's is `null`), `top_logprobs` (`null` for it too) and `text_offset` into the echoed text;",
        "`max_tokens: 0` scores the prompt and generates nothing (the prompt may then fill the whole context).",
        "vLLM's `prompt_logprobs: N` (completions: per choice; chat: on the response, not streamed) is",
        "`[null, {\"token id\": {\"logprob\", \"rank\", \"decoded_token\"}, ...}, ...]`: each prompt token after",
        "the first with its rank, and the N most likely tokens at its position (ranks 1 to N). N is 0 to 20.",
        "The values are `log_softmax` of the model's own logits in float32, before temperature, penalties and",
        "`logit_bias`. A scored prompt is computed, never read from the prefix cache (a cached block keeps KV,",
        "not the logits), as vLLM does; its blocks are still cached for the requests after it. A step computes",
        f"at most {PROMPT_LOGITS_PER_STEP} scored positions, of all the prompts it runs, so their logits take the same",
        "memory however long or many they are. Scored requests decode without speculative drafts.",
        "",
    ]
    grouped: dict[int, list[tuple[str, str, str]]] = {}
    for method, path, text in routes(app):
        grouped.setdefault(group_of(method, path), []).append((method, path, text))
    for index, (title, intro, _) in enumerate(GROUPS):
        lines += [f"## {title}", "", intro, "", "| route | what it does |", "|---|---|"]
        for method, path, text in grouped.get(index, []):
            lines.append(f"| `{method} {path}` | {cell(text)} |")
        lines.append("")
        for method, path, _ in grouped.get(index, []):
            operation = schema.get("paths", {}).get(path, {}).get(method.lower(), {})
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            table = body_table(body, components) if body else []
            if table:
                lines += [f"### `{method} {path}`", "", *table, ""]
    lines += [
        "## The OpenAPI schema",
        "",
        '??? abstract "openapi.json (production preset)"',
        "",
        "    ```json",
        *("    " + line for line in json.dumps(schema, indent=2, sort_keys=True).splitlines()),
        "    ```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    with contextlib.redirect_stdout(sys.stderr):  # structlog's default writes to stdout: keep its lines out of the page
        text = json.dumps(openapi_schema(), indent=2, sort_keys=True) + "\n" if "--openapi" in argv else render()
    sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
