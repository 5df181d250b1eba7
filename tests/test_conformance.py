"""``tierserve.testing``'s conformance suites: every built-in component passes the suite of its kind, the
example plugin's components too, and each suite fails a component that breaks one of its rules, naming the rule.
Also the registration checks, the eviction policy's public hooks (and their old names) and what ``capacity``
means to a policy."""

from __future__ import annotations

import importlib

import pytest

from tests.conftest import REPO_ROOT
from tierserve.cache.eviction import EvictionPolicy
from tierserve.core.plugins import import_plugin_module, load_plugins
from tierserve.core.speculation import Proposal
from tierserve.core.tier_settings import TierSettings
from tierserve.plugins.eviction.lru import LRUPolicy
from tierserve.plugins.schedulers.fcfs import FCFSScheduler
from tierserve.plugins.schedulers.priority import PriorityScheduler
from tierserve.plugins.speculation.ngram import NgramSpeculator
from tierserve.plugins.speculation.ngram_tree import NgramTreeSpeculator
from tierserve.plugins.tiers.disk import DiskTier
from tierserve.plugins.tiers.memory import MemoryTier
from tierserve.testing import (
    PluginLoadError,
    RuleBroken,
    check_cache_tier,
    check_eviction_policy,
    check_scheduler,
    check_speculator,
    component_plugin,
    plugin_manager,
)
from tierserve.testing.tier_rules import make_entry

pytestmark = pytest.mark.unit

EXAMPLE_PACKAGE = REPO_ROOT / "examples" / "tierserve-example-plugin" / "tierserve_example_plugin"
BUILTIN_POLICIES = load_plugins(allowlist=[]).registry("eviction_policies")


def example_module(name: str = ""):
    """The example plugin's package (or a module of it), imported from its folder as ``--plugin`` would."""
    package = import_plugin_module(str(EXAMPLE_PACKAGE))
    return importlib.import_module(f"{package.__name__}.{name}") if name else package


# ---- the built-ins and the example pass ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["lru", "lfu", "clock", "adaptive"])
def test_every_builtin_policy_keeps_the_eviction_rules(name):
    checked = check_eviction_policy(BUILTIN_POLICIES.get(name).factory)
    assert "random_operations_keep_the_books" in checked and "pinned_keys_are_never_evicted" in checked


def test_the_example_fifo_policy_keeps_the_eviction_rules():
    assert len(check_eviction_policy(example_module().FifoPolicy)) == 10


@pytest.mark.parametrize(
    "factory, options",
    [
        (MemoryTier, {"capacity": 16}),
        (MemoryTier, {"capacity": 1000, "max_bytes": 8192}),
        (DiskTier, "disk"),
    ],
    ids=["memory-by-entries", "memory-by-bytes", "disk"],
)
def test_every_builtin_tier_keeps_the_tier_rules(factory, options, tmp_path):
    if options == "disk":
        options = {"path": str(tmp_path / "kv"), "max_bytes": 8192, "persistent": True}
    checked = check_cache_tier(factory, options)
    assert not [name for name in checked if "skipped" in name], checked  # the bound and pin rules ran
    assert len(checked) == 13


@pytest.mark.parametrize("scheduler", [FCFSScheduler, PriorityScheduler], ids=["fcfs", "priority"])
def test_every_builtin_scheduler_keeps_the_scheduler_rules(scheduler):
    assert "preempts_when_blocks_run_out" in check_scheduler(scheduler)


def test_the_example_sjf_scheduler_keeps_the_scheduler_rules():
    assert len(check_scheduler(example_module("scheduler").ShortestPromptFirst)) == 5


@pytest.mark.parametrize("speculator", [NgramSpeculator, NgramTreeSpeculator], ids=["ngram", "ngram_tree"])
def test_the_builtin_draft_free_speculators_keep_the_speculator_rules(speculator):
    assert check_speculator(speculator) == ["proposals_are_well_formed", "outputs_equal_decoding_without_drafts"]


# ---- the suites fail what breaks a rule ----------------------------------------------------------------


class PinIgnoringPolicy(LRUPolicy):
    """Leaves pinned keys in its order: it will hand one out."""

    def on_pin(self, key):
        pass

    def on_unpin(self, key):
        self._order[key] = None
        self._order.move_to_end(key)


def test_a_policy_that_evicts_pinned_keys_fails_naming_the_rule():
    with pytest.raises(RuleBroken, match="breaks the rule 'pinned keys are never evicted'") as failure:
        check_eviction_policy(PinIgnoringPolicy)
    assert "PinIgnoringPolicy" in str(failure.value)


class ForgetfulTier(MemoryTier):
    """Drops what it evicts without handing it back or noting it: the store's index would keep believing in it."""

    def put(self, entry):
        super().put(entry)
        return []


def test_a_tier_that_loses_entries_silently_fails_naming_the_rule():
    with pytest.raises(RuleBroken, match="keeps its bound and accounts for every entry.*note_removed"):
        check_cache_tier(ForgetfulTier, {"capacity": 8})


class AgelessTier(MemoryTier):
    """Never expires anything."""

    def _expire_if_old(self, entry):
        return False


def test_a_tier_that_ignores_ttl_fails_naming_the_rule():
    with pytest.raises(RuleBroken, match="'(pinned entries outlive the bound|expired entries are misses)'"):
        check_cache_tier(AgelessTier, {"capacity": 8})


