"""Model-based tests of the built-in eviction policies.

Each policy is obtained by name through the plugin registry, exactly as a
cache tier gets it, and driven by a hypothesis state machine side by side
with a deliberately naive reference model written here from the documented
semantics (``cache/eviction.py`` and each policy's docstring): plain lists
and dicts, linear scans everywhere. After every step the two must agree on
membership, length, total size, pin state, and on the key the next
``evict()`` would return (checked on deep copies, so checking does not
change the state); the ``evict`` rule then evicts for real.

Semantics the references encode (shared by all policies):

* ``insert`` of a tracked key updates its size and counts as a use (a touch).
* ``touch`` of a pinned key is a use too (it changes LFU counts, CLOCK bits,
  ARC's T1 -> T2 promotion), but does not make the key evictable.
* ``unpin`` puts the key back as the most recently used; it is not an extra
  use for frequency purposes (no LFU count, no CLOCK bit, no ARC promotion).
* ``evict`` returns ``None`` exactly when nothing or only pinned keys are
  tracked; it never returns a pinned key.
* ``touch``/``remove``/``pin``/``unpin``/``size_of`` of an untracked key
  (including an ARC ghost) raise ``KeyError`` and change nothing.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from bench.eviction_traces import frequency_trace, mixed_trace, recency_trace, replay
from tierserve.cache.eviction import EvictionPolicy
from tierserve.core.plugins import load_plugins

pytestmark = pytest.mark.unit

POLICY_NAMES = ("lru", "lfu", "clock", "adaptive")
KEY_SPACE = list(range(10))  # small, so keys come back (ARC ghost hits, re-inserts)
SIZES = st.integers(min_value=0, max_value=5)
MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)

_REGISTRY = load_plugins(allowlist=[]).registry("eviction_policies")


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    return _REGISTRY.get(name).factory(capacity)


# ---------------------------------------------------------------------------
# Naive reference models
# ---------------------------------------------------------------------------


class RefBase:
    """Bookkeeping every reference shares; subclasses say how keys are ordered."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sizes: dict[int, int] = {}
        self.pinned: set[int] = set()

    # public operations, mirroring EvictionPolicy
    def insert(self, key: int, size: int) -> None:
        if key in self.sizes:
            self.sizes[key] = size
            self.use(key)
        else:
            self.sizes[key] = size
            self.add(key, size)

    def touch(self, key: int) -> None:
        self.use(key)

    def remove(self, key: int) -> None:
        self.forget(key)
        self.pinned.discard(key)
        del self.sizes[key]

    def pin(self, key: int) -> None:
        self.pinned.add(key)

    def unpin(self, key: int) -> None:
        if key in self.pinned:
            self.pinned.discard(key)
            self.unpinned(key)

    def evict(self) -> int | None:
        if all(key in self.pinned for key in self.sizes):
            return None
        victim = self.victim()
        assert victim not in self.pinned
        del self.sizes[victim]
        return victim

    @property
    def total_size(self) -> int:
        return sum(self.sizes.values())

    # what a reference implements
    def add(self, key: int, size: int) -> None:
        raise NotImplementedError

    def use(self, key: int) -> None:
        raise NotImplementedError

    def forget(self, key: int) -> None:
        raise NotImplementedError

    def unpinned(self, key: int) -> None:
        raise NotImplementedError

    def victim(self) -> int:
        """Choose an unpinned key, drop it from the ordering, return it."""
        raise NotImplementedError


