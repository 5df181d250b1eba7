"""``check_cache_tier``: the rules every cache tier keeps, run over a tier's factory.

The rules are those ``tierserve.cache.tier.CacheTier`` and the
``register_cache_tiers`` hookspec state; the built-in memory and disk tiers
pass them in tierserve's own tests. Each rule builds a fresh tier the way the
engine does (``factory(tier_settings, policy_factory, fingerprint)``), clears
it (a persistent tier may hold an earlier rule's entries), runs, and closes it.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tierserve.cache.tier import CacheEntry, CacheTier
from tierserve.cache.figures import Figures
from tierserve.core.tier_settings import TierSettings
from tierserve.plugins.eviction.lru import LRUPolicy
from tierserve.testing.rules import RuleBroken, rule

TierFactory = Callable[[TierSettings, Callable[[int], Any], str], CacheTier]
Options = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
KV_SHAPE = (2, 2, 4, 1, 8)  # layers, K and V, block size, KV heads, head size: 512 bytes in float32
BLOCK_TOKENS = KV_SHAPE[2]


def make_entry(index: int, parent: bytes | None = None, *, created: float | None = None) -> CacheEntry:
    """A block of KV the way the store hands one to a tier: a 16-byte key, its tokens and a CPU tensor."""
    token_ids = tuple(range(index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS))
    key = hashlib.blake2b(repr((parent, token_ids)).encode(), digest_size=16).digest()
    kv = torch.arange(torch.Size(KV_SHAPE).numel(), dtype=torch.float32).reshape(KV_SHAPE) + index
    entry = CacheEntry(key, parent, token_ids, kv)
    if created is not None:
        entry.created = created
    return entry


def chain(count: int, start: int = 0) -> list[CacheEntry]:
    """``count`` blocks of one prompt, each the parent of the next."""
    entries: list[CacheEntry] = []
    for index in range(start, start + count):
        entries.append(make_entry(index, entries[-1].key if entries else None))
    return entries


@dataclass(frozen=True, slots=True)
class TierUnderTest:
    """How to build the tier: its factory and the entry's own keys (a mapping, or a callable giving fresh ones)."""

    factory: TierFactory
    options: Options

    @contextmanager
    def open(self, *, ttl_seconds: float | None = None, fingerprint: str = "model-a", clear: bool = True) -> Iterator[CacheTier]:
        options = self.options() if callable(self.options) else self.options
        settings = TierSettings(name="under_test", plugin="under_test", eviction_policy="lru", ttl_seconds=ttl_seconds,
                                **dict(options))  # fmt: skip
        tier = self.factory(settings, LRUPolicy, fingerprint)
        try:
            if clear:
                tier.clear()
                tier.drain_removed()
            yield tier
        finally:
            tier.close()


def check_cache_tier(factory: TierFactory, options: Options | None = None, *, entries: int = 48) -> list[str]:
    """Run every cache-tier rule over the tier ``factory`` builds (the class or factory registered for it).

    Args:
        factory: called as the engine calls it: ``factory(tier, policy_factory, fingerprint)``.
        options: the tier's own keys, as in its ``[[kv_cache.tiers]]`` entry (e.g. ``{"path": ...,
            "capacity": 16}``), or a callable returning them (called for every tier the rules build). Give it
            a small bound (``capacity.entries`` or ``capacity.bytes`` well under ``entries`` blocks of 512 bytes)
            so the rules on bounds and pins can run; a tier that reports no bound skips them.
        entries: how many blocks the bound and concurrency rules write.

    Returns:
        The names of the rules checked (all passed; a skipped rule is listed with "(skipped: why)").

    Raises:
        RuleBroken: (an ``AssertionError``) the first rule broken, with what happened.
    """
    under_test = TierUnderTest(factory, options or {})
    checked = []
    for check in RULES:
        with rule(check, factory):
            skipped = check(under_test, entries)
        name = check.__name__.strip("_")
        checked.append(name if not skipped else f"{name} (skipped: {skipped})")
    return checked


def same(stored: CacheEntry | None, entry: CacheEntry) -> bool:
    return (
        stored is not None
        and (stored.key, stored.parent, tuple(stored.token_ids)) == (entry.key, entry.parent, entry.token_ids)
        and torch.equal(stored.kv, entry.kv)
    )


