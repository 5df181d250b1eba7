"""``check_eviction_policy``: the rules every eviction policy keeps, run over a policy class.

The rules are those ``tierserve.cache.eviction`` states; the built-in
policies pass them in tierserve's own tests. Each failure names the rule,
the class and the operations that led to it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

from tierserve.cache.eviction import EvictionPolicy
from tierserve.testing.rules import RuleBroken, rule

PolicyFactory = Callable[[int], EvictionPolicy]


def check_eviction_policy(policy: PolicyFactory, *, capacity: int = 8, operations: int = 3000, seed: int = 0) -> list[str]:
    """Run every eviction-policy rule over ``policy`` (the class, or the factory registered for it).

    Args:
        policy: called as ``policy(capacity)``, as a tier calls it.
        capacity: the entries the pretend tier holds.
        operations: length of the random run of inserts, touches, pins, unpins, removes and evictions.
        seed: seeds that run (the same seed, the same operations).

    Returns:
        The names of the rules checked (all passed).

    Raises:
        RuleBroken: (an ``AssertionError``) the first rule broken, with what happened.
    """
    checked = []
    for check in (
        _builds_with_capacity,
        _empty_policy_evicts_nothing,
        _every_key_is_evicted_once,
        _pinned_keys_are_never_evicted,
        _untracked_keys_raise_key_error,
        _reinsert_updates_size_and_counts_a_use,
        _removed_keys_are_forgotten,
        _touching_a_pinned_key_keeps_it_pinned,
        _any_hashable_key,
    ):
        with rule(check, policy):
            check(policy, capacity)
        checked.append(check.__name__.strip("_"))
    with rule(_random_operations_keep_the_books, policy):
        _random_operations_keep_the_books(policy, capacity, operations, seed)
    checked.append("random_operations_keep_the_books")
    return checked


def drain(policy: EvictionPolicy) -> list[Hashable]:
    """``evict()`` until it returns ``None``; the victims in order."""
    victims = []
    for _ in range(len(policy) + 1):
        victim = policy.evict()
        if victim is None:
            return victims
        victims.append(victim)
    raise RuleBroken(f"evict() returned a key more times than keys were tracked: {victims}")


def _builds_with_capacity(factory: PolicyFactory, capacity: int) -> None:
    """``policy(capacity)`` is an ``EvictionPolicy`` that keeps ``capacity``."""
    made = factory(capacity)
    if not isinstance(made, EvictionPolicy):
        raise RuleBroken(f"policy({capacity}) returned {made!r}, not a tierserve.cache.eviction.EvictionPolicy")
    if made.capacity != capacity:
        raise RuleBroken(f"policy({capacity}).capacity is {made.capacity}")
    if len(made) != 0 or made.total_size != 0:
        raise RuleBroken("a new policy tracks keys already")


def _empty_policy_evicts_nothing(factory: PolicyFactory, capacity: int) -> None:
    """``evict()`` on a policy tracking nothing returns ``None``."""
    if (victim := factory(capacity).evict()) is not None:
        raise RuleBroken(f"evict() of an empty policy returned {victim!r}")


def _every_key_is_evicted_once(factory: PolicyFactory, capacity: int) -> None:
    """Evicting until ``None`` returns each tracked key exactly once, and leaves nothing tracked."""
    policy = factory(capacity)
    keys = list(range(3 * capacity))
    for key in keys:
        policy.insert(key)
    for key in keys[::3]:
        policy.touch(key)
    victims = drain(policy)
    if sorted(victims) != keys:
        raise RuleBroken(f"inserted {keys}, evicted {victims}")
    if len(policy) or policy.total_size:
        raise RuleBroken(f"after evicting everything: len {len(policy)}, total_size {policy.total_size}")


def _pinned_keys_are_never_evicted(factory: PolicyFactory, capacity: int) -> None:
    """A pinned key is never a victim; ``evict()`` is ``None`` when only pinned keys are left; ``unpin`` frees it."""
    policy = factory(capacity)
    for key in range(6):
        policy.insert(key)
    for key in (1, 4):
        policy.pin(key)
    victims = drain(policy)
    if sorted(victims) != [0, 2, 3, 5]:
        raise RuleBroken(f"keys 1 and 4 pinned, evicted {victims}")
    if sorted(policy) != [1, 4] or not policy.is_pinned(1):
        raise RuleBroken(f"the pinned keys are not all still tracked and pinned: {sorted(policy)}")
    policy.unpin(4)
    if (victim := policy.evict()) != 4:
        raise RuleBroken(f"after unpin(4), evict() returned {victim!r}")
    if (victim := policy.evict()) is not None:
        raise RuleBroken(f"with only pinned key 1 left, evict() returned {victim!r}")


def _untracked_keys_raise_key_error(factory: PolicyFactory, capacity: int) -> None:
    """``touch``, ``remove``, ``pin``, ``unpin`` and ``size_of`` of a key not tracked raise ``KeyError``, changing nothing."""
    policy = factory(capacity)
    policy.insert("kept")
    for name in ("touch", "remove", "pin", "unpin", "size_of"):
        try:
            getattr(policy, name)("absent")
        except KeyError:
            pass
        else:
            raise RuleBroken(f"{name}('absent') of a key never inserted did not raise KeyError")
    policy.insert("evicted")
    policy.remove("kept")
    [victim] = drain(policy)
    for name in ("touch", "remove", "pin", "unpin"):
        try:
            getattr(policy, name)(victim)
        except KeyError:
            continue
        raise RuleBroken(f"{name}({victim!r}) of a key already evicted did not raise KeyError")
    if len(policy) != 0:
        raise RuleBroken("a failed call left a key tracked")


def _reinsert_updates_size_and_counts_a_use(factory: PolicyFactory, capacity: int) -> None:
    """``insert`` of a tracked key updates its size (``total_size`` follows) and keeps one entry."""
    policy = factory(capacity)
    policy.insert("a", 2)
    policy.insert("b", 3)
    policy.insert("a", 5)
    if len(policy) != 2 or policy.size_of("a") != 5 or policy.total_size != 8:
        raise RuleBroken(f"after insert a=2, b=3, a=5: len {len(policy)}, size_of(a) {policy.size_of('a')}, "
                         f"total_size {policy.total_size}")  # fmt: skip


def _removed_keys_are_forgotten(factory: PolicyFactory, capacity: int) -> None:
    """A removed key, pinned or not, is never evicted afterwards."""
    policy = factory(capacity)
    for key in range(5):
        policy.insert(key)
    policy.pin(3)
    policy.remove(3)
    policy.remove(0)
    victims = drain(policy)
    if sorted(victims) != [1, 2, 4]:
        raise RuleBroken(f"0 and 3 (pinned) removed, evicted {victims}")


def _touching_a_pinned_key_keeps_it_pinned(factory: PolicyFactory, capacity: int) -> None:
    """``touch`` of a pinned key is a use, not an unpin: the key stays out of eviction."""
    policy = factory(capacity)
    for key in range(3):
        policy.insert(key)
    policy.pin(0)
    policy.touch(0)
    policy.insert(0)
    if 0 in drain(policy):
        raise RuleBroken("a pinned key was evicted after touch/insert")
    if not policy.is_pinned(0):
        raise RuleBroken("touch of a pinned key unpinned it")


def _any_hashable_key(factory: PolicyFactory, capacity: int) -> None:
    """Keys are any hashable values: tiers use bytes (block hashes), tests ints, strings and tuples."""
    policy = factory(capacity)
    keys = [b"\x00" * 16, b"\xff" * 16, 7, "seven", (1, 2)]
    for key in keys:
        policy.insert(key)
    if sorted(map(repr, drain(policy))) != sorted(map(repr, keys)):
        raise RuleBroken("not every kind of hashable key came back from evict()")


def _random_operations_keep_the_books(factory: PolicyFactory, capacity: int, operations: int, seed: int) -> None:
    """Through a random run of every operation, the policy agrees with a plain model: which keys are tracked and
    pinned, the sizes, and that ``evict()`` picks a tracked, unpinned key (``None`` exactly when there is none)."""
    rng = random.Random(seed)
    policy = factory(capacity)
    sizes: dict[int, int] = {}
    pinned: set[int] = set()
    history: list[str] = []
    for _ in range(operations):
        key = rng.randrange(3 * capacity)
        op = rng.choices(("insert", "touch", "pin", "unpin", "remove", "evict"), (6, 5, 2, 2, 1, 4))[0]
        if op != "insert" and op != "evict" and key not in sizes:
            continue
        history = [*history[-11:], f"{op}({key})" if op != "evict" else "evict()"]
        if op == "insert":
            size = rng.randint(1, 3)
            policy.insert(key, size)
            sizes[key] = size
        elif op == "touch":
            policy.touch(key)
        elif op == "pin":
            policy.pin(key)
            pinned.add(key)
        elif op == "unpin":
            policy.unpin(key)
            pinned.discard(key)
        elif op == "remove":
            policy.remove(key)
            sizes.pop(key)
            pinned.discard(key)
        else:
            victim = policy.evict()
            evictable = sizes.keys() - pinned
            if victim is None:
                if evictable:
                    raise RuleBroken(f"evict() returned None with {sorted(evictable)} evictable; last: {history}")
            elif victim not in evictable:
                state = "pinned" if victim in pinned else "not tracked"
                raise RuleBroken(f"evict() returned {victim!r}, which is {state}; last operations: {history}")
            else:
                sizes.pop(victim)
        if set(policy) != sizes.keys() or len(policy) != len(sizes):
            raise RuleBroken(f"tracked keys {sorted(policy)} != {sorted(sizes)}; last operations: {history}")
        if policy.total_size != sum(sizes.values()):
            raise RuleBroken(f"total_size {policy.total_size} != {sum(sizes.values())}; last operations: {history}")
        if {k for k in sizes if policy.is_pinned(k)} != pinned:
            raise RuleBroken(f"pinned keys differ from the ones pinned; last operations: {history}")