class RefLRU(RefBase):
    """A list of every tracked key, least recently used first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.recency: list[int] = []

    def add(self, key, size):
        self.recency.append(key)

    def use(self, key):
        self.recency.remove(key)
        self.recency.append(key)

    def forget(self, key):
        self.recency.remove(key)

    def unpinned(self, key):
        self.use(key)

    def victim(self):
        key = next(k for k in self.recency if k not in self.pinned)
        self.recency.remove(key)
        return key


class RefLFU(RefBase):
    """Use counts since insertion plus a last-use timestamp; min over both."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.count: dict[int, int] = {}
        self.last_use: dict[int, int] = {}
        self.clock = 0

    def _now(self) -> int:
        self.clock += 1
        return self.clock

    def add(self, key, size):
        self.count[key] = 1
        self.last_use[key] = self._now()

    def use(self, key):
        self.count[key] += 1
        self.last_use[key] = self._now()

    def forget(self, key):
        del self.count[key]
        del self.last_use[key]

    def unpinned(self, key):
        self.last_use[key] = self._now()  # latest use, but not an extra count

    def victim(self):
        candidates = [k for k in self.sizes if k not in self.pinned]
        key = min(candidates, key=lambda k: (self.count[k], self.last_use[k]))
        self.forget(key)
        return key


class RefClock(RefBase):
    """A ring (plain list, front = the hand) of unpinned keys and a bit per key."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.ring: list[int] = []
        self.bit: dict[int, bool] = {}

    def add(self, key, size):
        self.ring.append(key)
        self.bit[key] = False  # new entries start with a clear reference bit

    def use(self, key):
        self.bit[key] = True  # never moves the key

    def forget(self, key):
        if key not in self.pinned:
            self.ring.remove(key)
        del self.bit[key]

    def pin(self, key):
        if key not in self.pinned:
            self.ring.remove(key)
        super().pin(key)

    def unpinned(self, key):
        self.ring.append(key)  # back behind the hand, bit unchanged

    def victim(self):
        while True:
            key = self.ring.pop(0)
            if self.bit[key]:
                self.bit[key] = False  # second chance
                self.ring.append(key)
                continue
            del self.bit[key]
            return key


class RefARC(RefBase):
    """ARC as described in plugins/eviction/adaptive.py, with plain lists.

    T1/T2 hold resident keys (pinned included) oldest first; B1/B2 hold
    ``(key, ghost_size)`` pairs oldest first, a ghost's size being
    ``max(size, 1)``. All list sizes are recomputed by summing.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[tuple[int, int]] = []
        self.b2: list[tuple[int, int]] = []
        self.p = 0.0

    def size_t1(self) -> int:
        return sum(self.sizes[k] for k in self.t1)

    def size_t2(self) -> int:
        return sum(self.sizes[k] for k in self.t2)

    def size_b1(self) -> int:
        return sum(s for _, s in self.b1)

    def size_b2(self) -> int:
        return sum(s for _, s in self.b2)

    def ghost(self, key: int) -> str | None:
        if any(k == key for k, _ in self.b1):
            return "b1"
        if any(k == key for k, _ in self.b2):
            return "b2"
        return None

    def add(self, key, size):
        where = self.ghost(key)
        if where == "b1":  # recency was evicted too early: grow T1's target
            step = max(1.0, self.size_b2() / self.size_b1()) * max(size, 1)
            self.p = min(float(self.capacity), self.p + step)
            self.b1 = [(k, s) for k, s in self.b1 if k != key]
            self.t2.append(key)
        elif where == "b2":  # frequency was evicted too early: shrink it
            step = max(1.0, self.size_b1() / self.size_b2()) * max(size, 1)
            self.p = max(0.0, self.p - step)
            self.b2 = [(k, s) for k, s in self.b2 if k != key]
            self.t2.append(key)
        else:
            self.t1.append(key)
        self.trim_ghosts()

    def use(self, key):
        if key in self.t1:
            self.t1.remove(key)
        else:
            self.t2.remove(key)
        self.t2.append(key)  # seen at least twice

    def forget(self, key):
        (self.t1 if key in self.t1 else self.t2).remove(key)

    def unpinned(self, key):
        lst = self.t1 if key in self.t1 else self.t2
        lst.remove(key)
        lst.append(key)

    def victim(self):
        free_t1 = [k for k in self.t1 if k not in self.pinned]
        free_t2 = [k for k in self.t2 if k not in self.pinned]
        if free_t1 and (self.size_t1() > self.p or not free_t2):
            key = free_t1[0]
            ghost_size = max(self.sizes[key], 1)
            self.t1.remove(key)
            self.b1.append((key, ghost_size))
        else:
            key = free_t2[0]
            ghost_size = max(self.sizes[key], 1)
            self.t2.remove(key)
            self.b2.append((key, ghost_size))
        # the key is still in self.sizes here (RefBase.evict deletes it), but
        # no longer in T1/T2, so the sums below already exclude it
        self.trim_ghosts()
        return key

    def trim_ghosts(self):
        cap = self.capacity
        while self.b1 and self.size_t1() + self.size_b1() > cap:
            self.b1.pop(0)
        while self.b2 and self.size_t1() + self.size_t2() + self.size_b1() + self.size_b2() > 2 * cap:
            self.b2.pop(0)
        while self.b1 and self.size_b1() + self.size_b2() > 2 * cap:
            self.b1.pop(0)


