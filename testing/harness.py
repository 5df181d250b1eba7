"""Plugins loaded in a test, and an engine and an HTTP client on the built-in tiny model to run them in.

Nothing here is a stand-in: ``tiny_engine`` is the engine ``tierserve serve``
runs (its core stepped in this process), on ``builtin:tiny`` (a small Llama
with seeded random weights, written on first use), and ``http_client`` is
Litestar's test client on the app ``tierserve serve`` serves.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tierserve.core.hookspecs import hookimpl
from tierserve.core.plugins import COMPONENT_KINDS, PluginManager, add_plugin_modules, load_plugins

if TYPE_CHECKING:
    from litestar.testing import TestClient

    from tierserve.engine import EngineClient
    from tierserve.settings.config import LoadedSettings

TINY_MODEL = "builtin:tiny"


class PluginLoadError(AssertionError):
    """A plugin given to ``plugin_manager`` failed to load (the message is the plugin manager's reason)."""


def component_plugin(kind: str, name: str, factory: Any, **metadata: Any) -> object:
    """A plugin that registers one component: ``factory`` under ``name`` for ``kind`` (a registry kind:
    ``"eviction_policies"``, ``"cache_tiers"``, ``"schedulers"``, ``"speculators"``, ``"backends"``, ...),
    with ``metadata`` (``settings=``, ``description=``) as ``register`` takes it.

    The plugin is called ``MODULE:NAME`` (the factory's module): that is its name in ``plugin_figures``,
    ``/metrics`` labels and load errors."""
    if kind not in COMPONENT_KINDS:
        raise ValueError(f"kind {kind!r}: one of {', '.join(COMPONENT_KINDS)}")
    hook = COMPONENT_KINDS[kind][0]

    def register_one(register):  # the hook's argument name is what pluggy passes by
        register(name, factory, **metadata)

    register_one.__name__ = hook
    plugin_name = f"{getattr(factory, '__module__', None) or 'test'}:{name}"
    return types.SimpleNamespace(**{hook: hookimpl(register_one)}, __name__=plugin_name)


def plugin_manager(*plugins: Any, installed: bool = False) -> PluginManager:
    """The built-in plugins and ``plugins``, loaded through the same hooks as ``tierserve serve`` loads them.

    Args:
        plugins: each a module (or any object) with ``@hookimpl`` functions, one made by ``component_plugin``, or
            a string as ``tierserve serve --plugin`` takes it (a ``.py`` file, a package folder, a module name).
        installed: also load the installed plugins (``TIERSERVE_PLUGINS`` applies); by default none, so a test
            does not depend on what else is installed.

    Raises:
        PluginLoadError: a plugin failed to load (an import error, a misspelled hook, a component of the
            wrong kind), with the reason tierserve gives for it.
    """
    manager = load_plugins(allowlist="env" if installed else [])
    for index, plugin in enumerate(plugins):
        if isinstance(plugin, str):
            add_plugin_modules(manager, [plugin])
        else:
            name = getattr(plugin, "__name__", None) or f"test-plugin-{index}"
            manager.add_plugin(plugin, name, "test", "tierserve.testing")
    if manager.failures:
        raise PluginLoadError("; ".join(f"plugin {f.name!r} ({f.source}) failed to load: {f.error}" for f in manager.failures))
    return manager


def eviction_policy(name: str = "lru") -> Any:
    """The factory of a built-in eviction policy (``"lru"``, ``"lfu"``, ``"clock"``, ``"adaptive"``), to build a
    cache tier by hand in a test: ``MyTier(tier_settings, eviction_policy("lru"), "fingerprint")``."""
    return load_plugins(allowlist=[]).registry("eviction_policies").get(name).factory


def tiny_settings(settings: Mapping[str, Any] | None = None, plugins: PluginManager | None = None) -> LoadedSettings:
    """Settings for ``builtin:tiny`` on the CPU, from the defaults plus ``settings`` (``{"section.key": value}``,
    e.g. ``{"scheduler.name": "sjf", "kv_cache.l1_capacity": 64, "plugins.ngram.max_n": 3}``), validated
    against ``plugins`` (default: ``plugin_manager()``) exactly as a preset is."""
    from tierserve.settings.config import load_settings

    overrides: dict[tuple[str, str], Any] = {("model", "path"): TINY_MODEL, ("model", "device"): "cpu"}
    for dotted, value in (settings or {}).items():
        section, _, key = dotted.rpartition(".")
        if not section:
            raise ValueError(f"setting {dotted!r}: write it as SECTION.KEY (e.g. kv_cache.l1_capacity)")
        overrides[(section, key)] = value
    return load_settings(None, environ={}, overrides=overrides, plugins=plugins or plugin_manager())


@contextmanager
def tiny_engine(settings: Mapping[str, Any] | None = None, plugins: PluginManager | None = None) -> Iterator[EngineClient]:
    """An engine on ``builtin:tiny`` whose core runs in this process (see ``tiny_settings`` for the arguments).

    ``engine.generate(prompts, SamplingParams(...))`` runs requests to the end; ``engine.stats()`` is what
    ``/v1/cache/stats`` and ``/metrics`` are built from; ``engine.check_integrity()`` checks the KV pool, the
    index and every tier. Closed on leaving the ``with`` block.
    """
    from tierserve.engine import EngineClient

    loaded = tiny_settings(settings, plugins)
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
    try:
        yield engine
    finally:
        engine.close()


@contextmanager
def http_client(settings: Mapping[str, Any] | None = None, plugins: PluginManager | None = None) -> Iterator[TestClient]:
    """Litestar's test client on the app ``tierserve serve`` builds, serving ``builtin:tiny`` (arguments as
    ``tiny_settings``): ``client.post("/v1/completions", json={...})``, ``client.get("/v1/cache/stats")``, ...
    The engine is reachable as ``client.engine``."""
    from litestar.testing import TestClient

    from tierserve.engine import EngineClient
    from tierserve.server.app import create_app

    loaded = tiny_settings(settings, plugins)
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
    app = create_app(loaded.settings, engine=engine, plugins=loaded.plugins, load_in_background=False)
    try:
        with TestClient(app) as client:
            client.engine = engine
            yield client
    finally:
        engine.close()
