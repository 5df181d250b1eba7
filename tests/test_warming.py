"""The most used prefixes, ranked from the tiers' access counts, and warming them into the faster tiers.

Also across a restart: a persistent disk tier keeps its counts, so the store
that reopens it ranks and warms what was hot before.
"""

from __future__ import annotations

import pytest
import torch

from tests.store_helpers import BLOCK, PROMPT_BLOCKS, Requests, StoreTier, build_tier, prompt

pytestmark = pytest.mark.unit

SYSTEM = [7000 + i for i in range(2 * BLOCK)]  # a shared system prompt: two blocks


def conversation(n: int) -> list[int]:
    """The system prompt, two blocks of conversation ``n``, and one more token."""
    return SYSTEM + [100 * n + i for i in range(2 * BLOCK + 1)]


def three_tiers(tmp_path, persistent: bool = False) -> list[StoreTier]:
    """l2 in memory holding one prompt's blocks; l3 on disk, written through when persistent."""
    return [
        StoreTier("l2", build_tier("memory", capacity=PROMPT_BLOCKS, max_bytes=0)),
        StoreTier("l3", build_tier("disk", path=str(tmp_path / "l3"), persistent=persistent), persistent),
    ]


# ---------------------------------------------------------------------------
# frequent_prefixes
# ---------------------------------------------------------------------------


def test_frequent_prefixes_put_a_shared_prefix_first_then_each_extension_by_its_uses():
    requests = Requests(2 * PROMPT_BLOCKS + 1, [StoreTier("l2", build_tier("memory", capacity=100, max_bytes=0))])
    store = requests.store
    # every request after the first is served from l2 (offload empties l1 after each), so l2 counts every use
    for tokens in [conversation(1)] * 3 + [conversation(2)] * 2:
        requests.run(tokens)
        store.offload()
    one, two = requests.hashes(conversation(1)), requests.hashes(conversation(2))
    system = one[:2]
    # uses: the system blocks 4, conversation 1's own blocks 2, conversation 2's own blocks 1
    assert store.frequent_prefixes(10) == [system, one, two]
    assert store.frequent_prefixes(1) == [system]
    assert store.frequent_prefixes(0) == []

    store.evict_keys(system[:1])  # no prefix can be served without its first block
    assert store.frequent_prefixes(10) == []


def test_blocks_never_hit_are_not_frequent():
    requests = Requests(PROMPT_BLOCKS + 1, [StoreTier("l2", build_tier("memory", capacity=100, max_bytes=0))])
    for n in range(3):
        requests.run(prompt(n))
    requests.store.offload()
    assert requests.store.frequent_prefixes(10) == []


# ---------------------------------------------------------------------------
# warm_frequent
# ---------------------------------------------------------------------------


def make_prompt_0_hot(requests: Requests) -> torch.Tensor:
    """Prompt 0 used three times, sent to disk between uses by prompts used once; its cold KV."""
    _, cold = requests.run(prompt(0))
    for round_ in range(3):
        requests.store.offload()  # prompt 0 to l2 (one prompt's blocks fill it)
        requests.run(prompt(100 + round_))
        requests.store.offload()  # that prompt to l2, and prompt 0 on to disk
        if round_ < 2:
            assert requests.run(prompt(0))[0].hits["l3"] == PROMPT_BLOCKS
    assert all(requests.tiers_holding(key) == ["l3"] for key in requests.hashes(prompt(0)))
    return cold


def test_warming_moves_the_hot_prefix_from_disk_into_l1_and_l2(tmp_path):
    requests = Requests(PROMPT_BLOCKS + 1, three_tiers(tmp_path))
    store = requests.store
    try:
        cold = make_prompt_0_hot(requests)
        hot = requests.hashes(prompt(0))
        assert store.frequent_prefixes(5) == [hot]

        report = store.warm_frequent(limit_blocks=100)
        assert (report.prefixes, report.blocks, report.tokens, report.skipped) == (
            1, {"l1": PROMPT_BLOCKS, "l2": PROMPT_BLOCKS}, PROMPT_BLOCKS * BLOCK, {},
        )  # fmt: skip
        assert all(requests.tiers_holding(key) == ["l1", "l2", "l3"] for key in hot)
        assert store.frequent_prefixes(5) == [hot]  # the warm's own reads are not uses
        store.check_integrity()

        match, again = requests.run(prompt(0))
        assert match.hits == {"l1": PROMPT_BLOCKS, "l2": 0, "l3": 0} and torch.equal(again, cold)
    finally:
        requests.close()


