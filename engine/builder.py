"""Assembling an engine from settings: backend, pool, store, KV manager, scheduler, runner, core, client.

Every component comes from the plugin registries, by the names the settings
give, exactly as an outside plugin's would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from tierserve.cache.block_pool import BlockPool
from tierserve.cache.guarded_tier import GuardedTier
from tierserve.cache.kv_manager import KVCacheManager, StreamingWindow
from tierserve.cache.named_prefixes import NamedPrefixes
from tierserve.cache.store import StoreTier, TieredStore
from tierserve.engine import memory_budget
from tierserve.engine.host_memory import keep_large_buffers
from tierserve.engine.core import EngineCore
from tierserve.engine.messages import ModelInfo
from tierserve.engine.profiling import CORE_PHASES, PhaseClock
from tierserve.core.backend import ModelBackend
from tierserve.models.backend_choice import AUTO, UnsupportedModel, backend_candidates
from tierserve.engine.requests import RequestError
from tierserve.engine.runner import ModelRunner
from tierserve.core.errors import ConfigError
from tierserve.cache.figures import Figures, FigureSource
from tierserve.core.plugins import PluginManager, load_plugins
from tierserve.core.registry import Component
from tierserve.core.scheduler import ModelLimits

if TYPE_CHECKING:
    from tierserve.cache.tier import CacheTier
    from tierserve.core.speculation import Speculator
    from tierserve.core.tier_settings import TierSettings
    from tierserve.settings.config import Settings

log = structlog.get_logger(__name__)


def build_core(settings: Settings, plugins: PluginManager | None = None) -> EngineCore:
    """The engine core ``settings`` describe, built in this process."""
    plugins = plugins or load_plugins()
    backend = load_backend(settings, plugins)
    kv = settings.kv_cache
    spec = backend.kv_spec(kv.block_size)
    num_blocks = kv.l1_capacity
    if kv.l1_max_bytes is not None and spec.block_bytes:
        num_blocks = max(1, kv.l1_max_bytes // spec.block_bytes)
    device_type = backend.device.type
    fitted = memory_budget.fit_l1_blocks(
        num_blocks, spec.block_bytes, device_type, memory_budget.device_available_bytes(backend.device), kv.l1_memory_fraction
    )
    if fitted.reason is not None:
        log.warning("kv_l1_sized_down", configured_blocks=num_blocks, blocks=fitted.value, reason=fitted.reason)
        num_blocks = fitted.value
    host_left = memory_budget.host_available_bytes()  # for the memory tiers, once the pool is taken
    if host_left is not None and device_type == "cpu":
        host_left -= num_blocks * spec.block_bytes
    policies = plugins.registry("eviction_policies")
    pool = BlockPool(num_blocks, kv.block_size, policies.get(kv.eviction_policy).factory(num_blocks))
    backend.allocate_kv_cache(num_blocks, kv.block_size)
    store = build_store(settings, plugins, backend, pool, host_left)
    manager = KVCacheManager(pool, store, spec, StreamingWindow.of(settings.sliding_window))
    limits = ModelLimits(backend.max_model_len, backend.eos_token_ids)
    component = plugins.registry("schedulers").get(settings.scheduler.name)
    options = component.settings
    extra = {"options": settings.plugin_options(component.name, options)} if options is not None else {}
    scheduler = component.factory(settings.scheduler, manager, model=limits, **extra)
    clock = PhaseClock(CORE_PHASES) if settings.monitoring.detailed_profiling else None
    speculators = build_speculators(settings, plugins, backend)
    runner = ModelRunner(
        backend,
        speculators,
        max_draft_tokens=settings.speculative.num_speculative_tokens,
        adaptive=settings.speculative.adaptive,
        max_tree_nodes=settings.speculative.max_tree_nodes,
        # half the step's token budget at most: trees never crowd out decodes and prefills
        step_tree_nodes=min(settings.speculative.step_tree_nodes, max(1, settings.scheduler.max_num_batched_tokens // 2)),
        clock=clock,
    )
    keys = build_named_prefixes(settings, store, spec.block_bytes, num_blocks)
    core = EngineCore(settings, scheduler, runner, store, clock, keys)
    core.figure_sources = figure_sources(settings, plugins, component, scheduler, speculators, store)
    load_lora_adapters(settings, core)
    if backend.device.type == "cpu" or store is not None:  # blocks move through host memory
        keep_large_buffers()
    log.info(
        "engine_ready",
        model=str(getattr(backend, "path", settings.model.path)),
        device=str(backend.device),
        dtype=str(backend.dtype),
        kv_blocks=num_blocks,
        block_size=kv.block_size,
        prefix_cache=store is not None,
        tiers=store.tier_names if store is not None else [],
        attention=backend.attention_kernel,
        quantization=backend.quantization,
        linear_kernel=backend.linear_kernel,
        kv_dtype=str(backend.kv_dtype or backend.dtype).removeprefix("torch."),
        profiling=clock is not None,
    )
    return core


def figure_sources(
    settings: Settings,
    plugins: PluginManager,
    scheduler_component: Component,
    scheduler: object,
    speculators: dict[str, Speculator],
    store: TieredStore | None,
) -> list[FigureSource]:
    """The components that declared figures of their own (``cache.figures``): the scheduler, the speculators
    and each tier, with the plugin that registered each."""
    found = [("scheduler", scheduler_component.plugin, scheduler_component.name, scheduler_component.name, scheduler)]
    for name, speculator in speculators.items():
        found.append(("speculator", plugins.registry("speculators").get(name).plugin, name, name, speculator))
    tier_plugins = {tier.name: tier.plugin for tier in settings.kv_cache.tiers}
    for store_tier in store.tiers if store is not None else ():
        component = plugins.registry("cache_tiers").get(tier_plugins[store_tier.name])
        found.append(("cache_tier", component.plugin, component.name, store_tier.name, store_tier.tier))
    return [
        FigureSource(plugin, kind, component, instance, figures)
        for kind, plugin, component, instance, owner in found
        if isinstance(figures := getattr(owner, "figures", None), Figures) and len(figures)
    ]


def load_lora_adapters(settings: Settings, core: EngineCore) -> None:
    """Load ``model.lora_adapters`` into the core; a bad one is a ``ConfigError`` naming it."""
    model = settings.model
    if model.max_loras and not core.backend.supports_lora:
        core.close()
        raise ConfigError(
            f"model.max_loras = {model.max_loras}: the {core.backend.backend_name} backend runs no LoRA adapters; "
            "serve the model with model.backend = \"native\" (Llama, Mistral, Qwen2, Qwen3) or set max_loras = 0"
        )
    for name, path in model.lora_adapters.items():
        try:
            core.load_lora(name, path)
        except RequestError as exc:
            core.close()
            raise ConfigError(f"model.lora_adapters.{name} = {path!r}: {exc.message.removeprefix('lora_path: ')}") from None


def load_backend(settings: Settings, plugins: PluginManager) -> ModelBackend:
    """The backend ``model.backend`` names, or with ``auto`` the first candidate that loads the checkpoint.

    The chosen name is set on the backend (``backend_name``) for ``ModelInfo`` and ``/health``.
    """
    backends = plugins.registry("backends")
    candidates = backend_candidates(settings, backends)
    for index, name in enumerate(candidates):
        try:
            backend: ModelBackend = backends.get(name).factory(settings)
        except UnsupportedModel as exc:
            if index == len(candidates) - 1:
                raise
            log.warning("backend_unsupported", backend=name, reason=str(exc), trying=candidates[index + 1])
            continue
        backend.backend_name = backends.get(name).name
        if settings.model.backend.lower() == AUTO:
            log.info("backend_chosen", backend=backend.backend_name, setting="auto")
        return backend
    raise AssertionError("no backend candidates")  # backend_candidates never returns an empty list


def fit_memory_tiers(tiers: list[TierSettings], host_left: int | None) -> list[TierSettings]:
    """The tiers as configured, but for memory tiers whose ``max_bytes`` together cannot fit the host memory
    left: those get less, with a logged reason."""
    memory = [index for index, tier in enumerate(tiers) if tier.plugin == "memory"]
    wanted = [getattr(tiers[index].options, "max_bytes", 0) or 0 for index in memory]
    fitted = list(tiers)
    for index, requested, got in zip(memory, wanted, memory_budget.fit_memory_tiers(wanted, host_left)):
        if got.reason is None:
            continue
        tier = tiers[index]
        log.warning("kv_memory_tier_sized_down", tier=tier.name, configured_bytes=requested, max_bytes=got.value,
                    reason=got.reason)  # fmt: skip
        fitted[index] = tier.model_copy(update={"options": tier.options.model_copy(update={"max_bytes": got.value})})
    return fitted


def build_store(
    settings: Settings, plugins: PluginManager, backend: ModelBackend, pool: BlockPool, host_left: int | None = None
) -> TieredStore | None:
    """The tiered prefix store over ``[[kv_cache.tiers]]``, or None when prefix caching is off or the backend is not
    paged. ``host_left``: host memory available besides the L1 pool (None: unknown), which the memory tiers' byte
    bounds are fitted to (``engine.memory_budget``)."""
    kv = settings.kv_cache
    if not kv.enable_prefix_caching or not backend.paged:
        return None
    tiers = []
    try:
        for tier in fit_memory_tiers(kv.tiers, host_left):
            built = build_tier(tier, plugins, backend.fingerprint)
            # a shared tier is written through unless its entry says otherwise: another process finds only what
            # reaches it, and L1 evictions alone would leave it nearly empty
            write_through = built.shared if tier.write_through is None else tier.write_through
            tiers.append(StoreTier(tier.name, built, write_through))
        # a partial block is copied through read_blocks / write_blocks, which a paged plugin may lack; off a
        # CPU a few tokens more in a prefill chunk cost less than a block's trip through the host
        copies = type(backend).read_blocks is not ModelBackend.read_blocks
        return TieredStore(
            pool, backend, backend.fingerprint, tiers, backend.kv_spec(kv.block_size).block_bytes,
            reuse_partial_blocks=kv.reuse_partial_blocks and copies,
            partial_min_tokens=1 if backend.device.type == "cpu" else kv.block_size // 2,
            l1_ttl_seconds=kv.ttl_seconds,
        )  # fmt: skip
    except BaseException:
        for made in tiers:  # a later tier failed: release the ones already open (threads, files)
            made.tier.close()
        raise


def build_named_prefixes(
    settings: Settings, store: TieredStore | None, block_bytes: int, num_blocks: int
) -> NamedPrefixes | None:
    """The registry of ``cache_key`` prefixes, bounded by ``[kv_cache] cache_keys_*``; None without a store."""
    if store is None or block_bytes <= 0:
        return None
    kv = settings.kv_cache
    cap = kv.cache_keys_max_pinned_bytes or max(block_bytes, num_blocks * block_bytes // 4)
    ttl = kv.cache_key_ttl_seconds or None
    return NamedPrefixes(store, max_keys=kv.cache_keys_max, max_pinned_bytes=cap, ttl_seconds=ttl, block_bytes=block_bytes)


FALLBACK_SPECULATOR = "ngram"  # prompt lookup: needs no extra model, so any request may ask for it


def build_speculators(settings: Settings, plugins: PluginManager, backend: ModelBackend) -> dict[str, Speculator]:
    """The configured speculator (``[speculative] method``) and the fallback a request may ask for, by name."""
    method = settings.speculative.method
    if method and not backend.paged:
        raise ConfigError(
            f"speculative.method = {method!r} needs a paged backend (drafts are rolled "
            f"back in the block arena); model.backend {settings.model.backend!r} keeps its own cache"
        )
    if not backend.paged:
        return {}
    registry = plugins.registry("speculators")
    names = [name for name in (method, FALLBACK_SPECULATOR) if name and name in registry]
    speculators = {name: registry.get(name).factory(settings, backend) for name in dict.fromkeys(names)}
    for name, speculator in speculators.items():
        if speculator.proposes_trees and not backend.supports_token_trees:
            raise ConfigError(
                f"speculative.method = {name!r} proposes token trees, which the {settings.model.backend!r} "
                "backend cannot verify; use model.backend = \"native\" or \"transformers\""
            )
        if speculator.needs_hidden_states:
            if not backend.supports_hidden_states:
                raise ConfigError(
                    f"speculative.method = {name!r} reads the model's hidden states, which only the native "
                    f"backend hands out, not {settings.model.backend!r}"
                )
            backend.keep_hidden_states = True
    return speculators


def build_tier(tier: TierSettings, plugins: PluginManager, fingerprint: str) -> CacheTier:
    """One ``[[kv_cache.tiers]]`` entry built by its plugin, with its eviction policy, its faults contained
    (``cache.guarded_tier``)."""
    policy = plugins.registry("eviction_policies").get(tier.eviction_policy)
    component = plugins.registry("cache_tiers").get(tier.plugin)
    return GuardedTier(component.factory(tier, policy.factory, fingerprint), tier.name, component.plugin)


def model_info(core: EngineCore) -> ModelInfo:
    """The static facts a client needs about the model ``core`` serves."""
    backend = core.backend
    settings = core.settings
    store = core.store
    return ModelInfo(
        path=str(getattr(backend, "path", settings.model.path)),
        backend=backend.backend_name,
        device=str(backend.device),
        dtype=str(backend.dtype).removeprefix("torch."),
        fingerprint=backend.fingerprint,
        max_model_len=backend.max_model_len,
        vocab_size=backend.vocab_size,
        eos_token_ids=frozenset(backend.eos_token_ids),
        paged=backend.paged,
        block_size=core.kv.block_size,
        kv_blocks=core.kv.num_blocks,
        kv_block_bytes=core.kv.spec.block_bytes,
        tier_names=tuple(store.tier_names) if store is not None else (),
        speculator=settings.speculative.method,
        fallback_speculator=FALLBACK_SPECULATOR if FALLBACK_SPECULATOR in core.runner.speculators else None,
        supports_streaming_window=backend.paged and backend.supports_released_kv,
        attention_kernel=backend.attention_kernel,
        quantization=backend.quantization,
        linear_kernel=backend.linear_kernel,
        kv_dtype=str(backend.kv_dtype or backend.dtype).removeprefix("torch."),
        key_max_pinned_bytes=core.keys.max_pinned_bytes if core.keys is not None else 0,
        lora_slots=settings.model.max_loras if backend.supports_lora else 0,
        loras=dict(core.loras),
    )
