"""``model.backend = "auto"`` (the default): the fastest built-in backend that runs the checkpoint.

In order: ``native`` (its own Llama/Mistral/Qwen2/Qwen3 layers, the fastest),
``transformers`` (any architecture whose modeling code routes attention
through transformers' ``AttentionInterface``, on the same paged arena), and
``transformers-unpaged`` (anything else ``AutoModelForCausalLM`` loads, with
no prefix cache). A backend factory may say which checkpoints it runs with a
``supports_model_type(model_type) -> bool`` static method; one that refuses a
checkpoint while loading raises ``UnsupportedModel`` and the next is tried.
"""

from __future__ import annotations

import json

from tierserve.core.errors import ConfigError, TierserveError
from tierserve.core.registry import Registry
from tierserve.core.sections import Settings

AUTO = "auto"
AUTO_ORDER = ("native", "transformers", "transformers-unpaged")


class UnsupportedModel(TierserveError, ValueError):
    """A backend cannot run this checkpoint's architecture; the message says why and what to set instead."""


def checkpoint_model_type(path: str, gguf_file: str | None = None) -> str:
    """``model_type`` from the checkpoint's ``config.json`` (``model.path``, builtin names included),
    or from a GGUF file's metadata (through transformers, which maps its architecture names)."""
    from tierserve.models.checkpoints import load_config, resolve_model_path
    from tierserve.models.gguf import is_gguf

    resolved = resolve_model_path(path, gguf_file)
    if is_gguf(resolved):
        return str(load_config(resolved).model_type)
    config = resolved / "config.json"
    try:
        return str(json.loads(config.read_text())["model_type"])
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model.path {path!r}: cannot read model_type from {config}: {exc}") from None


def backend_candidates(settings: Settings, backends: Registry) -> list[str]:
    """The backends to try for ``settings``, first choice first: the one named, or auto's candidates."""
    if settings.model.backend.lower() != AUTO:
        return [settings.model.backend]
    model_type = checkpoint_model_type(settings.model.path, settings.model.gguf_file)
    names = [name for name in AUTO_ORDER if name in backends]
    for index, name in enumerate(names):
        supports = getattr(backends.get(name).factory, "supports_model_type", None)
        if supports is None or supports(model_type):
            # the later ones stay as fallbacks (each refuses in its own loading what it cannot run),
            # unasked: asking the transformers backend imports transformers
            return names[index:]
    return names[-1:]
