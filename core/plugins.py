"""Plugin manager: loads built-in and installed plugins into one registry per kind.

Built-in plugins are the modules in ``BUILTIN_PLUGINS``; they go through the
same hooks as outside plugins, which come from the ``tierserve`` entry point
group. ``TIERSERVE_PLUGINS`` (comma-separated distribution or entry point
names) restricts which outside plugins load: unset means all installed, empty
means none. A plugin that fails to import, has a misspelled hook, raises while
registering or takes a name another plugin already has is unregistered and
reported in ``failures``; the others keep working.

A plugin under development loads without packaging from a ``.py`` file, a
package folder or an importable module name (``tierserve serve --plugin``,
``load_plugins(modules=...)``); the engine core process loads it again from
the same place.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy
import structlog

from tierserve.core import hookspecs
from tierserve.core.component_checks import check_component
from tierserve.core.errors import DuplicateComponentError
from tierserve.core.registry import Component, Registry
from tierserve.core.sections import Settings

log = structlog.get_logger(__name__)

ENTRY_POINT_GROUP = "tierserve"
ALLOWLIST_ENV = "TIERSERVE_PLUGINS"

BUILTIN_PLUGINS: tuple[str, ...] = (
    "tierserve.plugins.eviction.lru",
    "tierserve.plugins.eviction.lfu",
    "tierserve.plugins.eviction.adaptive",
    "tierserve.plugins.eviction.clock",
    "tierserve.plugins.schedulers.fcfs",
    "tierserve.plugins.schedulers.priority",
    "tierserve.plugins.backends.native",
    "tierserve.plugins.backends.transformers_paged",
    "tierserve.plugins.backends.transformers_unpaged",
    "tierserve.plugins.tiers.memory",
    "tierserve.plugins.tiers.disk",
    "tierserve.plugins.tiers.redis_tier",
    "tierserve.plugins.speculation.ngram",
    "tierserve.plugins.speculation.ngram_tree",
    "tierserve.plugins.speculation.medusa",
    "tierserve.plugins.speculation.draft_model",
    "tierserve.plugins.tool_parsers.hermes",
    "tierserve.plugins.tool_parsers.llama3_json",
)

# registry kind -> (register hook, human name used in messages)
COMPONENT_KINDS: dict[str, tuple[str, str]] = {
    "backends": ("register_backends", "backend"),
    "schedulers": ("register_schedulers", "scheduler"),
    "eviction_policies": ("register_eviction_policies", "eviction policy"),
    "speculators": ("register_speculators", "speculator"),
    "cache_tiers": ("register_cache_tiers", "cache tier"),
    "routes": ("register_routes", "route"),
    "tool_parsers": ("register_tool_parsers", "tool parser"),
}
# a tier's settings are per [[kv_cache.tiers]] entry, not a [plugins.NAME] table
TIER_KIND = "cache_tiers"


@dataclass(slots=True)
class PluginInfo:
    """What ``tierserve plugins`` shows for one loaded plugin."""

    name: str
    version: str
    source: str
    hooks: list[str]
    components: dict[str, list[str]] = field(default_factory=dict)
    settings: dict[str, list[str]] = field(default_factory=dict)  # component name -> its settings keys

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "source": self.source,
            "hooks": self.hooks,
            "components": self.components,
            "settings": self.settings,
        }


@dataclass(slots=True)
class PluginFailure:
    """A plugin that could not be loaded, and why."""

    name: str
    source: str
    error: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "source": self.source, "error": self.error}


def parse_allowlist(value: str | None) -> frozenset[str] | None:
    """``None`` (unset) allows every plugin; ``""`` allows none."""
    if value is None:
        return None
    return frozenset(part.strip().lower() for part in value.split(",") if part.strip())


class PluginManager:
    """Loads plugins and keeps the component registries they fill."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.registries: dict[str, Registry] = {
            kind: Registry(label) for kind, (_, label) in COMPONENT_KINDS.items()
        }
        self.failures: list[PluginFailure] = []
        self.allowlist: list[str] | None = None  # the outside plugins asked for (None: all installed)
        self.modules: list[str] = []  # plugins under development, as given to load_plugins(modules=...)
        # True while another process could load the same plugins from the allowlist alone
        self.reproducible = False
        self._info: dict[str, PluginInfo] = {}

    def registry(self, kind: str) -> Registry:
        """The registry of one kind, e.g. ``"eviction_policies"``."""
        return self.registries[kind]

    def add_plugin(self, plugin: object, name: str, version: str, source: str) -> bool:
        """Register one plugin object and collect its components.

        A plugin added by hand (not by ``load_plugins``) makes the set one that
        a separate engine core process could not load by itself.

        Returns True on success; on any failure the plugin is removed again,
        the failure is recorded and logged, and False is returned.
        """
        self.reproducible = False
        try:
            check_hook_names(plugin)
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validation errors, duplicate plugin names
            self._fail(name, source, exc)
            return False
        settings: dict[str, list[str]] = {}
        try:
            self.pm.check_pending()
            components = self._collect_components(plugin, name, settings)
        except Exception as exc:
            self.remove_plugin(name)
            self._fail(name, source, exc)
            return False
        hooks = sorted(
            caller.name for caller in self.pm.get_hookcallers(plugin) or [] if caller.name
        )
        self._info[name] = PluginInfo(name, version, source, hooks, components, settings)
        if not hooks:
            log.warning("plugin_without_hooks", plugin=name, source=source,
                        why="nothing in it is marked @hookimpl (from tierserve.core import hookimpl)")  # fmt: skip
        return True

    def remove_plugin(self, name: str) -> None:
        """Unregister a plugin and forget its components."""
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin, name=name)
        for registry in self.registries.values():
            registry.remove_plugin(name)
        self._info.pop(name, None)

    def settings_components(self) -> dict[str, Component]:
        """Components that own a ``[plugins.NAME]`` table (every kind but cache tiers), by name."""
        return {name: component for name, (_, component) in self.table_owners().items()}

    def aliases(self) -> dict[str, tuple[str, str]]:
        """Old setting names that components keep: ``"section.key"`` -> ``(component name, key)``."""
        return {
            alias: (component.name, target)
            for component in self.settings_components().values()
            for alias, target in component.aliases.items()
        }

    def table_owners(self) -> dict[str, tuple[str, Component]]:
        """``settings_components`` with each component's kind (a ``COMPONENT_KINDS`` key), by table name."""
        return {
            component.name: (kind, component)
            for kind, registry in self.registries.items()
            if kind != TIER_KIND
            for component in registry
            if component.settings is not None
        }

    def _check_settings_claim(self, kind: str, name: Any, plugin: str, metadata: dict[str, Any]) -> None:
        """One component per ``[plugins.NAME]`` table and per alias; aliases name keys core does not have."""
        settings, aliases = metadata.get("settings"), metadata.get("aliases") or {}
        key = name.strip().lower() if isinstance(name, str) else name
        label = COMPONENT_KINDS[kind][1]
        if kind == TIER_KIND and aliases:
            raise ValueError(
                f"plugin {plugin!r}: cache tier {key!r} cannot take aliases; its keys live in [[kv_cache.tiers]] entries"
            )
        if kind == TIER_KIND or settings is None:
            return
        if key == "enabled":
            raise ValueError(f"plugin {plugin!r}: a {label} with settings cannot be called 'enabled' ([plugins] enabled)")
        owner_kind, owner = self.table_owners().get(key, (kind, None))
        if owner is not None and owner_kind != kind:
            raise DuplicateComponentError(
                f"[plugins.{key}] is claimed twice: {COMPONENT_KINDS[owner_kind][1]} {key!r} of plugin "
                f"{owner.plugin!r} and {label} {key!r} of plugin {plugin!r} both declare settings; "
                "uninstall or disable one of them"
            )
        sections, taken = Settings.model_fields, self.aliases()
        for alias in aliases:
            section, _, old = str(alias).partition(".")
            core_keys = sections[section].annotation.model_fields if section in sections else {}
            if section not in sections or section == "plugins" or not old or old in core_keys:
                raise ValueError(
                    f"plugin {plugin!r}: alias {alias!r} of {key!r} must be SECTION.KEY naming a key [{section}] does not have"
                )
            if alias in taken:
                other = self.settings_components()[taken[alias][0]]
                raise DuplicateComponentError(
                    f"alias {alias} is claimed twice: by {other.name!r} of plugin {other.plugin!r} "
                    f"and by {key!r} of plugin {plugin!r}; uninstall or disable one of them"
                )

    def plugins(self) -> list[PluginInfo]:
        """Every loaded plugin, built-ins first, in load order."""
        return list(self._info.values())

    def as_dict(self) -> dict[str, list[dict[str, Any]]]:
        """``{"plugins": [...], "failures": [...]}``: what ``tierserve plugins --json`` and ``/v1/plugins`` show."""
        return {
            "plugins": [plugin.as_dict() for plugin in self.plugins()],
            "failures": [failure.as_dict() for failure in self.failures],
        }

    def call_lifecycle(self, hook_name: str, engine: Any) -> None:
        """Call ``on_startup``/``on_shutdown`` on each plugin; one failure does not stop the rest."""
        caller = getattr(self.pm.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):
            try:
                impl.function(engine=engine)
            except Exception:
                log.exception("plugin_hook_failed", plugin=impl.plugin_name, hook=hook_name)

    def _collect_components(self, plugin: object, name: str, settings: dict[str, list[str]]) -> dict[str, list[str]]:
        components: dict[str, list[str]] = {}
        for kind, (hook_name, _) in COMPONENT_KINDS.items():
            registry = self.registries[kind]
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin is not plugin:
                    continue

                def register(component_name: str, factory: Any, /, **metadata: Any) -> None:
                    self._check_settings_claim(kind, component_name, name, metadata)
                    check_component(kind, COMPONENT_KINDS[kind][1], component_name, factory, metadata.get("settings") is not None)
                    added = registry.add(component_name, factory, name, **metadata)
                    components.setdefault(kind, []).append(added.name)
                    if added.settings is not None:
                        settings[added.name] = list(added.settings.model_fields)

                impl.function(**{arg: register for arg in impl.argnames})
        return components

    def _fail(self, name: str, source: str, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"
        self.failures.append(PluginFailure(name, source, error))
        log.error("plugin_failed", plugin=name, source=source, error=error)


def check_hook_names(plugin: object) -> None:
    """Refuse a plugin with a function marked ``@hookimpl`` under a name no hookspec has (a misspelling would
    otherwise register nothing), naming the closest hook.

    Raises:
        ValueError: the unknown names, each with a suggestion, and the hooks there are."""
    import difflib

    marker = f"{hookspecs.PROJECT_NAME}_impl"
    known = sorted(n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), f"{hookspecs.PROJECT_NAME}_spec"))
    unknown = [n for n in dir(plugin) if hasattr(getattr(plugin, n, None), marker) and n not in known]
    if unknown:
        hints = [f"{n!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(n, known, 1)) else "")
                 for n in unknown]  # fmt: skip
        raise ValueError(f"unknown hook {', '.join(hints)}; the hooks are: {', '.join(known)}")


