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
"""

from __future__ import annotations

from typing import Any, Protocol

import pluggy

PROJECT_NAME = "tierserve"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class Register(Protocol):
    """The callback handed to every ``register_*`` hook."""

    def __call__(self, name: str, factory: Any, /, **metadata: Any) -> None:
        """Record ``factory`` under ``name``; ``metadata`` (e.g. ``description``)
        is shown by ``tierserve plugins``. Raises ``DuplicateComponentError``
        if another plugin already registered that name for this kind."""


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
    ``"transformers"``.
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
    is what ``[scheduler] name`` selects, e.g. ``"fcfs"``.
    """


@hookspec
def register_eviction_policies(register: Register) -> None:
    """Register cache eviction policies.

    ``factory(capacity)`` returns a subclass of
    ``tierserve.cache.eviction.EvictionPolicy``; ``capacity`` is the size the
    owning tier holds, in the same units as the sizes it will ``insert``.
    Every cache tier (L1 block pool, L2 memory, L3 disk) asks its policy
    which entry to evict. The name is what ``[kv_cache] eviction_policy``
    selects (case-insensitive), e.g. ``"lru"`` or ``"adaptive"``.
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
    """


@hookspec
def register_cache_tiers(register: Register) -> None:
    """Register KV cache tiers (storage below the live L1 block pool).

    ``factory(settings, policy_factory, fingerprint)`` returns a
    ``tierserve.cache.tier.CacheTier``: a bounded, thread-safe map from block
    hash to ``CacheEntry`` that evicts with ``policy_factory(capacity)`` (the
    policy named in ``[kv_cache]``) and never returns a corrupt or foreign
    entry. ``settings`` is the ``[kv_cache]`` section; ``fingerprint``
    identifies the model. Built-in: ``"memory"`` (L2, host RAM) and
    ``"disk"`` (L3, persistent, zstd-compressed).
    """


@hookspec
def register_routes(register: Register) -> None:
    """Register extra HTTP routes on the server.

    ``register("name", handler)`` where ``handler`` is a Litestar route
    handler, controller or router; it is mounted on the app built by
    ``create_app`` alongside the built-in routes, behind the same auth.
    """


@hookspec
def on_startup(engine: Any) -> None:
    """Called once after the engine is built and before the first request.

    ``engine`` is the ``tierserve.core.engine.EngineClient`` the server uses
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
