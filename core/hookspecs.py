"""Hook specifications: the plugin author's manual.

Every hook a plugin may implement is declared here. Component hooks are
register-style: tierserve calls them once at start-up with a ``register``
callback, and the plugin calls ``register("name", factory, **metadata)`` for
each component it provides. Names are case-insensitive and must be unique
within a kind; the registry remembers which plugin registered what, so
``tierserve plugins`` and error messages can say where a component came from.

A minimal plugin module::

    from tierserve.core import hookimpl

    @hookimpl
    def register_eviction_policies(register):
        register("fifo", FifoPolicy, description="first in, first out")

and in the plugin's ``pyproject.toml``::

    [project.entry-points.tierserve]
    fifo = "my_package.plugin"

A component that has knobs declares them as a pydantic model and passes it as
``settings=``; its table ``[plugins.NAME]`` (also ``TIERSERVE_PLUGINS__NAME__KEY``
and ``--set plugins.NAME.KEY=VALUE``) is validated by that model when the
settings load, with errors naming the key, value and source, and shown by
``tierserve config show``. The component reads it with
``settings.plugin_options("NAME", Model)``::

    class EchoSettings(BaseModel):
        model_config = ConfigDict(extra="forbid")
        depth: int = Field(2, ge=1)

    @hookimpl
    def register_speculators(register):
        register("echo", EchoSpeculator, settings=EchoSettings)

    # in EchoSpeculator.__init__(self, settings, target):
    #     self.depth = settings.plugin_options("echo", EchoSettings).depth

Only one component may own a table: two components of different kinds with
the same name both declaring settings fail the second plugin. A cache tier's
model is different: its keys go in each ``[[kv_cache.tiers]]`` entry that
uses it (see ``register_cache_tiers``).
"""

from __future__ import annotations

from typing import Any, Protocol

import pluggy
from pydantic import BaseModel

PROJECT_NAME = "tierserve"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class Register(Protocol):
    """The callback handed to every ``register_*`` hook."""

    def __call__(
        self,
        name: str,
        factory: Any,
        /,
        *,
        settings: type[BaseModel] | None = None,
        aliases: dict[str, str] | None = None,
        **metadata: Any,
    ) -> None:
        """Record ``factory`` under ``name``.

        Args:
            name: unique within the kind, case-insensitive.
            factory: what tierserve calls to build the component (its
                signature is in the hook's docstring).
            settings: a pydantic ``BaseModel`` subclass (``extra="forbid"``)
                of the component's own settings. For every kind but cache
                tiers it validates the ``[plugins.NAME]`` table, read with
                ``settings.plugin_options(NAME, Model)``; for a cache tier it
                validates the tier's own keys in each ``[[kv_cache.tiers]]``
                entry (``tier.options``).
            aliases: old names of those keys, ``{"section.key": "model_key"}``
                (e.g. ``{"speculative.ngram_min": "min_n"}``): they keep
                working in presets, environment and ``--set``, and sources say
                which name a value came through. An alias may not be a key
                core has, nor one another component took; cache tiers take none.
            metadata: e.g. ``description``, shown by ``tierserve plugins``.

        Raises:
            DuplicateComponentError: another plugin registered that name for
                this kind, or the same ``[plugins.NAME]`` table or alias.
        """


@hookspec
def register_backends(register: Register) -> None:
    """Register model backends.

    A backend loads a checkpoint and runs forward passes for the engine.
    ``factory(settings)`` is called once when the engine core starts, with
    the resolved ``Settings``; it returns a
    ``tierserve.core.backend.ModelBackend``: tokenizer, eos ids, context
    length, ``forward`` over ``tierserve.core.batch.ScheduledChunk`` records
    (each names its input tokens, positions, block table and released
    positions; see ``ModelBackend.forward``), and for paged backends
    ``kv_spec``, the KV arena and whole-block copies for the cache tiers. The
    name is what ``[model] backend`` selects, e.g. ``"native"`` or
    ``"transformers"``. A backend registered with ``settings=Model`` reads its
    ``[plugins.NAME]`` table as ``settings.plugin_options("NAME", Model)``
    (``native`` and ``transformers`` have ``linear_kernel``).

    ``model.backend = "auto"`` tries ``native``, ``transformers``,
    ``transformers-unpaged`` in that order (``models/backend_choice.py``): a
    factory with a static ``supports_model_type(model_type) -> bool`` is
    skipped for checkpoints it does not run, and one that raises
    ``tierserve.models.backend_choice.UnsupportedModel`` while loading hands
    over to the next.
    """


