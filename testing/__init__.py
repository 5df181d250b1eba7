"""Testing kit for tierserve plugins, installed with tierserve (as pytest's ``pytester`` or datasette's test
client serve their plugin authors).

Conformance suites: a plugin's own tests call them with its class, and they run the rules the built-in
components are held to (tierserve's own tests run them over every built-in)::

    from tierserve.testing import check_cache_tier, check_eviction_policy

    def test_fifo_keeps_the_rules():
        check_eviction_policy(FifoPolicy)

    def test_sqlite_tier_keeps_the_rules(tmp_path):
        check_cache_tier(SqliteTier, {"path": str(tmp_path / "kv.db"), "max_entries": 16})

A broken rule raises ``RuleBroken`` (an ``AssertionError``) naming the rule, what it asks and what happened.

A real engine and server to run a plugin in: ``plugin_manager(my_module)`` loads the built-ins and the plugin
through the same hooks ``tierserve serve`` uses (``component_plugin`` makes a one-component plugin from a
class); ``tiny_engine`` is an in-process engine on ``builtin:tiny`` and ``http_client`` Litestar's test client
on the server's app. As pytest fixtures: ``pytest_plugins = ["tierserve.testing.fixtures"]`` in a conftest.py.

``tierserve.testing`` imports torch (the engine needs it); the plugin API itself (``tierserve.plugin_api``)
does not.
"""

from __future__ import annotations

from tierserve.testing.eviction_rules import check_eviction_policy
from tierserve.testing.harness import (
    PluginLoadError,
    component_plugin,
    eviction_policy,
    http_client,
    plugin_manager,
    tiny_engine,
    tiny_settings,
)
from tierserve.testing.rules import RuleBroken
from tierserve.testing.scheduler_rules import check_scheduler
from tierserve.testing.speculator_rules import check_speculator
from tierserve.testing.tier_rules import check_cache_tier

__all__ = [
    "PluginLoadError",
    "RuleBroken",
    "check_cache_tier",
    "check_eviction_policy",
    "check_scheduler",
    "check_speculator",
    "component_plugin",
    "eviction_policy",
    "http_client",
    "plugin_manager",
    "tiny_engine",
    "tiny_settings",
]