def entry_point_names(ep: EntryPoint) -> set[str]:
    """The names an allowlist entry may give an entry point: its own, its distribution's (with - or _), and
    ``dist:entry`` as ``tierserve plugins`` prints a second entry point of one distribution."""
    names = {ep.name.lower()}
    if ep.dist is not None:
        dist = ep.dist.name.lower()
        names |= {dist, dist.replace("_", "-"), f"{dist}:{ep.name.lower()}", f"{dist.replace('_', '-')}:{ep.name.lower()}"}
    return names


def _entry_point_allowed(ep: EntryPoint, allowlist: frozenset[str] | None) -> bool:
    return allowlist is None or bool(entry_point_names(ep) & allowlist)


def import_plugin_module(spec: str) -> ModuleType:
    """The module ``spec`` names: a ``.py`` file, a package folder (with ``__init__.py``), or a dotted module name.

    A file or folder is imported under its own name (the file's stem, the folder's name), as if its parent
    folder were on ``sys.path``, so its relative imports work.

    Raises:
        ImportError: nothing importable is there (the message says what was looked for).
    """
    path = Path(spec).expanduser()
    if spec.endswith(".py") or os.sep in spec or path.exists():
        if path.is_dir():
            init = path / "__init__.py"
            if not init.is_file():
                raise ImportError(f"plugin folder {spec} has no __init__.py: give the package folder or a .py file")
            name, location = path.resolve().name, init
            found = importlib.util.spec_from_file_location(name, location, submodule_search_locations=[str(path.resolve())])
        elif path.is_file():
            name = path.stem
            found = importlib.util.spec_from_file_location(name, path.resolve())
        else:
            raise ImportError(f"plugin {spec}: no such file or folder")
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(found.origin):
            return sys.modules[name]
        module = importlib.util.module_from_spec(found)
        sys.modules[name] = module
        try:
            found.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module
    return importlib.import_module(spec)


