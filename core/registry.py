"""Registries: one per component kind, name -> (factory, source plugin, metadata)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tierserve.core.errors import DuplicateComponentError, UnknownComponentError


@dataclass(frozen=True, slots=True)
class Component:
    """A registered component: what to build, which plugin provided it, and the settings it owns.

    Attributes:
        settings: the pydantic model of the component's own settings, or None.
        aliases: old setting names the component keeps, ``"section.key"`` -> key of ``settings``.
    """

    name: str
    factory: Any
    plugin: str
    metadata: dict[str, Any] = field(default_factory=dict)
    settings: type[BaseModel] | None = None
    aliases: dict[str, str] = field(default_factory=dict)


class Registry:
    """Components of one kind, keyed by case-insensitive name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._components: dict[str, Component] = {}

    def add(
        self,
        name: str,
        factory: Any,
        plugin: str,
        *,
        settings: type[BaseModel] | None = None,
        aliases: dict[str, str] | None = None,
        **metadata: Any,
    ) -> Component:
        """Record a component; a name already taken raises, naming both plugins."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"plugin {plugin!r} registered a {self.kind} with an empty or non-string name")
        key = name.strip().lower()
        if settings is not None and not (isinstance(settings, type) and issubclass(settings, BaseModel)):
            raise ValueError(
                f"plugin {plugin!r} registered {self.kind} {key!r} with settings={settings!r}; "
                "settings must be a pydantic BaseModel subclass"
            )
        aliases = dict(aliases or {})
        if aliases and settings is None:
            raise ValueError(f"plugin {plugin!r} registered {self.kind} {key!r} with aliases but no settings model")
        for alias, target in aliases.items():
            if target not in settings.model_fields:
                raise ValueError(
                    f"plugin {plugin!r}: alias {alias!r} of {self.kind} {key!r} points at {target!r}, "
                    f"which {settings.__name__} does not declare"
                )
        existing = self._components.get(key)
        if existing is not None:
            raise DuplicateComponentError(
                f"{self.kind} {key!r} is registered twice: by plugin {existing.plugin!r} "
                f"and by plugin {plugin!r}; uninstall or disable one of them"
            )
        component = Component(key, factory, plugin, dict(metadata), settings, aliases)
        self._components[key] = component
        return component

    def get(self, name: str) -> Component:
        """The component called ``name`` (any case), or ``UnknownComponentError``."""
        key = name.strip().lower()
        component = self._components.get(key)
        if component is None:
            raise UnknownComponentError(self.kind, name, self.names(), self.suggest(key))
        return component

    def suggest(self, name: str) -> str | None:
        """The registered name closest to ``name``, if any is close."""
        matches = difflib.get_close_matches(name.lower(), self.names(), n=1, cutoff=0.5)
        return matches[0] if matches else None

    def remove_plugin(self, plugin: str) -> None:
        """Forget every component a plugin registered (used when it fails to load)."""
        self._components = {k: c for k, c in self._components.items() if c.plugin != plugin}

    def names(self) -> list[str]:
        return sorted(self._components)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.strip().lower() in self._components

    def __iter__(self):
        return iter(self._components[k] for k in self.names())

    def __len__(self) -> int:
        return len(self._components)
