"""Several models behind one server: versions, aliases, loading and draining, a memory budget.

A model version is ``name@version`` and runs on its own engine; an alias (the
bare ``name``, and each entry's ``aliases``) points at one version and is
switched atomically once the target is ready, so requests in flight finish on
the version they started on and new ones go to the new one: a switch fails no
request. LoRA adapters of a model are names too: a request's ``model`` may
name one, and it runs on its base model's engine with that adapter.

Without ``[[models]]`` the registry holds the one ``[model]`` under its served
names, exactly as a single-model server answers.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from tierserve.core.errors import TierserveError
from tierserve.server.model_memory import MemoryEstimate, estimate_memory
from tierserve.core.sections import ModelEntry, ModelSettings, SchedulerSettings, Settings
from tierserve.server.errors import APIError, engine_down

if TYPE_CHECKING:
    from tierserve.engine import EngineClient
    from tierserve.core.plugins import PluginManager

log = structlog.get_logger(__name__)

DRAIN_POLL_SECONDS = 0.05
PROMPTS_REMEMBERED = 256  # distinct prompts counted per model, for warming a version an alias switches to


@dataclass
class ServedModel:
    """One loaded (or loading, failed, unloaded) model version."""

    id: str
    settings: Settings
    name: str
    version: str | None = None  # None: the single [model]
    engine: EngineClient | None = None
    status: str = "loading"  # loading, ready, failed, draining, unloaded
    error: str | None = None
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    memory: MemoryEstimate | None = None
    owns_engine: bool = True
    admitting: int = 0  # requests resolved to it and not yet submitted (or still running synchronously)
    prompts: Counter[tuple[int, ...]] = field(default_factory=Counter)  # most used prompts (token ids)

    @property
    def busy(self) -> bool:
        return self.admitting > 0 or bool(self.engine is not None and self.engine.in_flight())

    def remember_prompt(self, token_ids: list[int]) -> None:
        key = tuple(token_ids)
        if key not in self.prompts and len(self.prompts) >= PROMPTS_REMEMBERED:
            least, _ = min(self.prompts.items(), key=lambda item: item[1])
            del self.prompts[least]
        self.prompts[key] += 1


@dataclass
class Target:
    """What a request's ``model`` names: a version, the adapter on it (if any), and the name it sent."""

    name: str
    served: ServedModel
    lora_name: str | None = None
    admitted: bool = False

    @property
    def engine(self) -> EngineClient:
        engine = self.served.engine
        if engine is None:
            raise APIError(503, "the engine core is not running; restart the server", code="engine_unavailable")
        if not engine.alive:
            raise engine_down(engine)
        return engine

    def release(self) -> None:
        """The request is submitted (its engine tracks it now) or done: an unload need not wait for it here."""
        if self.admitted:
            self.admitted = False
            self.served.admitting -= 1


LOCAL_BOUNDS = ("capacity", "max_bytes")  # a local tier's bounds, split between the versions by kv_share


def entry_settings(base: Settings, entry: ModelEntry, share: float) -> Settings:
    """The settings one ``[[models]]`` version runs with: its [model] keys, its scheduler keys,
    ``share`` of the L1 pool and of each local tier's bounds, and its own folder in every disk tier."""
    model = ModelSettings(**entry.model_dump(include=set(ModelSettings.model_fields), exclude={"served_model_name"}))
    scheduler = SchedulerSettings(**{**base.scheduler.model_dump(), **entry.scheduler})
    kv = base.kv_cache.model_copy(deep=True)
    kv.l1_capacity = max(1, int(kv.l1_capacity * share))
    if kv.l1_max_bytes is not None:
        kv.l1_max_bytes = max(1, int(kv.l1_max_bytes * share))
    for tier in kv.tiers:
        bounds = {
            key: max(1, int(value * share))
            for key in LOCAL_BOUNDS
            if isinstance(value := getattr(tier.options, key, None), int) and value > 0
        }
        path = getattr(tier.options, "path", None)
        if tier.plugin == "disk" and path:  # two engines never share a disk tier's index: each version gets a folder
            bounds["path"] = f"{path.rstrip('/')}/model-{entry.id.replace('/', '_').replace('@', '-')}"
        tier.options = tier.options.model_copy(update=bounds)
    settings = base.model_copy(update={"model": model, "scheduler": scheduler, "kv_cache": kv, "models": []})
    for name, options in base._plugin_options.items():
        settings.set_plugin_options(name, options)
    return settings