def add_plugin_modules(manager: PluginManager, modules: Iterable[str]) -> None:
    """Add each plugin under development (``import_plugin_module``) to ``manager``, named by its module."""
    for spec in modules:
        source = f"--plugin {spec}"
        manager.modules.append(spec)
        try:
            module = import_plugin_module(spec)
        except Exception as exc:
            manager._fail(spec, source, exc)
            continue
        manager.add_plugin(module, module.__name__, "dev", source)


def load_plugins(
    allowlist: Iterable[str] | None | str = "env",
    builtins: Iterable[str] = BUILTIN_PLUGINS,
    modules: Iterable[str] = (),
) -> PluginManager:
    """Build a plugin manager with the built-ins, the allowed installed plugins and the plugins under development.

    Args:
        allowlist: names of outside plugins to load; ``None`` loads all of
            them, an empty iterable none; the default ``"env"`` reads
            ``TIERSERVE_PLUGINS``.
        builtins: modules registered as built-in plugins.
        modules: plugins not installed as packages: ``.py`` files, package
            folders or importable module names (``import_plugin_module``);
            they load after the installed ones, whatever the allowlist.
    """
    from tierserve.core import __version__

    if allowlist == "env":
        allowed = parse_allowlist(os.environ.get(ALLOWLIST_ENV))
    elif allowlist is None:
        allowed = None
    else:
        allowed = frozenset(str(name).strip().lower() for name in allowlist)

    manager = PluginManager()
    manager.allowlist = None if allowed is None else sorted(allowed)
    for module_name in builtins:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            manager._fail(module_name, "builtin", exc)
            continue
        manager.add_plugin(module, module_name, __version__, "builtin")

    installed = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    if allowed:
        matched = set().union(*(entry_point_names(ep) for ep in installed)) if installed else set()
        unmatched = sorted(allowed - matched)
        if unmatched:
            log.warning("plugin_allowlist_unmatched", entries=unmatched, variable=ALLOWLIST_ENV,
                        installed=sorted({ep.dist.name if ep.dist else ep.name for ep in installed}))  # fmt: skip
    for ep in installed:
        if not _entry_point_allowed(ep, allowed):
            continue
        name = display_name(ep, installed)
        version = ep.dist.version if ep.dist is not None else "unknown"
        source = f"entry point {ep.value}"
        try:
            plugin = ep.load()
        except Exception as exc:
            manager._fail(name, source, exc)
            continue
        manager.add_plugin(plugin, name, version, source)
    add_plugin_modules(manager, modules)
    manager.reproducible = tuple(builtins) == BUILTIN_PLUGINS
    return manager


def display_name(ep: EntryPoint, installed: list[EntryPoint]) -> str:
    """The plugin's name in listings, errors and ``TIERSERVE_PLUGINS``: its distribution's, or
    ``dist:entry`` when the distribution has several entry points. It depends on nothing else installed
    and on no allowlist."""
    if ep.dist is None:
        return ep.name
    dist = ep.dist.name
    siblings = sum(1 for other in installed if other.dist is not None and other.dist.name == dist)
    return dist if siblings == 1 else f"{dist}:{ep.name}"
