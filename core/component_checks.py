"""What a registered component must be, checked when its plugin registers it.

A factory of the wrong kind (an eviction policy that is not an
``EvictionPolicy``, a tier class with an abstract method left, a constructor
that cannot take the arguments tierserve passes) would otherwise fail at the
first request that builds it, far from the plugin. ``check_component``
raises at registration instead, so the plugin fails to load with a message
naming it, and the others keep working.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

# kind -> (the base class a class factory must subclass, the arguments tierserve calls the factory with)
CONTRACTS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "eviction_policies": ("tierserve.cache.eviction:EvictionPolicy", ("capacity",), ()),
    "cache_tiers": ("tierserve.cache.tier:CacheTier", ("tier", "policy_factory", "fingerprint"), ()),
    "schedulers": ("tierserve.core.scheduler:Scheduler", ("settings", "kv"), ("model",)),
    "speculators": ("tierserve.core.speculation:Speculator", ("settings", "target"), ()),
    "backends": ("tierserve.core.backend:ModelBackend", ("settings",), ()),
}
TOOL_PARSER = "tierserve.core.tool_calls:ToolParser"


def base_class(dotted: str) -> type:
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


def check_component(kind: str, label: str, name: str, factory: Any, has_settings: bool) -> None:
    """Raise ``TypeError`` unless ``factory`` can build a component of ``kind`` (see the module docstring).

    Args:
        kind: a ``COMPONENT_KINDS`` key; ``label`` its name in messages ("eviction policy").
        name: the name it is registered under (for the message).
        factory: what was registered.
        has_settings: it registered a settings model (a scheduler then also gets ``options=``).
    """
    if kind == "tool_parsers":
        parser = base_class(TOOL_PARSER)
        if not isinstance(factory, parser):
            raise TypeError(f"tool parser {name!r} must be an instance of {TOOL_PARSER.replace(':', '.')}, got {factory!r}")
        return
    if kind not in CONTRACTS:
        return
    base_name, positional, keywords = CONTRACTS[kind]
    if kind == "schedulers" and has_settings:
        keywords = (*keywords, "options")
    what = f"{label} {name!r} ({getattr(factory, '__qualname__', repr(factory))})"
    if not callable(factory):
        raise TypeError(f"{what} is not callable: register a class or a function that builds one")
    if inspect.isclass(factory):
        base = base_class(base_name)
        if not issubclass(factory, base):
            raise TypeError(f"{what} must subclass {base_name.replace(':', '.')}")
        if inspect.isabstract(factory):
            missing = ", ".join(sorted(factory.__abstractmethods__))
            raise TypeError(f"{what} does not implement {missing} (abstract in {base.__name__})")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as exc:
        called = ", ".join([*positional, *(f"{k}=..." for k in keywords)])
        raise TypeError(f"{what} cannot be called as factory({called}): {exc}") from None
