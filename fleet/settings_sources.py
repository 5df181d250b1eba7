"""Where a fleet's settings come from, in a form every Ray worker can load again, and each replica's own changes.

The ``tierserve fleet`` command validates the settings once; each replica
then loads the same preset, file and overrides (a file path must exist on
every node: presets and ``--set`` travel with the application).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierserve.settings.config import LoadedSettings, load_settings


@dataclass(frozen=True)
class SettingsSources:
    """A preset name or path, an optional TOML file, and ``(section, key) -> value`` overrides."""

    preset: str | None = "development"
    config_file: str | None = None
    overrides: tuple[tuple[str, str, Any], ...] = field(default=())

    @classmethod
    def of(cls, preset: str | None, config_file: str | None, overrides: dict[tuple[str, str], Any]) -> SettingsSources:
        config = str(Path(config_file).resolve()) if config_file else None
        return cls(preset, config, tuple((section, key, value) for (section, key), value in overrides.items()))

    def as_json(self) -> dict[str, Any]:
        """Plain JSON (Ray Serve's router kwargs must be): ``from_json`` gives these sources back."""
        return {"preset": self.preset, "config_file": self.config_file, "overrides": [list(o) for o in self.overrides]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SettingsSources:
        overrides = tuple((section, key, value) for section, key, value in data.get("overrides", ()))
        return cls(data.get("preset"), data.get("config_file"), overrides)

    def load(self, **more: Any) -> LoadedSettings:
        """The settings, with ``more`` (``"section__key"``) over the overrides."""
        overrides = {(section, key): value for section, key, value in self.overrides}
        for dotted, value in more.items():
            section, key = dotted.split("__")
            overrides[(section, key)] = value
        return load_settings(preset=self.preset, config_file=self.config_file, overrides=overrides)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replica_settings(sources: SettingsSources, label: str) -> LoadedSettings:
    """A replica's settings: its server on a free loopback port (only the ingress listens outside), and
    each disk tier in its own ``replica-<label>`` folder (deployment and rank), so replicas on one
    machine never share a directory."""
    loaded = sources.load(server__host="127.0.0.1", server__port=free_port())
    for tier in loaded.settings.kv_cache.tiers:
        path = getattr(tier.options, "path", None)
        if tier.plugin == "disk" and path:
            tier.options = tier.options.model_copy(update={"path": str(Path(path).expanduser() / f"replica-{label}")})
    return loaded
