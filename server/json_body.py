"""What a POST body must be before any route reads it: JSON by its content type (else 415), and parseable.

Runs as the app's ``before_request`` hook, so a route never sees a form or
text body, and JSON nested deeper than the parser's recursion limit is a 400
rather than a ``RecursionError`` (a 500) inside the route's body parsing.
"""

from __future__ import annotations

from litestar import Request
from litestar.exceptions import SerializationException

from tierserve.server.errors import APIError

SAFE_DEPTH = 100  # always parses; the parser's real limit (about 1,000 levels) depends on the stack in use


def is_json(content_type: str) -> bool:
    """``application/json`` or any ``+json`` type, parameters (``charset``) ignored; no content type counts as JSON."""
    media = content_type.split(";", 1)[0].strip().lower()
    return not media or media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def check_json_body(request: Request) -> None:
    """Refuse a non-empty POST body that is not JSON (415) or is nested too deeply to parse (400)."""
    if request.method != "POST":
        return
    body = await request.body()
    if not body:
        return  # /v1/cache/warm and /v1/cache/offload take none
    content_type = request.headers.get("content-type", "")
    if not is_json(content_type):
        raise APIError(
            415,
            f"content-type: got {content_type[:100]!r}; send the body as JSON with content-type: application/json",
            param="content-type",
            code="unsupported_media_type",
        )
    try:
        await request.json()  # parsed once: the route reads the cached value
    except RecursionError:
        raise APIError(
            400,
            f"body: the JSON is nested too deeply to parse; nest it at most {SAFE_DEPTH} levels deep",
            param=None,
            code="invalid_json",
        ) from None
    except SerializationException:
        return  # malformed JSON: the route's own parsing answers 400 with the parser's message