def _builds_a_cache_tier(under_test: TierUnderTest, entries: int) -> None:
    """The factory returns a ``CacheTier`` whose constructor called ``super().__init__()`` (``stats``, ``lock``, ``figures``)."""
    with under_test.open() as tier:
        if not isinstance(tier, CacheTier):
            raise RuleBroken(f"the factory returned {tier!r}, not a tierserve.cache.tier.CacheTier")
        for name, kind in (("stats", object), ("lock", object), ("figures", Figures)):
            if not isinstance(getattr(tier, name, None), kind):
                raise RuleBroken(f"the tier has no {name}: call super().__init__() in its constructor")
        if len(tier) != 0 or list(tier.keys()):
            raise RuleBroken("a cleared tier still holds entries")


def _stores_and_returns_an_entry(under_test: TierUnderTest, entries: int) -> None:
    """``put`` then ``get`` returns the same key, parent, tokens and tensor; ``contains``, ``keys``, ``parent_of``, ``len`` agree."""
    first, second = chain(2)
    with under_test.open() as tier:
        for entry in (first, second):
            tier.put(entry)
        tier.flush()
        for entry in (first, second):
            if not tier.contains(entry.key):
                raise RuleBroken("contains() is False for an entry just put")
            if not same(tier.get(entry.key), entry):
                raise RuleBroken("get() returned another key, parent, tokens or tensor than was put")
        if tier.parent_of(second.key) != first.key or tier.parent_of(first.key) is not None:
            raise RuleBroken("parent_of() does not give the parent hash that was put")
        if len(tier) != 2 or set(tier.keys()) != {first.key, second.key}:
            raise RuleBroken(f"len {len(tier)}, keys {list(tier.keys())} after two puts")
        if tier.bytes_used < 0:
            raise RuleBroken(f"bytes_used is {tier.bytes_used}")


def _counts_hits_and_misses(under_test: TierUnderTest, entries: int) -> None:
    """A ``get`` that finds the entry adds 1 to ``stats.hits``, one that does not 1 to ``stats.misses``."""
    [entry] = chain(1)
    with under_test.open() as tier:
        tier.put(entry)
        tier.flush()
        hits, misses = tier.stats.hits, tier.stats.misses
        tier.get(entry.key)
        tier.get(make_entry(999).key)
        if (tier.stats.hits - hits, tier.stats.misses - misses) != (1, 1):
            raise RuleBroken(f"one hit and one miss counted as {tier.stats.hits - hits} hits, {tier.stats.misses - misses} misses")


def _a_replaced_key_is_one_entry(under_test: TierUnderTest, entries: int) -> None:
    """``put`` of a key already stored replaces it: one entry, the newest tensor."""
    [entry] = chain(1)
    newer = CacheEntry(entry.key, entry.parent, entry.token_ids, entry.kv + 1)
    with under_test.open() as tier:
        tier.put(entry)
        tier.put(newer)
        tier.flush()
        if len(tier) != 1:
            raise RuleBroken(f"two puts of one key left {len(tier)} entries")
        if not same(tier.get(entry.key), newer):
            raise RuleBroken("after a replacing put, get() returned the older entry")


def _returned_entries_belong_to_the_caller(under_test: TierUnderTest, entries: int) -> None:
    """Reassigning the fields of an entry ``get`` returned changes nothing stored (an entry given to ``put`` is the tier's)."""
    [entry] = chain(1)
    original = make_entry(0)
    with under_test.open() as tier:
        tier.put(entry)
        tier.flush()
        got = tier.get(original.key)
        if not same(got, original):
            raise RuleBroken("get() returned another entry than was put")
        got.token_ids, got.parent, got.accesses = (1,), b"y" * 16, 9
        if not same(tier.get(original.key), original):
            raise RuleBroken("reassigning the fields of a returned entry changed what the next get() returns")


