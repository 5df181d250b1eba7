"""Tree speculative decoding: token trees verified in one forward, lossless for greedy and sampled decoding."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.engine_helpers import PROMPTS, build_checkpoint, hf_greedy, make_engine
from tests.test_speculation import REPETITIVE, assert_clean, assert_same_distributions
from tests.tree_helpers import LikelyTrees, decoy_engine, tree_engine, write_medusa_heads
from tierserve.core.errors import ConfigError
from tierserve.core.sampler import SamplingRow
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.speculation import Proposal, Speculator
from tierserve.core.token_tree import check_tree, tree_depths, tree_visibility, verify_tree, within_depth
from tierserve.plugins.speculation.ngram_tree import build_tree, continuations

pytestmark = pytest.mark.unit

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
CHECKPOINTS = {
    "llama": ("llama", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}),
    "gpt2": ("gpt2", {}),  # the paged transformers backend: the model's own code, learned absolute positions
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    architecture, overrides = CHECKPOINTS[request.param]
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param, architecture, **overrides)
    prompts = PROMPTS + REPETITIVE
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A llama checkpoint, the prompts, their expected greedy output, and prompt + output as token ids."""
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")
    prompts = PROMPTS + REPETITIVE
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = make_engine(path)
    references = [engine.encode_prompt(p) + e for p, e in zip(prompts, expected)]
    engine.close()
    return path, prompts, expected, references


def test_tree_layout_rules():
    parents = [-1, -1, 0, 2, 1]
    assert tree_depths(parents) == [1, 1, 2, 3, 2]
    visible = tree_visibility(parents)
    assert visible[3].tolist() == [True, False, True, True, False]  # itself and its ancestors 2 and 0
    assert visible[4].tolist() == [False, True, False, False, True]
    check_tree([5, 6, 7, 8, 9], parents)
    with pytest.raises(ValueError, match="parent 3 must be -1"):
        check_tree([5, 6, 7], [-1, 3, 0])
    with pytest.raises(ValueError, match="repeats a sibling"):
        check_tree([5, 5], [-1, -1])
    assert within_depth([5, 6, 7, 8, 9], parents, 2) == ([5, 6, 7, 9], [-1, -1, 0, 1])


def test_greedy_walk_follows_the_matching_child():
    vocab = 10
    tokens, parents = [4, 6, 7, 2], [-1, -1, 1, 1]  # root -> 4 | 6 -> (7 | 2)
    logits = torch.zeros(5, vocab)
    logits[0, 6] = logits[2, 2] = logits[4, 9] = 1.0  # root picks 6, then 6 picks 2, then 2 picks 9
    rows = [SamplingRow(GREEDY, None, [], [])] * 5
    assert verify_tree(logits, tokens, parents, rows, greedy=True) == ([6, 2, 9], [1, 3])
    logits[2, 2], logits[2, 5] = 0.0, 1.0  # 6 now picks 5, which no child holds
    assert verify_tree(logits, tokens, parents, rows, greedy=True) == ([6, 5], [1])


def test_ngram_tree_merges_every_earlier_match():
    history = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 1, 2]
    found = continuations(history, 1, 2, 8, 2)
    assert found[:3] == [(2, [3, 7]), (2, [4, 8]), (2, [3, 9])]  # "1 2": most recent first
    tree = build_tree(found, 16)
    # 3 was seen after "1 2" twice, 4 once: 3 first; each continuation hangs under its first token
    assert tree.token_ids[0] == 3 and tree.parents[0] == -1
    edges = {(tree.token_ids[i], tree.token_ids[p] if p >= 0 else None) for i, p in enumerate(tree.parents)}
    assert edges == {(3, None), (4, None), (7, 3), (9, 3), (8, 4)}
    assert build_tree(found, 3).token_ids == tree.token_ids[:3]  # the budget keeps the best nodes
    assert continuations([5, 6, 7], 1, 2, 8, 3) == []


@pytest.mark.parametrize("method", ["decoy_trees", "ngram_tree", "medusa"])
def test_greedy_output_is_unchanged(checkpoint, method, tmp_path):
    path, prompts, expected = checkpoint
    native = not path.name.startswith("gpt2")
    if method == "medusa" and not native:
        with pytest.raises(ConfigError, match="only the native backend"):
            make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(write_medusa_heads(tmp_path, path))})
        return
    if method == "decoy_trees":
        engine = make_engine(path)
        references = [engine.encode_prompt(p) + e for p, e in zip(prompts, expected)]
        engine.close()
        engine = decoy_engine(path, references, speculative__step_tree_nodes=1024)  # 16 nodes each
    elif method == "medusa":
        heads = write_medusa_heads(tmp_path / "heads", path, heads=3)
        engine = make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(heads)})
    else:
        engine = make_engine(path, speculative__method=method)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    stats = engine.stats().speculation
    assert stats.tree_verifications > 0 and stats.tree_nodes_per_step > 1
    if method == "decoy_trees":
        # the right path sits behind decoys, yet is accepted whole: the mask, positions and KV moves hold
        assert stats.mean_accepted_length > 4 and stats.avg_depth > stats.mean_accepted_length
    assert_clean(engine)
    engine.close()


def test_trees_under_tight_memory_and_a_small_token_budget(llama):
    path, prompts, expected, references = llama
    # preemption, trees cut to what the step's token budget covers, blocks trimmed after each verification
    engine = decoy_engine(
        path, references, kv_cache__block_size=4, kv_cache__l1_capacity=40, scheduler__max_num_batched_tokens=16
    )
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
    assert engine.stats().speculation.accepted > 0
    assert_clean(engine)
    engine.close()