class ModelRegistry:
    """The served models and aliases of one server; every change is made under one lock.

    Args:
        settings: the server's settings (``[[models]]`` or ``[model]``, ``[registry]``).
        plugins: the plugin manager engines are built with.
        engine: an engine built by the caller for the single ``[model]`` (tests share one).
    """

    def __init__(self, settings: Settings, plugins: PluginManager, engine: EngineClient | None = None) -> None:
        self.settings = settings
        self.plugins = plugins
        self.models: dict[str, ServedModel] = {}
        self.aliases: dict[str, str] = {}  # name -> model id
        self._unlisted: dict[str, str] = {}  # names accepted but not listed -> model id
        self._configured: set[str] = set()  # aliases the settings give (kept when a version is removed)
        self.default_id = ""
        self._lock = threading.RLock()
        self._load_lock = threading.Lock()  # one load at a time: the budget check sees every loaded model
        if settings.models:
            share = 1.0 / len(settings.models)
            for entry in settings.models:
                self._add(entry, entry_settings(settings, entry, entry.kv_share or share))
            self._configured = set(self.aliases)
        else:
            names = settings.model.model_names or [settings.model.path]
            served = ServedModel(names[0], settings, names[0], engine=engine, owns_engine=engine is None)
            self.models[served.id] = served
            self.default_id = served.id
            for name in names[1:]:
                self.aliases[name] = served.id
            self._unlisted[settings.model.path] = served.id  # the path answers too, as before served names
            for name in settings.model.accepted_names:
                self._unlisted.setdefault(name, served.id)

    def _add(self, entry: ModelEntry, settings: Settings) -> ServedModel:
        served = ServedModel(entry.id, settings, entry.name, entry.version)
        self.models[served.id] = served
        self.default_id = self.default_id or served.id
        self.aliases.setdefault(entry.name, served.id)
        for alias in entry.aliases:
            self.aliases[alias] = served.id
        return served

    # ---- names -----------------------------------------------------------------------

    @property
    def default(self) -> ServedModel | None:
        return self.models.get(self.default_id)

    def names(self) -> list[str]:
        """Every name a request may send, the default model's first."""
        with self._lock:
            names = list(self.models)
            names.sort(key=lambda i: i != self.default_id)
            names += [alias for alias in self.aliases if alias not in self.models]
            for served in self.models.values():
                if served.engine is not None:
                    names += [name for name in served.engine.loras if name not in names]
            return names

    def resolve(self, name: str | None, *, admit: bool = False) -> Target:
        """The version (and adapter) ``name`` selects; the default model when ``None``. 404 for an unknown
        name (listing the served ones), 503 while the version is loading or being unloaded.

        ``admit``: count the request on the version until ``Target.release`` (an unload waits for it).
        """
        with self._lock:
            if name is None:
                served = self.default
                if served is None:
                    raise APIError(404, "no model is loaded; load one with POST /v1/models", param="model",
                                   code="model_not_found")  # fmt: skip
                target = Target(served.id, served)
            else:
                target = self._lookup(name)
            self._check_servable(target.served)
            target.served.last_used = time.monotonic()
            if admit:
                target.served.admitting += 1
                target.admitted = True
        return target

    def reload_if_unloaded(self, name: str | None) -> bool:
        """With ``[registry] unload_idle``, load again a version that was unloaded to make room (as
        Ollama reloads on the next request); True if it did. Blocks while loading: call off the event loop."""
        if not self.settings.registry.unload_idle:
            return False
        with self._lock:
            try:
                served = self._lookup(name).served if name is not None else self.default
            except APIError:
                return False
            if served is None or served.status != "unloaded":
                return False
            served.status = "loading"
        try:
            self._load(served)
        except TierserveError:
            return False
        return True

    def lookup(self, name: str) -> Target:
        """What ``name`` names, whatever its status (404 for an unknown name)."""
        with self._lock:
            return self._lookup(name)

    def _lookup(self, name: str) -> Target:
        model_id = name if name in self.models else self.aliases.get(name, self._unlisted.get(name))
        if model_id is not None and model_id in self.models:
            return Target(name, self.models[model_id])
        for served in self.models.values():
            if served.engine is not None and name in served.engine.loras:
                return Target(name, served, lora_name=name)
        raise APIError(
            404,
            f"model {name!r} does not exist; this server serves {', '.join(repr(n) for n in self.names())}",
            param="model",
            code="model_not_found",
        )

    def _check_servable(self, served: ServedModel) -> None:
        if served.status == "ready" and served.engine is not None:
            return
        if served.status == "loading":
            raise APIError(503, f"model {served.id!r} is still loading", code="not_ready", headers={"Retry-After": "5"})
        if served.status == "draining":
            raise APIError(503, f"model {served.id!r} is being unloaded", code="model_unloading",
                           headers={"Retry-After": "5"})  # fmt: skip
        if served.status == "unloaded":
            raise APIError(503, f"model {served.id!r} is not loaded; load it again with POST /v1/models",
                           code="model_unloaded")  # fmt: skip
        raise APIError(503, f"model {served.id!r} failed to load: {served.error}", code="not_ready",
                       headers={"Retry-After": "5"})  # fmt: skip

    # ---- loading -----------------------------------------------------------------------

    def load_configured(self) -> None:
        """Load every configured version in order (start-up); the first failure raises."""
        for served in list(self.models.values()):
            self._load(served)

    def add_and_load(self, entry: ModelEntry) -> ServedModel:
        """``POST /v1/models``: load a version from a path. 409 when its id is taken or an alias would move,
        or the load would pass ``[registry]`` limits; 400 when it cannot be loaded (the reason)."""
        with self._lock:
            existing = self.models.get(entry.id)
            if existing is not None and existing.status not in ("unloaded", "failed"):
                raise APIError(409, f"model {entry.id!r} is already {existing.status}; unload it first or use "
                               "another version", param="version", code="model_exists")  # fmt: skip
            taken = [a for a in entry.aliases if self.aliases.get(a, entry.id) != entry.id]
            if taken:
                raise APIError(409, f"aliases: {', '.join(taken)} already point at other versions; switch them with "
                               "POST /v1/models/aliases once this one is ready", param="aliases",
                               code="alias_exists")  # fmt: skip
            share = entry.kv_share or 1.0 / max(1, len(self.settings.models) or 1)
            served = self._add(entry, entry_settings(self.settings, entry, share))
        try:
            self._load(served)
        except BaseException as exc:
            with self._lock:  # nothing may point at a version that is not there
                if self.models.get(served.id) is served:
                    del self.models[served.id]
                self.aliases = {a: t for a, t in self.aliases.items() if t != served.id or a in self._configured}
                if self.default_id == served.id:
                    self._pick_default()
            if isinstance(exc, TierserveError):
                raise APIError(400, f"model {entry.id!r} failed to load: {exc}", param="path", code="load_failed") from None
            raise
        return served

    def _load(self, served: ServedModel) -> None:
        with self._load_lock:
            served.status, served.error = "loading", None
            try:
                if served.engine is None:
                    served.memory = estimate_memory(served.settings)
                    self._make_room(served)
                    from tierserve.engine import EngineClient

                    served.engine = EngineClient.from_settings(served.settings, self.plugins)
                    served.owns_engine = True
                served.engine.start()
            except BaseException as exc:
                if served.engine is not None and served.owns_engine:
                    served.engine.close()
                    served.engine = None
                if isinstance(exc, APIError):  # refused by [registry] limits: nothing failed, it is just not loaded
                    served.status = "unloaded"
                else:
                    served.status, served.error = "failed", f"{type(exc).__name__}: {exc}"
                raise
            served.status = "ready"
            served.last_used = time.monotonic()
            log.info("model_loaded", model=served.id, memory_bytes=served.memory.total if served.memory else None)

    def _loaded(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.engine is not None and m.status in ("ready", "loading", "draining")]

    def _make_room(self, incoming: ServedModel) -> None:
        """Refuse (409) a load past ``max_loaded_models`` or ``memory_budget_bytes``, or with
        ``unload_idle`` unload the least recently used idle versions until it fits."""
        policy = self.settings.registry
        need = incoming.memory.total if incoming.memory else 0

        def over() -> str | None:
            loaded = [m for m in self._loaded() if m is not incoming]
            if len(loaded) + 1 > policy.max_loaded_models:
                return f"{len(loaded)} models are loaded and registry.max_loaded_models is {policy.max_loaded_models}"
            used = sum(m.memory.total for m in loaded if m.memory)
            budget = policy.memory_budget_bytes
            if budget is not None and used + need > budget:
                return (f"model {incoming.id!r} needs about {need} bytes (weights and KV pool), the loaded models take "
                        f"{used} and registry.memory_budget_bytes is {budget}")  # fmt: skip
            return None

        reason = over()
        while reason is not None and policy.unload_idle:
            with self._lock:  # no request is admitted to the victim between the check and the unload
                idle = [m for m in self._loaded() if m is not incoming and m.status == "ready" and not m.busy]
                if not idle:
                    break
                victim = min(idle, key=lambda m: m.last_used)
                victim.status = "draining"
            log.info("model_unloaded_idle", model=victim.id, reason=reason, for_model=incoming.id)
            self._free(victim, status="unloaded")
            reason = over()
        if reason is not None:
            hint = "" if policy.unload_idle else "; unload one (DELETE /v1/models/{id}) or set registry.unload_idle"
            raise APIError(409, f"cannot load {incoming.id!r}: {reason}{hint}", param="model",
                           code="model_budget_exceeded")  # fmt: skip

    # ---- unloading and aliases --------------------------------------------------------------

    def unload(self, model_id: str, timeout: float) -> int:
        """Drain then free a version: it takes no new request; running ones finish (at most ``timeout``
        seconds, then they are aborted). Returns how many were running when it started. 409 while an
        alias points at it, 404 for an unknown id."""
        with self._lock:
            served = self.models.get(model_id) or self.models.get(self.aliases.get(model_id, ""))
            if served is None or served.status in ("unloaded", "failed") and served.engine is None:
                raise APIError(404, f"model {model_id!r} is not loaded; loaded: "
                               f"{', '.join(sorted(m.id for m in self._loaded())) or 'none'}", param="model_id",
                               code="model_not_found")  # fmt: skip
            if served.status == "loading":
                raise APIError(409, f"model {served.id!r} is still loading; unload it once it is ready",
                               param="model_id", code="model_loading")  # fmt: skip
            pointing = sorted(a for a, target in self.aliases.items() if target == served.id and a != served.name)
            named = self.aliases.get(served.name) == served.id and any(
                m.name == served.name and m is not served and m.engine is not None for m in self.models.values()
            )
            if pointing or named:
                aliases = pointing + ([served.name] if named else [])
                raise APIError(409, f"alias {', '.join(repr(a) for a in aliases)} points at {served.id!r}; switch "
                               "it to another version first (POST /v1/models/aliases)", param="model_id",
                               code="alias_points_here")  # fmt: skip
            if served.status == "draining":
                raise APIError(409, f"model {served.id!r} is already being unloaded", code="model_unloading")
            served.status = "draining"
        running = len(served.engine.in_flight()) if served.engine is not None else 0
        deadline = time.monotonic() + timeout
        while served.busy and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_SECONDS)
        with self._lock:
            self._free(served, status="unloaded")
            if served.version is not None:
                del self.models[served.id]
                self.aliases = {a: t for a, t in self.aliases.items() if t != served.id}
            if self.default_id == served.id:
                self._pick_default()
        log.info("model_unloaded", model=served.id, drained_requests=running)
        return running

    def _pick_default(self) -> None:
        """The first ready version becomes the default (the one before it is gone)."""
        ready = [m for m in self.models.values() if m.status == "ready"]
        self.default_id = ready[0].id if ready else ""

    def _free(self, served: ServedModel, *, status: str) -> None:
        engine, served.engine = served.engine, None
        served.status = status
        if engine is not None:
            if served.owns_engine:
                engine.close()
            else:
                engine.shutdown()

    def switch_alias(self, alias: str, model_id: str) -> str | None:
        """Point ``alias`` at a ready version (atomically; requests in flight finish where they are).
        Returns the version it pointed at before. 404 for an unknown version, 409 if it is not ready
        or ``alias`` is itself a version id."""
        with self._lock:
            target = self.models.get(model_id)
            if target is None:
                raise APIError(404, f"model {model_id!r} does not exist; versions: {', '.join(sorted(self.models))}",
                               param="model", code="model_not_found")  # fmt: skip
            if target.status != "ready":
                raise APIError(409, f"model {model_id!r} is {target.status}; an alias may only point at a ready "
                               "version", param="model", code="model_not_ready")  # fmt: skip
            if alias in self.models:
                raise APIError(409, f"alias: {alias!r} is a version id, not an alias", param="alias",
                               code="invalid_value")  # fmt: skip
            before = self.aliases.get(alias)
            self.aliases[alias] = model_id
        log.info("model_alias_switched", alias=alias, model=model_id, previous=before)
        return before

    def top_prompts(self, source_id: str | None, limit: int) -> list[list[int]]:
        """The most used prompts of a version (call it on the event loop, which counts them)."""
        source = self.models.get(source_id or "")
        if source is None or limit <= 0:
            return []
        return [list(ids) for ids, _ in source.prompts.most_common(limit)]

    def warm_with(self, prompts: list[list[int]], target: ServedModel) -> int:
        """Replay ``prompts`` on ``target`` (prefill only; off the event loop); returns prompts warmed."""
        if target.engine is None:
            return 0
        limit_len = target.engine.max_model_len - 1
        prompts = [p for p in prompts if len(p) <= limit_len and all(t < target.engine.info.vocab_size for t in p)]
        if prompts:
            target.engine.warm(prompts)
        return len(prompts)

    def servable(self) -> bool:
        """Whether any version can take a request now or once loaded (with ``unload_idle`` an unloaded one is
        loaded again on demand): false once every served model was unloaded by hand or failed."""
        again = self.settings.registry.unload_idle
        return any(m.status in ("ready", "loading", "draining") or m.status == "unloaded" and again
                   for m in self.models.values())  # fmt: skip

    def statuses(self) -> dict[str, str]:
        """Every version's status, by id."""
        with self._lock:
            return {model_id: served.status for model_id, served in sorted(self.models.items())}

    def describe(self, served: ServedModel) -> dict[str, Any]:
        """What ``/v1/models`` shows of a version beyond OpenAI's fields."""
        engine = served.engine
        return {
            "version": served.version,
            "status": served.status,
            "error": served.error,
            "aliases": sorted(a for a, t in self.aliases.items() if t == served.id),
            "memory_bytes": served.memory.total if served.memory else None,
            "lora_adapters": sorted(engine.loras) if engine is not None else [],
        }

    def close(self) -> None:
        for served in list(self.models.values()):
            self._free(served, status="unloaded")
