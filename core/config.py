"""Settings: sections, presets and the layered loader that remembers where each value came from.

Sources, later wins: the Settings defaults -> a preset (``configs/NAME.toml``)
-> ``--config FILE`` -> environment ``TIERSERVE_SECTION__KEY`` -> CLI flags.
Every error names the key, the bad value and the source it came from.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tierserve.core.errors import ConfigError, UnknownComponentError
from tierserve.core.plugins import ALLOWLIST_ENV, PluginManager, load_plugins, parse_allowlist

ENV_PREFIX = "TIERSERVE_"
ENV_DELIMITER = "__"
DEFAULT_SOURCE = "default"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerSettings(Section):
    """[server]: where and how the HTTP server listens."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = None
    max_request_bytes: int = Field(10 * 1024 * 1024, gt=0)
    shutdown_grace_seconds: float = Field(30.0, ge=0)
    rate_limit_per_minute: int | None = Field(None, gt=0, description="requests per minute per API key (or client address)")
    public_health: bool = True
    public_metrics: bool = True
    retry_after_seconds: int = Field(1, ge=1, description="Retry-After sent with 503 when the queue is full")
    engine_process: bool = Field(
        False, description="run the engine core in a child process (tokenizing and HTTP stay in the server process)"
    )


class ModelSettings(Section):
    """[model]: which checkpoint, which backend, on which device."""

    path: str = "builtin:tiny"
    backend: str = "native"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    max_model_len: int | None = Field(None, gt=0)
    seed: int = 0
    linear_kernel: Literal["auto", "onednn", "torch"] = Field(
        "auto", description="native backend matmuls: oneDNN prepacked weights on CPU (auto), or torch's F.linear"
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind = value.split(":", 1)[0]
        if kind not in {"auto", "cpu", "cuda", "mps"}:
            raise ValueError("must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
        return value


class SchedulerSettings(Section):
    """[scheduler]: batching budgets and queue bounds."""

    name: str = "fcfs"
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(2048, gt=0)
    max_waiting_requests: int = Field(512, gt=0)


class KVCacheSettings(Section):
    """[kv_cache]: the L1 block pool, L2 host memory and L3 disk tiers."""

    block_size: int = Field(16, gt=0)
    l1_capacity: int = Field(5000, gt=0, description="blocks in the L1 pool")
    l1_max_bytes: int | None = Field(None, gt=0, description="size L1 by bytes instead (overrides l1_capacity)")
    l2_capacity: int = Field(50000, ge=0, description="blocks held in L2 host memory; 0 disables L2")
    max_memory_bytes: int = Field(1_000_000_000, ge=0, description="byte bound of L2")
    eviction_policy: str = "adaptive"
    l2_tier: str = "memory"
    l3_tier: str = "disk"
    l2_eviction_policy: str | None = None
    l3_eviction_policy: str | None = None
    ttl_seconds: float | None = Field(3600, ge=0, description="0 or unset: entries never expire")
    enable_prefix_caching: bool = True
    disk_path: str | None = Field(None, description="L3 directory; unset disables L3")
    max_disk_bytes: int = Field(10 * 1024**3, ge=0)
    persistence: bool = False
    compression_level: int = Field(3, ge=1, le=22)
    l3_write_queue: int = Field(256, gt=0, description="pending L3 writes before new ones are dropped")
    l3_writer_nice: int = Field(
        10, ge=0, le=19, description="added to the L3 writer thread's niceness: persistence yields the CPU to decoding"
    )
    warm_prompts: list[str] = Field(default_factory=list)
    warm_prompts_file: str | None = None


class SpeculativeSettings(Section):
    """[speculative]: speculative decoding and beam search defaults."""

    method: str | None = None
    num_speculative_tokens: int = Field(4, ge=1, le=64)
    adaptive: bool = True  # shrink k when drafts are rejected, grow it back when they are accepted
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    draft_model: str | None = None
    beam_width: int = Field(4, ge=1, le=16)
    temperature: float = Field(0.8, ge=0)
    top_k: int = Field(40, ge=-1)
    top_p: float = Field(0.9, gt=0, le=1)


class SlidingWindowSettings(Section):
    """[sliding_window]: bounded-memory generation past the KV budget."""

    enabled: bool = False
    window_size: int = Field(512, gt=0)
    window_overlap: int = Field(64, ge=0)
    sink_tokens: int = Field(4, ge=0)
    use_flash_attention: bool = True

    @model_validator(mode="after")
    def _overlap_fits(self) -> SlidingWindowSettings:
        if self.window_overlap >= self.window_size:
            raise ValueError(
                f"window_overlap ({self.window_overlap}) must be smaller than window_size ({self.window_size})"
            )
        return self


class MonitoringSettings(Section):
    """[monitoring]: metrics collection."""

    enabled: bool = True
    collection_interval_seconds: float = Field(30, gt=0)
    detailed_profiling: bool = False
    prometheus: bool = True
    trend_samples: int = Field(120, gt=0, description="samples kept for /v1/cache/stats trends")
    alert_hit_rate_below: float | None = Field(None, ge=0, le=1)
    alert_memory_bytes_above: int | None = Field(None, gt=0)
    alert_dropped_writes_above: int | None = Field(0, ge=0)
    alert_queue_fraction_above: float | None = Field(0.9, gt=0, le=1)


class PluginSettings(Section):
    """[plugins]: which installed plugins load (``TIERSERVE_PLUGINS`` overrides)."""

    enabled: list[str] | None = None


class AuthSettings(Section):
    """[auth]: API keys; with none configured the API is open."""

    api_keys: list[str] = Field(default_factory=list)
    admin_api_keys: list[str] = Field(default_factory=list)


class LoggingSettings(Section):
    """[logging]: structlog output."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["console", "json"] = "console"


class Settings(BaseSettings):
    """All of tierserve's settings, one section per concern."""

    model_config = SettingsConfigDict(extra="forbid", validate_assignment=True)

    server: ServerSettings = Field(default_factory=ServerSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    kv_cache: KVCacheSettings = Field(default_factory=KVCacheSettings)
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    sliding_window: SlidingWindowSettings = Field(default_factory=SlidingWindowSettings)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)
    plugins: PluginSettings = Field(default_factory=PluginSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, *args, **kwargs):
        # load_settings() layers presets, files, env and flags itself so it can
        # say where each value came from; the model only validates.
        return (init_settings,)


# (section, key) -> registry kind whose names the value must be
COMPONENT_KEYS: dict[tuple[str, str], str] = {
    ("model", "backend"): "backends",
    ("scheduler", "name"): "schedulers",
    ("kv_cache", "eviction_policy"): "eviction_policies",
    ("kv_cache", "l2_eviction_policy"): "eviction_policies",
    ("kv_cache", "l3_eviction_policy"): "eviction_policies",
    ("kv_cache", "l2_tier"): "cache_tiers",
    ("kv_cache", "l3_tier"): "cache_tiers",
    ("speculative", "method"): "speculators",
}


@dataclass
class LoadedSettings:
    """Validated settings, the source of every value, and the plugins they were checked against."""

    settings: Settings
    sources: dict[tuple[str, str], str]
    plugins: PluginManager
    layers: list[str] = field(default_factory=list)

    def source_of(self, section: str, key: str) -> str:
        return self.sources.get((section, key), DEFAULT_SOURCE)

    def explain(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{section: {key: {"value": ..., "source": ...}}}`` for every setting."""
        data = self.settings.model_dump(mode="json")
        return {
            section: {key: {"value": value, "source": self.source_of(section, key)} for key, value in values.items()}
            for section, values in data.items()
        }


def preset_names() -> list[str]:
    """The presets shipped in ``tierserve.configs``."""
    folder = resources.files("tierserve.configs")
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def preset_path(name: str) -> Path:
    """The file of a shipped preset, or a path given as the preset itself."""
    candidate = Path(name)
    if candidate.suffix == ".toml":
        if not candidate.is_file():
            raise ConfigError(f"preset file {name!r} does not exist")
        return candidate
    resource = resources.files("tierserve.configs") / f"{name}.toml"
    if not resource.is_file():
        available = preset_names()
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(available)}{_suggest(name, available)}")
    return Path(str(resource))


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the bytes before it parses them
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None


def env_layers(environ: Mapping[str, str]) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """``TIERSERVE_SECTION__KEY=value`` variables, one settings layer per variable.

    Values that look like JSON lists or objects are parsed as JSON; everything
    else stays a string for the settings model to coerce (``"8"`` -> 8).
    """
    layers = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX) or ENV_DELIMITER not in name:
            continue
        raw = environ[name]
        section, _, key = name[len(ENV_PREFIX) :].lower().partition(ENV_DELIMITER)
        value: Any = raw
        if raw.strip().startswith(("[", "{")):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                raise ConfigError(f"environment variable {name}: invalid JSON value {raw!r}") from None
        layers.append((name, {section: {key: value}}))
    return layers


def parse_override(assignment: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` (value in TOML syntax, else a plain string)."""
    dotted, sep, raw = assignment.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {assignment!r}: expected SECTION.KEY=VALUE, e.g. kv_cache.l1_capacity=1000")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section.strip(), key.strip(), value


def _suggest(name: str, choices: list[str]) -> str:
    hint = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f"; did you mean {hint[0]!r}?" if hint else ""


def _merge_layer(
    merged: dict[str, dict[str, Any]],
    sources: dict[tuple[str, str], str],
    layer: Mapping[str, Any],
    label: str,
) -> None:
    sections = Settings.model_fields
    for section, table in layer.items():
        if section not in sections:
            raise ConfigError(
                f"unknown section [{section}] in {label}; available sections: "
                f"{', '.join(sections)}{_suggest(section, list(sections))}"
            )
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{section}] in {label} must be a table of keys, got {table!r}")
        keys = list(sections[section].annotation.model_fields)
        for key, value in table.items():
            if key not in keys:
                raise ConfigError(
                    f"unknown key {section}.{key} in {label}; keys of [{section}]: "
                    f"{', '.join(keys)}{_suggest(key, keys)}"
                )
            merged.setdefault(section, {})[key] = value
            sources[(section, key)] = label


def _validation_message(exc: ValidationError, merged: dict, sources: dict[tuple[str, str], str]) -> str:
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        section = loc[0] if loc else "?"
        key = loc[1] if len(loc) > 1 else None
        if key is not None and (section, key) in sources:
            where = sources[(section, key)]
            value = merged[section][key]
            lines.append(f"{section}.{key} = {value!r} (from {where}): {error['msg']}")
        else:
            # a rule across keys of one section: name every source that fed it
            involved = sorted({src for (sec, _), src in sources.items() if sec == section}) or [DEFAULT_SOURCE]
            lines.append(f"[{section}] (from {', '.join(involved)}): {error['msg']}")
    return "invalid settings:\n  " + "\n  ".join(lines)


def check_components(settings: Settings, plugins: PluginManager, sources: dict[tuple[str, str], str]) -> None:
    """Fail on a component name no plugin registered; store names in canonical (lower) case."""
    for (section, key), kind in COMPONENT_KEYS.items():
        value = getattr(getattr(settings, section), key)
        if value is None:
            continue
        try:
            component = plugins.registry(kind).get(value)
        except UnknownComponentError as exc:
            where = sources.get((section, key), DEFAULT_SOURCE)
            raise ConfigError(f"{section}.{key} = {value!r} (from {where}): {exc}") from None
        setattr(getattr(settings, section), key, component.name)


def load_settings(
    preset: str | None = "development",
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[tuple[str, str], Any] | None = None,
    plugins: PluginManager | None = None,
) -> LoadedSettings:
    """Resolve settings from all sources and validate them, components included.

    Args:
        preset: a shipped preset name (``development``, ``production``) or a
            path to a TOML file; ``None`` starts from the defaults alone.
        config_file: a TOML file layered over the preset.
        environ: environment to read ``TIERSERVE_*`` from (default ``os.environ``).
        overrides: ``(section, key) -> value`` from command-line flags.
        plugins: the plugin manager to validate names against; by default
            one is loaded with the allowlist these settings resolve to.

    Raises:
        ConfigError: naming the key, the bad value and its source.
    """
    environ = os.environ if environ is None else environ
    merged: dict[str, dict[str, Any]] = {}
    sources: dict[tuple[str, str], str] = {}
    layers: list[str] = []

    def add(layer: Mapping[str, Any], label: str) -> None:
        _merge_layer(merged, sources, layer, label)
        layers.append(label)

    if preset is not None:
        path = preset_path(preset)
        add(read_toml(path), f"preset {preset} ({path})")
    if config_file is not None:
        path = Path(config_file)
        add(read_toml(path), f"config file {path}")
    for name, layer in env_layers(environ):
        add(layer, f"environment variable {name}")
    cli: dict[str, dict[str, Any]] = {}
    for (section, key), value in (overrides or {}).items():
        cli.setdefault(section, {})[key] = value
    add(cli, "command line")

    try:
        settings = Settings(**merged)
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc, merged, sources)) from None

    if plugins is None:
        allow_env = environ.get(ALLOWLIST_ENV)
        allowlist = parse_allowlist(allow_env) if allow_env is not None else settings.plugins.enabled
        plugins = load_plugins(allowlist=allowlist)
    check_components(settings, plugins, sources)
    return LoadedSettings(settings, sources, plugins, layers)
