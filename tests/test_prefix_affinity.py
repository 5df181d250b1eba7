"""The fleet router's bookkeeping: which replica a request prefers, and when load overrules it."""

from __future__ import annotations

import json

import pytest

from tierserve.fleet.prefix_affinity import CHUNK_CHARS, PrefixAffinity, choose, route_key

pytestmark = pytest.mark.unit

SYSTEM = "You are a helpful assistant for a railway company; answer about timetables only. " * 2
ALICE = {"authorization": "Bearer alice-key"}


def chat(*turns: str, **extra) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": turn} for turn in turns]
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def test_a_conversation_prefers_the_replica_that_had_its_earlier_turns():
    affinity = PrefixAffinity()
    first = route_key(ALICE, chat("When is the first train?"))
    assert affinity.prefer(first, ["a", "b"])[:2] == (None, "no_match")
    affinity.record(first, "b")
    follow_up = route_key(ALICE, chat("When is the first train?", "And the last one?"))
    replica, reason, matched = affinity.prefer(follow_up, ["a", "b"])
    assert (replica, reason) == ("b", "prefix") and matched >= len(SYSTEM) // CHUNK_CHARS
    assert affinity.prefer(follow_up, ["a"])[:2] == (None, "no_match")  # b is gone: nothing to prefer
    affinity.forget_replica("b")
    assert affinity.prefer(follow_up, ["a", "b"])[:2] == (None, "no_match")


def test_tenants_and_unrelated_prompts_do_not_attract_each_other():
    affinity = PrefixAffinity()
    affinity.record(route_key(ALICE, chat("hi")), "a")
    bob = route_key({"authorization": "Bearer bob-key"}, chat("hi"))
    assert affinity.prefer(bob, ["a", "b"])[0] is None
    other = route_key(ALICE, json.dumps({"prompt": "x" * 200}).encode())
    assert affinity.prefer(other, ["a", "b"])[0] is None
    tokens = route_key(ALICE, json.dumps({"prompt": list(range(40))}).encode())
    affinity.record(tokens, "b")
    longer = route_key(ALICE, json.dumps({"prompt": [list(range(50))]}).encode())
    assert affinity.prefer(longer, ["a", "b"])[:2] == ("b", "prefix")


def test_a_cache_key_goes_where_it_went_before_and_bad_bodies_are_unparsed():
    affinity = PrefixAffinity()
    keyed = route_key(ALICE, json.dumps({"prompt": "short", "cache_key": "docs"}).encode())
    affinity.record(keyed, "a")
    again = route_key(ALICE, json.dumps({"prompt": "other", "cache_key": "docs"}).encode())
    assert affinity.prefer(again, ["a", "b"])[:2] == ("a", "cache_key")
    assert route_key(ALICE, b"{not json") is None
    assert affinity.prefer(None, ["a"])[:2] == (None, "unparsed")


def test_the_index_is_bounded_oldest_first():
    affinity = PrefixAffinity(max_chunks=4)
    old = route_key(ALICE, json.dumps({"prompt": "o" * CHUNK_CHARS * 3}).encode())
    new = route_key(ALICE, json.dumps({"prompt": "n" * CHUNK_CHARS * 3}).encode())
    affinity.record(old, "a")
    affinity.record(new, "b")
    assert len(affinity) == 4
    assert affinity.prefer(new, ["a", "b"])[:2] == ("b", "prefix")
    assert affinity.prefer(old, ["a", "b"])[0] is None  # its first chunks were forgotten


def test_a_busy_preferred_replica_loses_the_request_to_the_least_loaded():
    first = min
    assert choose("a", {"a": 3, "b": 1}, max_imbalance=2, pick=first) == ("a", True)
    assert choose("a", {"a": 5, "b": 2, "c": 2}, max_imbalance=2, pick=first) == ("b", False)
    assert choose(None, {"a": 0, "b": 1}, max_imbalance=2, pick=first) == ("a", False)
