"""The prompt token ids and cache salt a replica would give a forwarded request, worked out at the router.

The replicas' block hashes are chained over prompt token ids from a root of
the model's fingerprint, the block size and the tenant's salt
(``cache.hashing``); to know which replica holds a request's prefix, the
router makes the same ids and salt with the same code the server runs: the
checkpoint's tokenizer (its chat template for ``messages``) and the
``[auth]`` tenants (``server.tenants.cache_scope``). A request it cannot
read (not JSON, no prompt, an unknown key, a chat template that refuses it)
gets ``None`` and goes to the least loaded replica; the replica then answers
it as it would anyway.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tierserve.core.sections import Settings
from tierserve.engine.chat_prompt import encode_chat
from tierserve.fleet.prefix_affinity import prompt_text
from tierserve.models.checkpoints import load_tokenizer, resolve_model_path
from tierserve.server.tenants import TenantMap, bearer_token, cache_scope


class RequestTokens:
    """Reads forwarded requests as the replicas' servers read them (see the module docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.tokenizer = load_tokenizer(resolve_model_path(settings.model.path, settings.model.gguf_file))
        self.tenants = TenantMap(settings.auth)

    def of(self, headers: Mapping[str, str], body: bytes) -> tuple[list[int], str | None] | None:
        """``(prompt token ids, cache salt)`` of a request (``headers`` with lower-case names), or None."""
        try:
            parsed = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(parsed, dict):
            return None
        caller = self.tenants.resolve(bearer_token(headers.get("authorization")))
        if caller is None:
            return None
        salt = parsed.get("cache_salt")
        scope = cache_scope(caller.tenant, salt if isinstance(salt, str) else None)
        try:
            ids = self._token_ids(parsed)
        except Exception:  # a template or tokenizer refusal: the replica will say what is wrong
            return None
        return (ids, scope) if ids else None

    def _token_ids(self, body: dict[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if isinstance(messages, list):
            # tools and earlier tool calls are rewritten for the template by the server (generation_jobs): such a
            # conversation is routed by load alone rather than by ids that might not be the server's
            if body.get("tools") or not getattr(self.tokenizer, "chat_template", None):
                return None
            if any(not isinstance(m, dict) or m.get("tool_calls") or m.get("role") == "tool" for m in messages):
                return None
            return encode_chat(self.tokenizer, messages)
        prompt = prompt_text(body)
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt) if isinstance(prompt, list) else None