@hookspec
def register_schedulers(register: Register) -> None:
    """Register schedulers.

    A scheduler decides, at every engine step, which sequences run and how
    many of their tokens, under the token and sequence budgets of the
    ``[scheduler]`` settings. ``factory(scheduler_settings, kv, model=limits)``
    returns a subclass of ``tierserve.core.scheduler.Scheduler``; ``kv`` is
    the ``tierserve.cache.kv_manager.KVCacheManager`` the scheduler owns
    (slots, prefix reuse, rollback, window release) and ``limits`` the
    model's context length and eos ids (pass both on to ``Scheduler.__init__``).
    A subclass implements ``add``, ``schedule``, ``finish``, ``num_waiting``
    and ``num_running``; the module docstring of ``tierserve.core.scheduler``
    states what ``schedule`` must guarantee (budgets, slots allocated before a
    chunk is returned, preemption through ``self.preempt``, prefix matching on
    admission, speculative drafts as lookahead slots). Applying a step's
    results (``update_from_output``) is shared by every scheduler. The name
    is what ``[scheduler] name`` selects, e.g. ``"fcfs"``. A scheduler
    registered with ``settings=Model`` also gets its validated
    ``[plugins.NAME]`` table: ``factory(..., options=model_instance)``.
    """


@hookspec
def register_eviction_policies(register: Register) -> None:
    """Register cache eviction policies.

    ``factory(capacity)`` returns a subclass of
    ``tierserve.cache.eviction.EvictionPolicy``; ``capacity`` is how many
    entries the owning tier holds at most (every built-in tier inserts each
    entry with size 1). The subclass implements the public hooks ``on_insert``,
    ``on_touch``, ``on_remove``, ``choose_victim``, ``on_pin`` and ``on_unpin``;
    ``tierserve.testing.check_eviction_policy(cls)`` runs the rules every
    policy keeps.
    Every cache tier (the L1 block pool and each ``[[kv_cache.tiers]]``
    entry) asks its policy which entry to evict. The name is what
    ``[kv_cache] eviction_policy`` or a tier's ``eviction_policy`` selects
    (case-insensitive), e.g. ``"lru"`` or ``"adaptive"``.
    """


@hookspec
def register_speculators(register: Register) -> None:
    """Register speculative-decoding strategies.

    A speculator proposes up to ``k`` draft tokens per sequence (the model
    runner asks after each step that sampled, with the sequence's history);
    the drafts run as lookahead slots in the next step's forward and the
    runner keeps the longest verified run, so output is unchanged.
    ``factory(settings, target_backend)`` returns a
    ``tierserve.core.speculation.Speculator``. The name is what
    ``[speculative] method`` selects, e.g. ``"ngram"`` or ``"draft_model"``.
    Its own knobs go in ``[plugins.NAME]`` (``settings=Model``), read with
    ``settings.plugin_options("NAME", Model)``; ``ngram`` has ``min_n`` and
    ``max_n``, ``draft_model`` has ``path``.

    A speculator that sets ``proposes_trees = True`` may return token trees
    (``Proposal(tokens, parents=...)``: each node's parent, ``-1`` for the
    last real token); it is then asked for up to ``request.num_tokens`` nodes
    (the step's node budget) and paths of at most ``request.max_depth``. One
    with ``needs_hidden_states = True`` gets the target's final hidden state
    in ``request.hidden`` (backends with ``supports_hidden_states``). Built-in
    tree speculators: ``ngram_tree`` and ``medusa``.
    """