def test_a_scheduler_without_a_queue_bound_fails_naming_the_rule():
    class Unbounded(example_module("scheduler").ShortestPromptFirst):
        def add(self, seq):
            self._waiting.append(seq)

    with pytest.raises(RuleBroken, match="'bounds its queue'.*did not raise QueueFullError"):
        check_scheduler(Unbounded)


class OffVocabulary(NgramSpeculator):
    """Proposes a token the model does not have."""

    def propose(self, requests):
        return [Proposal([10**6]) for _ in requests]


def test_a_speculator_proposing_unknown_tokens_fails_naming_the_rule():
    with pytest.raises(RuleBroken, match="'proposals are well formed'.*outside the vocabulary"):
        check_speculator(OffVocabulary)


# ---- the policy's public hooks, old names, and capacity in entries -------------------------------------


class OldStyleFifo(EvictionPolicy):
    """A policy written against the hooks' names before 0.2."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.queue = {}

    def _on_insert(self, key, size):
        self.queue[key] = None

    def _on_touch(self, key, pinned):
        pass

    def _on_remove(self, key, pinned):
        self.queue.pop(key, None)

    def _choose_victim(self):
        key = next(iter(self.queue))
        del self.queue[key]
        return key

    def _on_pin(self, key):
        del self.queue[key]

    def _on_unpin(self, key):
        self.queue[key] = None


def test_a_policy_with_the_old_hook_names_still_works():
    check_eviction_policy(OldStyleFifo)
    assert OldStyleFifo.on_insert is OldStyleFifo._on_insert
    plugin_manager(component_plugin("eviction_policies", "old_fifo", OldStyleFifo))  # not abstract: it registers


def tier_settings(**options) -> TierSettings:
    return TierSettings(name="l2", plugin="memory", eviction_policy="adaptive", ttl_seconds=None, **options)


def test_capacity_is_entries_for_every_policy_and_tier(tmp_path):
    """The issue's case: a memory tier of 24 entries (and the default byte bound) gave its policy 1,000,000,000."""
    adaptive = BUILTIN_POLICIES.get("adaptive").factory
    assert MemoryTier(tier_settings(capacity=24), adaptive, "fp").policy.capacity == 24
    by_bytes = MemoryTier(tier_settings(capacity=1000, max_bytes=8192), adaptive, "fp")
    by_bytes.put(make_entry(0))  # 512 bytes: 16 fit
    assert by_bytes.policy.capacity == 16 and by_bytes.policy.total_size == 1
    disk = DiskTier(
        TierSettings(name="l3", plugin="disk", eviction_policy="adaptive", ttl_seconds=None, path=str(tmp_path),
                     max_bytes=40_000),
        adaptive, "fp",
    )  # fmt: skip
    try:
        disk.put(make_entry(0))
        disk.flush()
        assert 40 < disk.policy.capacity < 200  # 40,000 bytes over one compressed entry's size on disk
        assert disk.policy.total_size == len(disk) == 1
    finally:
        disk.close()


# ---- components are checked when they register ---------------------------------------------------------


class NotAPolicy:
    def __init__(self, capacity):
        self.capacity = capacity


class HalfAPolicy(EvictionPolicy):
    def on_insert(self, key, size):
        pass


class TierWithoutFingerprint(MemoryTier):
    def __init__(self, tier, policy_factory):
        super().__init__(tier, policy_factory, "fixed")


@pytest.mark.parametrize(
    "kind, factory, message",
    [
        ("eviction_policies", NotAPolicy,
         "eviction policy 'broken' (NotAPolicy) must subclass tierserve.cache.eviction.EvictionPolicy"),
        ("eviction_policies", HalfAPolicy,
         "eviction policy 'broken' (HalfAPolicy) does not implement choose_victim, on_pin, on_remove, on_touch, on_unpin"),
        ("cache_tiers", TierWithoutFingerprint,
         "cache tier 'broken' (TierWithoutFingerprint) cannot be called as factory(tier, policy_factory, fingerprint)"),
        ("schedulers", MemoryTier, "scheduler 'broken' (MemoryTier) must subclass tierserve.core.scheduler.Scheduler"),
        ("speculators", lambda settings: None, "speculator 'broken' (<lambda>) cannot be called as factory(settings, target)"),
        ("tool_parsers", object, "tool parser 'broken' must be an instance of tierserve.core.tool_calls.ToolParser"),
    ],
    ids=["wrong-base", "abstract", "tier-signature", "scheduler-base", "speculator-signature", "tool-parser"],
)  # fmt: skip
def test_a_component_of_the_wrong_shape_fails_its_plugin_at_load(kind, factory, message):
    with pytest.raises(PluginLoadError) as failure:
        plugin_manager(component_plugin(kind, "broken", factory))
    assert message in str(failure.value)
    assert "TypeError" in str(failure.value)


def test_the_plugins_that_load_are_unaffected_by_one_that_does_not():
    manager = load_plugins(allowlist=[])
    assert not manager.add_plugin(component_plugin("eviction_policies", "broken", NotAPolicy), "bad", "1", "test")
    assert "broken" not in manager.registry("eviction_policies") and "lru" in manager.registry("eviction_policies")
    assert [f.name for f in manager.failures] == ["bad"]
