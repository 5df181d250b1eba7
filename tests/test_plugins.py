"""The plugin manager: built-ins, entry points, allowlist, failures, registries."""

from __future__ import annotations

import json

import pytest

from tierserve.core.errors import DuplicateComponentError, UnknownComponentError
from tierserve.core.plugins import BUILTIN_PLUGINS, load_plugins
from tierserve.core.registry import Registry

pytestmark = pytest.mark.unit

GOOD_PLUGIN = """
from tierserve.plugin_api import EvictionPolicy, hookimpl

class MruPolicy(EvictionPolicy):
    # evicts the most recently used key

    def __init__(self, capacity):
        super().__init__(capacity)
        self.order = {}

    def on_insert(self, key, size):
        self.order[key] = None

    def on_touch(self, key, pinned):
        if not pinned:
            self.order[key] = self.order.pop(key)

    def on_remove(self, key, pinned):
        self.order.pop(key, None)

    def choose_victim(self):
        key = next(reversed(self.order))
        del self.order[key]
        return key

    def on_pin(self, key):
        del self.order[key]

    def on_unpin(self, key):
        self.order[key] = None

@hookimpl
def register_eviction_policies(register):
    register("mru", MruPolicy, description="most recently used")
"""


def test_builtin_policies_are_registered_by_their_plugins():
    manager = load_plugins(allowlist=[])
    registry = manager.registry("eviction_policies")
    assert registry.names() == ["adaptive", "clock", "lfu", "lru"]
    assert registry.get("LRU").plugin == "tierserve.plugins.eviction.lru"
    assert registry.get("Adaptive").plugin == "tierserve.plugins.eviction.adaptive"
    assert [p.name for p in manager.plugins()] == list(BUILTIN_PLUGINS)
    assert all(p.source == "builtin" for p in manager.plugins())
    assert manager.failures == []


def test_entry_point_plugin_is_loaded_and_introspectable(install_fake_plugin):
    install_fake_plugin("tierserve-mru", "tierserve_mru_ok", GOOD_PLUGIN)
    manager = load_plugins(allowlist=None)
    component = manager.registry("eviction_policies").get("mru")
    assert component.plugin == "tierserve-mru"
    assert component.metadata == {"description": "most recently used"}
    info = {p.name: p for p in manager.plugins()}["tierserve-mru"]
    assert info.version == "1.2.3"
    assert info.hooks == ["register_eviction_policies"]
    assert info.components == {"eviction_policies": ["mru"]}


def test_allowlist_filters_outside_plugins(install_fake_plugin):
    install_fake_plugin("tierserve-mru", "tierserve_mru_allow", GOOD_PLUGIN)
    assert "mru" not in load_plugins(allowlist=[]).registry("eviction_policies")
    assert "mru" not in load_plugins(allowlist=["something-else"]).registry("eviction_policies")
    assert "mru" in load_plugins(allowlist=["tierserve-mru"]).registry("eviction_policies")


def test_allowlist_comes_from_environment(install_fake_plugin, monkeypatch):
    install_fake_plugin("tierserve-mru", "tierserve_mru_env", GOOD_PLUGIN)
    monkeypatch.setenv("TIERSERVE_PLUGINS", "")
    assert "mru" not in load_plugins().registry("eviction_policies")
    monkeypatch.setenv("TIERSERVE_PLUGINS", "other, tierserve-mru")
    assert "mru" in load_plugins().registry("eviction_policies")
    monkeypatch.delenv("TIERSERVE_PLUGINS")
    assert "mru" in load_plugins().registry("eviction_policies")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("raise ImportError('no module named torch_xla')", "torch_xla"),
        (
            "from tierserve.core import hookimpl\n"
            "@hookimpl\n"
            "def register_eviction_polices(register):\n"
            "    pass\n",
            "register_eviction_polices",
        ),
        (
            "from tierserve.core import hookimpl\n"
            "@hookimpl\n"
            "def register_eviction_policies(register):\n"
            "    raise RuntimeError('boom in registration')\n",
            "boom in registration",
        ),
    ],
    ids=["import-error", "misspelled-hook", "raises-in-hook"],
)
def test_broken_plugin_is_reported_not_fatal(install_fake_plugin, source, expected):
    install_fake_plugin("tierserve-broken", f"tierserve_broken_{abs(hash(source))}", source)
    install_fake_plugin("tierserve-mru", "tierserve_mru_beside_broken", GOOD_PLUGIN)
    manager = load_plugins(allowlist=None)
    assert [f.name for f in manager.failures] == ["tierserve-broken"]
    assert expected in manager.failures[0].error
    assert "tierserve-broken" not in {p.name for p in manager.plugins()}
    assert manager.registry("eviction_policies").names() == ["adaptive", "clock", "lfu", "lru", "mru"]