# ---------------------------------------------------------------------------
# The state machine, one subclass per policy
# ---------------------------------------------------------------------------


class PolicyMachine(RuleBasedStateMachine):
    policy_name: str
    reference: type[RefBase]

    @initialize(capacity=st.integers(min_value=1, max_value=8))
    def start(self, capacity):
        self.policy = make_policy(self.policy_name, capacity)
        self.ref = self.reference(capacity)
        self.evicted: list[int] = []  # evicted keys, latest last (ARC ghost candidates)

    # helpers
    def tracked(self) -> list[int]:
        return sorted(self.ref.sizes)

    def untracked(self) -> list[int]:
        return [k for k in KEY_SPACE if k not in self.ref.sizes]

    def has_tracked(self) -> bool:
        return bool(self.ref.sizes)

    def has_untracked(self) -> bool:
        return len(self.ref.sizes) < len(KEY_SPACE)

    def pick_tracked(self, data) -> int:
        """A tracked key, often a pinned one (uses of pinned keys are the subtle case)."""
        if self.ref.pinned and data.draw(st.booleans(), label="from pinned"):
            return data.draw(st.sampled_from(sorted(self.ref.pinned)), label="key")
        return data.draw(st.sampled_from(self.tracked()), label="key")

    def evicted_untracked(self) -> list[int]:
        return [k for k in self.evicted if k not in self.ref.sizes]

    # rules
    @precondition(lambda self: self.has_untracked())
    @rule(data=st.data(), size=SIZES)
    def insert_new(self, data, size):
        key = data.draw(st.sampled_from(self.untracked()), label="key")
        self.policy.insert(key, size)
        self.ref.insert(key, size)

    @precondition(lambda self: bool(self.evicted_untracked()))
    @rule(data=st.data(), size=SIZES)
    def insert_evicted(self, data, size):
        """Bring back a key evicted earlier: a ghost hit for ARC, a miss for the rest."""
        key = data.draw(st.sampled_from(self.evicted_untracked()[-4:]), label="key")
        self.policy.insert(key, size)
        self.ref.insert(key, size)

    @precondition(lambda self: self.has_tracked())
    @rule(data=st.data(), size=SIZES)
    def reinsert(self, data, size):
        key = self.pick_tracked(data)
        self.policy.insert(key, size)
        self.ref.insert(key, size)

    @precondition(lambda self: self.has_tracked())
    @rule(data=st.data())
    def touch(self, data):
        key = self.pick_tracked(data)
        self.policy.touch(key)
        self.ref.touch(key)

    @precondition(lambda self: self.has_tracked())
    @rule(data=st.data())
    def remove(self, data):
        key = data.draw(st.sampled_from(self.tracked()), label="key")
        self.policy.remove(key)
        self.ref.remove(key)

    @precondition(lambda self: self.has_tracked())
    @rule(data=st.data())
    def pin(self, data):
        key = data.draw(st.sampled_from(self.tracked()), label="key")
        self.policy.pin(key)
        self.ref.pin(key)

    @precondition(lambda self: self.has_tracked())
    @rule(data=st.data())
    def unpin(self, data):
        pool = sorted(self.ref.pinned) or self.tracked()
        key = data.draw(st.sampled_from(pool), label="key")
        self.policy.unpin(key)
        self.ref.unpin(key)

    @rule()
    def evict(self):
        pinned_before = set(self.ref.pinned)
        all_pinned = all(k in pinned_before for k in self.ref.sizes)
        victim = self.policy.evict()
        expected = self.ref.evict()
        assert victim == expected
        assert (victim is None) == all_pinned
        assert victim not in pinned_before
        if victim is not None:
            assert victim not in self.policy
            self.evicted.append(victim)

    @rule()
    def evict_until_none(self):
        while (expected := self.ref.evict()) is not None:
            assert self.policy.evict() == expected
            self.evicted.append(expected)
        assert self.policy.evict() is None
        assert set(self.policy) == self.ref.pinned

    @precondition(lambda self: self.has_untracked())
    @rule(data=st.data(), op=st.sampled_from(["touch", "remove", "pin", "unpin", "size_of"]))
    def unknown_key(self, data, op):
        key = data.draw(st.sampled_from(self.untracked()), label="key")
        with pytest.raises(KeyError):
            getattr(self.policy, op)(key)

    # invariants, checked after every step
    @invariant()
    def contents_match(self):
        if not hasattr(self, "policy"):
            return
        assert len(self.policy) == len(self.ref.sizes)
        assert set(self.policy) == set(self.ref.sizes)
        for key in KEY_SPACE:
            assert (key in self.policy) == (key in self.ref.sizes)
        assert self.policy.total_size == self.ref.total_size
        for key, size in self.ref.sizes.items():
            assert self.policy.size_of(key) == size
            assert self.policy.is_pinned(key) == (key in self.ref.pinned)

    @invariant()
    def next_victim_matches(self):
        if not hasattr(self, "policy"):
            return
        assert copy.deepcopy(self.policy).evict() == copy.deepcopy(self.ref).evict()