def _remove_and_clear_delete(under_test: TierUnderTest, entries: int) -> None:
    """``remove`` deletes one key (a missing key is no error); ``clear`` deletes all and returns how many."""
    blocks = chain(3)
    with under_test.open() as tier:
        for entry in blocks:
            tier.put(entry)
        tier.flush()
        tier.remove(blocks[0].key)
        tier.remove(make_entry(999).key)
        if tier.contains(blocks[0].key) or tier.get(blocks[0].key) is not None or len(tier) != 2:
            raise RuleBroken("a removed key is still there")
        if (removed := tier.clear()) != 2:
            raise RuleBroken(f"clear() of 2 entries returned {removed}")
        if len(tier) or list(tier.keys()) or any(tier.contains(e.key) for e in blocks):
            raise RuleBroken("entries are left after clear()")


def _keeps_its_bound_and_accounts_for_every_entry(under_test: TierUnderTest, entries: int) -> str | None:
    """``len`` and ``bytes_used`` stay within ``capacity``; every key put is stored, handed back by ``put``, or
    reported by ``drain_removed`` (the store's index follows the tier through those)."""
    with under_test.open() as tier:
        bound = tier.capacity
        accounted: set[bytes] = set()
        blocks = chain(entries)
        for entry in blocks:
            accounted.update(gone.key for gone in tier.put(entry))
        tier.flush()
        accounted.update(tier.drain_removed())
        stored = set(tier.keys())
        lost = [e.key.hex()[:8] for e in blocks if e.key not in stored and e.key not in accounted]
        if lost:
            raise RuleBroken(f"{len(lost)} keys left without being returned by put() or noted (note_removed): {lost[:4]}")
        if bound.entries is not None and len(tier) > bound.entries:
            raise RuleBroken(f"{len(tier)} entries held, above capacity.entries {bound.entries}")
        if bound.bytes is not None and tier.bytes_used > bound.bytes:
            raise RuleBroken(f"{tier.bytes_used} bytes held, above capacity.bytes {bound.bytes}")
        if bound.entries is None and bound.bytes is None:
            return "the tier reports no bound (capacity); give options that bound it"
        if len(tier) >= entries:
            return f"{entries} entries of 512 bytes fit in the bound; give options with a smaller one"
    return None


def _pinned_entries_outlive_the_bound(under_test: TierUnderTest, entries: int) -> str | None:
    """A pinned entry is neither evicted nor expired however much is put; ``unpin`` makes it evictable again."""
    with under_test.open(ttl_seconds=3600) as tier:
        if tier.capacity.entries is None and tier.capacity.bytes is None:
            return "the tier reports no bound (capacity)"
        old = make_entry(10_000, created=time.time() - 7200)
        tier.put(old)
        tier.flush()
        tier.pin(old.key)
        for entry in chain(entries):
            tier.put(entry)
        tier.flush()
        if not tier.contains(old.key) or tier.get(old.key) is None:
            raise RuleBroken("a pinned entry was evicted or expired")
        tier.unpin(old.key)
        if tier.get(old.key) is not None:
            raise RuleBroken("an unpinned entry past its ttl_seconds was still returned")
    return None


def _expired_entries_are_misses(under_test: TierUnderTest, entries: int) -> None:
    """With ``ttl_seconds``, an entry older than it (by ``entry.created``) is a miss, counted once in
    ``stats.expirations`` and reported by ``drain_removed`` (when it expires is the tier's choice: on the lookup
    that finds it old, on a later ``put``, or in a sweep); a young one is a hit; with no ttl nothing expires."""
    old, young = make_entry(1, created=time.time() - 7200), make_entry(2)
    with under_test.open(ttl_seconds=3600) as tier:
        expirations = tier.stats.expirations
        tier.put(old)
        tier.put(young)
        tier.flush()
        if tier.get(old.key) is not None or tier.contains(old.key):
            raise RuleBroken("an entry older than ttl_seconds was returned")
        if tier.stats.expirations - expirations != 1:
            raise RuleBroken(f"one expired entry counted as {tier.stats.expirations - expirations} in stats.expirations")
        if old.key not in tier.drain_removed():
            raise RuleBroken("an expired entry was not reported by drain_removed (call note_removed)")
        if tier.get(young.key) is None:
            raise RuleBroken("an entry younger than ttl_seconds was not returned")
    with under_test.open(ttl_seconds=None) as tier:
        ancient = make_entry(3, created=0.0)
        tier.put(ancient)
        tier.flush()
        if tier.get(ancient.key) is None:
            raise RuleBroken("with ttl_seconds None an old entry expired")