def test_a_misspelled_hook_names_the_one_meant(install_fake_plugin):
    install_fake_plugin("tierserve-typo", "tierserve_typo", "from tierserve.core import hookimpl\n@hookimpl\n"
                        "def register_eviction_polices(register):\n    pass\n")  # fmt: skip
    [failure] = load_plugins(allowlist=None).failures
    assert "unknown hook 'register_eviction_polices' (did you mean 'register_eviction_policies'?)" in failure.error


def test_the_allowlist_takes_the_printed_names_and_warns_on_the_rest(install_fake_plugin):
    """``TIERSERVE_PLUGINS`` takes a distribution's name, its entry point's, and ``dist:entry`` as ``tierserve
    plugins`` prints a second entry point; an entry that matches nothing installed is logged, with what is; a
    module that registers nothing is logged too."""
    from structlog.testing import capture_logs

    install_fake_plugin("tierserve-mru", "tierserve_mru_allow", GOOD_PLUGIN)
    install_fake_plugin("tierserve-empty", "tierserve_empty", "VALUE = 1\n")
    with capture_logs() as logs:
        manager = load_plugins(allowlist=["tierserve-mru:tierserve_mru_allow", "tierserve-nope", "tierserve-empty"])
    assert {p.name for p in manager.plugins()} >= {"tierserve-mru", "tierserve-empty"}
    [unmatched] = [e for e in logs if e["event"] == "plugin_allowlist_unmatched"]
    assert unmatched["entries"] == ["tierserve-nope"] and "tierserve-mru" in unmatched["installed"]
    assert [e["plugin"] for e in logs if e["event"] == "plugin_without_hooks"] == ["tierserve-empty"]


def test_plugins_json_stays_json_and_the_exit_says_a_plugin_failed(install_fake_plugin, capsys):
    """``tierserve plugins --json`` with a failing plugin: stdout is the JSON alone (the failure's log line goes
    to stderr), the failure is in it, and the exit status is 1."""
    from tierserve.cli.main import main

    install_fake_plugin("tierserve-broken", "tierserve_broken_json", "raise ImportError('no such dependency')\n")
    assert main(["plugins", "--json"]) == 1
    out = capsys.readouterr().out
    [failure] = json.loads(out)["failures"]
    assert failure["name"] == "tierserve-broken" and "no such dependency" in failure["error"]
    assert main(["plugins"]) == 1
    listed = capsys.readouterr().out
    assert "FAILED tierserve-broken" in listed
    assert "eviction_policies: adaptive (" in listed  # each component with its description


def test_duplicate_name_fails_the_second_plugin_naming_both(install_fake_plugin):
    install_fake_plugin(
        "tierserve-fake-lru",
        "tierserve_fake_lru",
        """
        from tierserve.core import hookimpl
        from tierserve.plugins.eviction.lfu import LFUPolicy
        @hookimpl
        def register_eviction_policies(register):
            register("mine", LFUPolicy)
            register("LRU", LFUPolicy)
        """,
    )
    manager = load_plugins(allowlist=None)
    [failure] = manager.failures
    assert "tierserve.plugins.eviction.lru" in failure.error
    assert "tierserve-fake-lru" in failure.error
    registry = manager.registry("eviction_policies")
    assert registry.get("lru").plugin == "tierserve.plugins.eviction.lru"
    # the failed plugin's other components are withdrawn too
    assert "mine" not in registry


def test_registry_rejects_duplicates_and_suggests_names():
    registry = Registry("eviction policy")
    registry.add("lru", object, "plugin-a")
    with pytest.raises(DuplicateComponentError, match="plugin-a.*plugin-b"):
        registry.add("Lru", object, "plugin-b")
    registry.add("lfu", object, "plugin-a")
    with pytest.raises(UnknownComponentError) as info:
        registry.get("lru2")
    assert info.value.available == ["lfu", "lru"]
    assert info.value.suggestion == "lru"
    assert "available: lfu, lru" in str(info.value)
    with pytest.raises(UnknownComponentError, match=r"\(none registered\)"):
        Registry("backend").get("native")


def test_lifecycle_hooks_run_and_a_failing_one_does_not_stop_others(install_fake_plugin):
    install_fake_plugin(
        "tierserve-life-a",
        "tierserve_life_a",
        """
        from tierserve.core import hookimpl
        @hookimpl
        def on_startup(engine):
            raise RuntimeError("startup failed")
        """,
    )
    install_fake_plugin(
        "tierserve-life-b",
        "tierserve_life_b",
        """
        from tierserve.core import hookimpl
        @hookimpl
        def on_startup(engine):
            engine.append("b started")
        """,
    )
    manager = load_plugins(allowlist=None)
    events: list[str] = []
    manager.call_lifecycle("on_startup", events)
    assert events == ["b started"]