class LRUMachine(PolicyMachine):
    policy_name = "lru"
    reference = RefLRU


class LFUMachine(PolicyMachine):
    policy_name = "lfu"
    reference = RefLFU


class ClockMachine(PolicyMachine):
    policy_name = "clock"
    reference = RefClock


class AdaptiveMachine(PolicyMachine):
    policy_name = "adaptive"
    reference = RefARC

    @invariant()
    def arc_invariants(self):
        if not hasattr(self, "policy"):
            return
        cap = self.policy.capacity
        p = self.policy.target_t1_size
        assert 0 <= p <= cap
        assert p == self.ref.p
        # ghost lists (private, but their bound is the documented promise)
        assert len(self.policy._b1) + len(self.policy._b2) <= 2 * cap
        assert len(self.ref.b1) + len(self.ref.b2) <= 2 * cap
        assert [k for k, _ in self.ref.b1] == list(self.policy._b1)
        assert [k for k, _ in self.ref.b2] == list(self.policy._b2)
        # the cached list sizes must equal the sums over the lists
        assert self.policy._t1_size == self.ref.size_t1()
        assert self.policy._t2_size == self.ref.size_t2()
        assert self.policy._b1_size == self.ref.size_b1()
        assert self.policy._b2_size == self.ref.size_b2()


TestLRUModel = MACHINE_SETTINGS(LRUMachine).TestCase
TestLFUModel = MACHINE_SETTINGS(LFUMachine).TestCase
TestClockModel = MACHINE_SETTINGS(ClockMachine).TestCase
TestAdaptiveModel = MACHINE_SETTINGS(AdaptiveMachine).TestCase


# ---------------------------------------------------------------------------
# Hand-written examples of the documented semantics (readable regressions)
# ---------------------------------------------------------------------------


def test_registry_has_the_builtins():
    assert set(POLICY_NAMES) <= set(_REGISTRY.names())


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_edges(name):
    policy = make_policy(name, 4)
    assert policy.evict() is None
    for op in ("touch", "remove", "pin", "unpin", "size_of"):
        with pytest.raises(KeyError):
            getattr(policy, op)("missing")
    with pytest.raises(ValueError):
        policy.insert("a", -1)
    with pytest.raises(ValueError):
        make_policy(name, 0)
    policy.insert("a", 2)
    policy.pin("a")
    assert policy.evict() is None
    assert "a" in policy and policy.total_size == 2
    policy.unpin("a")
    assert policy.evict() == "a"
    assert len(policy) == 0 and policy.total_size == 0