def test_warming_stops_at_the_block_limit_parents_first(tmp_path):
    requests = Requests(PROMPT_BLOCKS + 1, three_tiers(tmp_path))
    try:
        make_prompt_0_hot(requests)
        hot = requests.hashes(prompt(0))
        report = requests.store.warm_frequent(limit_blocks=2)
        assert report.blocks == {"l1": 2, "l2": 2}
        assert [requests.tiers_holding(key) for key in hot] == [["l1", "l2", "l3"]] * 2 + [["l3"]] * 2
        assert requests.run(prompt(0))[0].hits == {"l1": 2, "l2": 0, "l3": 2}
    finally:
        requests.close()


def test_warming_never_evicts_pinned_or_in_use_blocks(tmp_path):
    requests = Requests(2 * PROMPT_BLOCKS + 2, three_tiers(tmp_path))
    store = requests.store
    try:
        make_prompt_0_hot(requests)
        pinned = requests.hashes(prompt(20))
        requests.run(prompt(20))
        store.pin(pinned)
        running, _ = requests.start(prompt(21))  # l1: 4 pinned, 5 in use, 1 free
        report = store.warm_frequent(limit_blocks=100)
        assert report.blocks["l1"] == 1 and report.skipped == {"no room in l1": PROMPT_BLOCKS - 1}
        assert all("l1" in requests.tiers_holding(key) for key in pinned + requests.hashes(prompt(21)))
        assert "l1" in requests.tiers_holding(requests.hashes(prompt(0))[0])  # parents first
        assert store.pool.num_free_blocks == 1  # the warmed block: cached, not pinned, so evictable
        requests.finish(running)
    finally:
        requests.close()


def test_warming_rejects_a_negative_limit():
    requests = Requests(2, [])
    with pytest.raises(ValueError, match="limit_blocks must be >= 0, got -1"):
        requests.store.warm_frequent(-1)
    assert requests.store.warm_frequent(10).blocks == {"l1": 0}  # nothing below l1: nothing to warm


# ---------------------------------------------------------------------------
# across a restart
# ---------------------------------------------------------------------------


def test_after_a_restart_warming_brings_back_what_was_hot_before(tmp_path):
    first = Requests(PROMPT_BLOCKS + 1, three_tiers(tmp_path, persistent=True))
    cold = make_prompt_0_hot(first)  # two uses, served from disk
    for _ in range(4):  # three uses of prompt 1, all in l1: they reach disk when the store closes
        first.run(prompt(1))
    first.run(prompt(2))  # never reused
    first.close()

    again = Requests(2 * PROMPT_BLOCKS + 1, three_tiers(tmp_path, persistent=True))
    store = again.store
    try:
        hot, hotter = again.hashes(prompt(0)), again.hashes(prompt(1))
        assert store.snapshot().tiers["l1"].entries == 0
        assert store.frequent_prefixes(5) == [hotter, hot]

        report = store.warm_frequent(limit_blocks=PROMPT_BLOCKS)
        assert report.prefixes == 1 and report.blocks["l1"] == PROMPT_BLOCKS
        assert all("l1" in again.tiers_holding(key) for key in hotter)
        assert not any("l1" in again.tiers_holding(key) for key in hot)

        match, served = again.run(prompt(1))
        assert match.hits == {"l1": PROMPT_BLOCKS, "l2": 0, "l3": 0}
        _, computed = Requests(PROMPT_BLOCKS + 1, []).run(prompt(1))
        assert torch.equal(served, computed)

        assert store.warm_frequent(limit_blocks=100).blocks["l1"] == PROMPT_BLOCKS  # prompt 0 next
        match, served = again.run(prompt(0))
        assert match.hits == {"l1": PROMPT_BLOCKS, "l2": 0, "l3": 0} and torch.equal(served, cold)
    finally:
        again.close()