@hookspec
def register_cache_tiers(register: Register) -> None:
    """Register KV cache tiers (storage below the live L1 block pool).

    Tiers are an ordered list in the settings, one ``[[kv_cache.tiers]]``
    entry each; ``plugin`` names the tier plugin, and one plugin may serve
    several entries::

        [[kv_cache.tiers]]
        name = "redis"            # unique; "l1" and "all" are reserved
        plugin = "redis"          # the name registered here
        eviction_policy = "lru"   # optional, default [kv_cache] eviction_policy
        ttl_seconds = 600         # optional, default [kv_cache] ttl_seconds
        write_through = false     # every newly computed block is also written here
        url = "redis://cache:6379"   # the plugin's own keys

    Register the plugin's own keys as a pydantic model (``extra="forbid"``):
    ``register("redis", RedisTier, settings=RedisTierSettings)``; each entry's
    own keys are validated by it when the settings load (unknown keys and bad
    values name ``kv_cache.tiers[i].KEY``, the value and the source).

    ``factory(tier, policy_factory, fingerprint)`` returns a
    ``tierserve.cache.tier.CacheTier``: a bounded, thread-safe map from block
    hash to ``CacheEntry`` that evicts with ``policy_factory(capacity)``,
    never returns a corrupt or foreign entry, honours pins (a ``hold``, by
    default a pin, may give way to the tier's bound), and counts the uses of
    each entry (``access_count``, ``add_accesses``). A tier that queues writes
    overrides ``put_waiting`` so a warm's writes wait for room.

    The factory's arguments:
        tier: the entry, a ``tierserve.core.tier_settings.TierSettings``:
            ``name``, ``plugin``, ``eviction_policy`` and ``ttl_seconds``
            (resolved), ``write_through``, and ``options``, the plugin's own
            settings; read them as ``tier.options_as(RedisTierSettings)``
            (the validated instance, or validated then when the Settings
            were built directly).
        policy_factory: the factory of ``tier.eviction_policy``; call it with
            the capacity in entries (a tier bound by bytes may start high and
            lower ``policy.capacity`` once it knows an entry's size), and
            ``insert`` each entry with size 1.
        fingerprint: identifies the model; never serve another's entries.

    Built-in: ``"memory"`` (host RAM: ``capacity``, ``max_bytes``) and
    ``"disk"`` (``path``, ``max_bytes``, ``persistent``, ``compression_level``,
    ``write_queue``, ``writer_nice``).
    """


@hookspec
def register_routes(register: Register) -> None:
    """Register extra HTTP routes on the server.

    ``register("name", handler)`` where ``handler`` is a Litestar route
    handler, controller or router; it is mounted on the app built by
    ``create_app`` alongside the built-in routes, behind the same auth.
    """


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call formats (``tools`` on chat completions).

    ``register("name", parser)`` where ``parser`` is a
    ``tierserve.core.tool_calls.ToolParser`` instance: ``matches(chat_template)``
    says whether a model writes its format, ``parse(text)`` turns output into
    OpenAI tool calls, ``grammar(tools, parallel)`` forces a valid call
    (``tool_choice`` ``required`` or a named function), ``render_call`` writes
    an earlier call back for templates that do not render ``tool_calls``.
    A model uses the first registered parser that matches its template.

    Built-in: ``"hermes"`` (``<tool_call>{...}</tool_call>``: Hermes, Qwen2.5,
    Qwen3; also the default for templates without tool support) and
    ``"llama3_json"`` (Llama 3.1+).
    """


@hookspec
def on_startup(engine: Any) -> None:
    """Called once after the engine is built and before the first request.

    ``engine`` is the ``tierserve.engine.EngineClient`` the server uses
    (submit, generate, warm, cache management, statistics).

    Use it to start background work or warm caches. An exception here is
    logged with the plugin's name and does not stop the server.
    """


@hookspec
def on_shutdown(engine: Any) -> None:
    """Called once while the server shuts down, after in-flight requests end.

    Use it to flush or release what ``on_startup`` acquired. An exception
    here is logged with the plugin's name and does not block shutdown.
    """