def test_lfu_ties_broken_by_least_recent_use():
    policy = make_policy("lfu", 10)
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    policy.touch("b")
    policy.touch("c")  # all count 2; a is least recently used
    policy.touch("a")  # a: 3
    assert policy.evict() == "b"
    assert policy.evict() == "c"
    assert policy.evict() == "a"


def test_clock_second_chance():
    policy = make_policy("clock", 10)
    for key in "abc":
        policy.insert(key)
    policy.touch("a")  # a gets its bit set; the hand clears it and moves on
    assert policy.evict() == "b"
    assert policy.evict() == "c"
    assert policy.evict() == "a"


def test_unpin_counts_as_latest_use():
    for name in ("lru", "lfu", "clock", "adaptive"):
        policy = make_policy(name, 10)
        for key in "abc":
            policy.insert(key)
        policy.pin("a")
        policy.unpin("a")
        assert policy.evict() == "b", name


def test_adaptive_reinsert_with_new_size_keeps_t1_t2_accounting():
    """Re-inserting a T1 key with a different size promotes it to T2; the
    cached T1/T2 sizes must follow the new size, not drift."""
    policy = make_policy("adaptive", 4)
    policy.insert("a", 1)
    policy.insert("a", 3)  # re-insert: size 1 -> 3, and a use (T1 -> T2)
    assert policy._t1_size == 0
    assert policy._t2_size == 3
    policy.remove("a")
    assert policy._t1_size == 0 and policy._t2_size == 0


def test_lfu_heap_stays_proportional_to_entries():
    """A hot key's count climbing must not leave one stale heap entry per touch
    behind a live low-count bucket (memory growing with traffic, not size)."""
    policy = make_policy("lfu", 10)
    policy.insert("cold")
    policy.insert("hot")
    for _ in range(10_000):
        policy.touch("hot")
    assert len(policy._heap) <= 2 * len(policy._buckets) + 8
    assert policy.evict() == "cold"
    assert policy.evict() == "hot"


# ---------------------------------------------------------------------------
# Hit rates on the synthetic traces
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traces():
    return {"mixed": mixed_trace(), "recency": recency_trace(), "frequency": frequency_trace()}


def hit_rate(name, trace, capacity):
    return replay(make_policy(name, capacity), trace, capacity)


@pytest.mark.parametrize("capacity", [100, 400])
def test_adaptive_beats_lru_and_lfu_on_mixed(traces, capacity):
    adaptive = hit_rate("adaptive", traces["mixed"], capacity)
    lru = hit_rate("lru", traces["mixed"], capacity)
    lfu = hit_rate("lfu", traces["mixed"], capacity)
    assert adaptive > lru, (adaptive, lru)
    assert adaptive > lfu, (adaptive, lfu)


@pytest.mark.parametrize("trace_name", ["recency", "frequency"])
@pytest.mark.parametrize("capacity", [100, 200, 400])
def test_adaptive_close_to_best_specialist(traces, trace_name, capacity):
    adaptive = hit_rate("adaptive", traces[trace_name], capacity)
    best = max(hit_rate("lru", traces[trace_name], capacity), hit_rate("lfu", traces[trace_name], capacity))
    assert adaptive >= best - 0.03, (adaptive, best)


# ---------------------------------------------------------------------------
# evict() must not scan pinned entries (catches O(n) loops by running time)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_evict_skips_many_pinned_entries(name):
    n, free = 20_000, 1_000
    policy = make_policy(name, n)
    for key in range(n):
        policy.insert(key, 1)
        if key < n - free:
            policy.pin(key)
            policy.touch(key)  # uses of pinned keys must not make them victims
    for key in range(n - free, n, 2):
        policy.touch(key)  # half the free keys referenced (CLOCK's hand must sweep)
    victims = [policy.evict() for _ in range(free)]
    assert sorted(victims) == list(range(n - free, n))
    assert policy.evict() is None
    assert len(policy) == n - free
    assert policy.total_size == n - free