def test_node_budget_shrinks_with_the_batch(llama):
    path, prompts, expected, references = llama
    prompts = prompts[:8]
    budget = {"speculative__max_tree_nodes": 12, "speculative__step_tree_nodes": 24}

    def nodes_per_step(batch: list[str]) -> float:
        engine = decoy_engine(path, references, **budget)
        results = engine.generate(batch, GREEDY)
        assert [r.token_ids for r in results] == [expected[prompts.index(p)] for p in batch]
        per_step = engine.stats().speculation.tree_nodes_per_step
        engine.close()
        return per_step

    alone = nodes_per_step(prompts[:1])
    together = nodes_per_step(prompts)
    assert 8 < alone <= 12  # max_tree_nodes caps one sequence's tree
    assert together <= 24 / 8  # eight sequences share step_tree_nodes


def test_sampling_distribution_is_unchanged(llama):
    from transformers import AutoModelForCausalLM

    path = llama[0]
    prompt = REPETITIVE[1]
    runs = 600
    LikelyTrees.model = AutoModelForCausalLM.from_pretrained(path).eval()

    def second_and_third_tokens(engine) -> tuple[Counter, Counter]:
        # the first token comes from the prompt's forward; the next two are verified against one tree
        params = [SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, seed=s) for s in range(runs)]
        results = engine.generate([prompt] * runs, params)
        return Counter(r.token_ids[1] for r in results), Counter(tuple(r.token_ids[1:3]) for r in results)

    common = {"scheduler__max_num_seqs": 256, "scheduler__max_waiting_requests": 4096}
    plain = make_engine(path, **common)
    tree = tree_engine(path, LikelyTrees, speculative__step_tree_nodes=4096, **common)
    base_second, base_pairs = second_and_third_tokens(plain)
    tree_second, tree_pairs = second_and_third_tokens(tree)
    stats = tree.stats().speculation
    # branches were taken at both depths, and rejected too: every path of the rule ran
    assert stats.tree_nodes_per_step > 3 and 0.1 < stats.mean_accepted_length < 1.9 and stats.avg_depth > 1.5, stats
    assert_same_distributions((base_second, tree_second), (base_pairs, tree_pairs))
    for engine in (plain, tree):
        assert_clean(engine)
        engine.close()


def test_medusa_heads_from_the_lm_head_are_accepted(llama, tmp_path):
    """Heads initialised as Medusa does (zero blocks, the model's own projection) guess the model's next token
    again, which a repeating random model often emits: drafts are accepted, and the .pt format loads."""
    path = llama[0]
    prompts = REPETITIVE
    expected = hf_greedy(path, prompts, 40)
    heads = write_medusa_heads(tmp_path / "heads", path, heads=2, from_lm_head=True, file="medusa_lm_head.pt")
    engine = make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(heads)})
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    stats = engine.stats().speculation
    assert stats.accepted > 0 and stats.mean_accepted_length > 0
    assert_clean(engine)
    engine.close()


def test_medusa_load_errors_name_the_problem(llama, tmp_path):
    path = llama[0]
    with pytest.raises(ConfigError, match="plugins.medusa.path: set it"):
        make_engine(path, speculative__method="medusa")
    with pytest.raises(ConfigError, match="holds none of medusa_lm_head.safetensors"):
        make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(tmp_path)})
    other = build_checkpoint(tmp_path, "wide", "llama", hidden_size=48, intermediate_size=96)
    wrong = write_medusa_heads(tmp_path / "wrong", other)
    with pytest.raises(ConfigError, match=r"0.0.linear.weight is shaped \(48, 48\)"):
        make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(wrong)})
    heads = write_medusa_heads(tmp_path / "two", path, heads=2)
    with pytest.raises(ConfigError, match=r"plugins.medusa.choices: \[0, 0, 0\] is 3 deep"):
        make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(heads), "choices": [[0], [0, 0], [0, 0, 0]]})
    with pytest.raises(ConfigError, match=r"\[0, 5000\] asks for a guess past the vocabulary"):
        make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(heads), "choices": [[0], [0, 5000]]})
    from safetensors.torch import save_file

    save_file({}, str(heads / "medusa_lm_head.safetensors"))
    with pytest.raises(ConfigError, match="holds no tensors"):
        make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(heads)})
    (heads / "medusa_lm_head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="cannot read Medusa heads"):
        make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(heads)})
    with pytest.raises(ConfigError, match="comes before its parent path"):
        make_engine(path, speculative__method="medusa", plugins__medusa={"path": str(heads), "choices": [[0, 1]]})


class BrokenTrees(Speculator):
    """A buggy outside speculator: a node that is its own parent, twin siblings, a token past the vocabulary."""

    proposes_trees = True

    def propose(self, requests):
        bad = [Proposal([5, 6], parents=[-1, 1]), Proposal([5, 5], parents=[-1, -1]), Proposal([10**6], parents=[-1])]
        return [bad[i % len(bad)] for i in range(len(requests))]


def test_a_broken_proposal_costs_only_its_drafts(llama):
    path, prompts, expected, _ = llama
    engine = tree_engine(path, BrokenTrees)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected  # every request served
    assert engine.stats().speculation.verifications == 0
    assert_clean(engine)
    engine.close()


def test_trees_need_a_backend_that_verifies_them(tmp_path):
    path = build_checkpoint(tmp_path, "g", "gpt2")
    with pytest.raises(ConfigError, match="needs a paged backend"):
        make_engine(path, backend="transformers-unpaged", speculative__method="ngram_tree")