def _access_counts_follow_the_entry(under_test: TierUnderTest, entries: int) -> None:
    """``access_count`` is the ``get`` hits plus ``entry.accesses`` given to ``put`` plus ``add_accesses`` (never
    below 0); entries ``get`` returns carry ``accesses`` 0; a key not stored counts 0."""
    [entry] = chain(1)
    entry.accesses = 3
    with under_test.open() as tier:
        tier.put(entry)
        tier.flush()
        if (count := tier.access_count(entry.key)) != 3:
            raise RuleBroken(f"put() of an entry with accesses 3: access_count {count}")
        got = tier.get(entry.key)
        if got is None or got.accesses != 0:
            raise RuleBroken(f"get() returned an entry with accesses {getattr(got, 'accesses', None)}, not 0")
        if (count := tier.access_count(entry.key)) != 4:
            raise RuleBroken(f"after one hit: access_count {count}, not 4")
        tier.add_accesses(entry.key, 2)
        tier.add_accesses(entry.key, -100)
        if (count := tier.access_count(entry.key)) != 0:
            raise RuleBroken(f"add_accesses(+2) then (-100): access_count {count}, not 0")
        tier.add_accesses(make_entry(999).key, 5)
        if tier.access_count(make_entry(999).key) != 0:
            raise RuleBroken("a key not stored has an access count")


def _reads_stop_at_the_first_miss(under_test: TierUnderTest, entries: int) -> None:
    """``get_many`` returns the entries in order up to the first key that misses."""
    blocks = chain(4)
    with under_test.open() as tier:
        for entry in (blocks[0], blocks[1], blocks[3]):
            tier.put(entry)
        tier.flush()
        found = tier.get_many([e.key for e in blocks])
        if [e.key for e in found] != [blocks[0].key, blocks[1].key]:
            raise RuleBroken(f"get_many over a gap at the third key returned {len(found)} entries, not 2")


def _another_models_entries_are_never_returned(under_test: TierUnderTest, entries: int) -> None:
    """A tier built for another model (``fingerprint``) over the same storage never returns this one's entries."""
    [entry] = chain(1)
    with under_test.open(fingerprint="model-a") as tier:
        tier.put(entry)
        tier.flush()
    with under_test.open(fingerprint="model-b", clear=False) as other:
        if other.get(entry.key) is not None:
            raise RuleBroken("a tier built with another fingerprint returned an entry written under the first")
        other.clear()


def _threads_share_it_safely(under_test: TierUnderTest, entries: int) -> None:
    """Puts, gets, removes and pins from several threads at once raise nothing and leave ``len`` and ``keys`` agreeing."""
    errors: list[BaseException] = []
    with under_test.open() as tier:

        def work(offset: int) -> None:
            try:
                blocks = chain(entries // 4, start=offset * 1000)
                for index, entry in enumerate(blocks):
                    tier.put(entry)
                    tier.get(blocks[index // 2].key)
                    if index % 5 == 0:
                        tier.pin(entry.key)
                        tier.unpin(entry.key)
                    if index % 7 == 0:
                        tier.remove(blocks[index // 3].key)
            except BaseException as exc:  # noqa: BLE001 - reported below, on the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        tier.flush()
        if errors:
            raise RuleBroken(f"a thread raised {type(errors[0]).__name__}: {errors[0]}")
        if len(tier) != len(list(tier.keys())):
            raise RuleBroken(f"len {len(tier)} disagrees with keys() ({len(list(tier.keys()))})")


RULES = (
    _builds_a_cache_tier,
    _stores_and_returns_an_entry,
    _counts_hits_and_misses,
    _a_replaced_key_is_one_entry,
    _returned_entries_belong_to_the_caller,
    _remove_and_clear_delete,
    _keeps_its_bound_and_accounts_for_every_entry,
    _pinned_entries_outlive_the_bound,
    _expired_entries_are_misses,
    _access_counts_follow_the_entry,
    _reads_stop_at_the_first_miss,
    _another_models_entries_are_never_returned,
    _threads_share_it_safely,
)
