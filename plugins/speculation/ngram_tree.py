"""``ngram_tree``: prompt lookup as a token tree. Every earlier occurrence of the sequence's last n tokens
(n from ``max_n`` down to ``min_n``, ``[plugins.ngram_tree]``), the most recent first, contributes what
followed it; the continuations merge into a trie, and the nodes most occurrences agree on (longer matches
weigh more) are proposed, up to the step's node budget, for one verification of all of them at once."""

from __future__ import annotations

import heapq
from array import array

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tierserve.core.hookspecs import hookimpl
from tierserve.core.speculation import Proposal, Speculator
from tierserve.core.token_tree import ROOT


class NgramTreeSettings(BaseModel):
    """``[plugins.ngram_tree]``: the n-gram lengths matched, how many earlier matches merge, how deep a tree goes."""

    model_config = ConfigDict(extra="forbid")

    min_n: int = Field(1, ge=1, description="shortest suffix n-gram looked up")
    max_n: int = Field(4, ge=1, description="longest suffix n-gram looked up (its matches weigh most)")
    max_matches: int = Field(8, ge=1, le=256, description="earlier occurrences merged into one tree, most recent first")
    max_depth: int = Field(16, ge=1, le=64, description="the longest path of a tree (tokens after the last real one)")

    @model_validator(mode="after")
    def _ordered(self) -> NgramTreeSettings:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


def continuations(tokens: list[int], min_n: int, max_n: int, max_matches: int, depth: int) -> list[tuple[int, list[int]]]:
    """``(n, up to depth tokens)`` after each earlier occurrence of the last ``n`` tokens, longest ``n`` first,
    then the most recent; an occurrence found for a longer ``n`` is not counted again for a shorter one. A
    continuation that runs into the end of the history goes on with its own output (a loop keeps going)."""
    found: list[tuple[int, list[int]]] = []
    if len(tokens) < 2:
        return found
    packed = array("i", tokens).tobytes()  # searched in C: 4 bytes per token
    starts: set[int] = set()
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = packed[-4 * n :]
        end = len(packed) - 4  # an earlier match ends at least one token before the end
        while len(found) < max_matches:
            at = packed.rfind(pattern, 0, end)
            if at < 0:
                break
            end = at + 4 * n - 1  # look further left (a match across token boundaries is skipped the same way)
            if at % 4:
                continue
            start = at // 4 + n
            if start in starts:
                continue
            starts.add(start)
            following = tokens[start : start + depth]
            while len(following) < depth:  # the match is recent: continue the copy with its own output
                following.append(following[len(following) - (len(tokens) - start)])
            found.append((n, following))
        if len(found) >= max_matches:
            break
    return found


def build_tree(found: list[tuple[int, list[int]]], budget: int) -> Proposal:
    """The ``budget`` best nodes of the trie of ``found``: each node scores the summed ``n`` of the continuations
    through it (an estimate of how likely the output reaches it), so a parent always scores at least as high
    as its child and is taken first."""
    children: list[dict[int, int]] = [{}]  # trie: node id -> {token: child id}; id 0 is the root
    score: list[int] = [0]
    token_of: list[int] = [-1]
    for n, following in found:
        node = 0
        for token in following:
            child = children[node].get(token)
            if child is None:
                child = len(children)
                children[node][token] = child
                children.append({})
                score.append(0)
                token_of.append(token)
            score[child] += n
            node = child
    tokens: list[int] = []
    parents: list[int] = []
    index_of = {0: ROOT}
    # ties: the shallower node (a guess further ahead is less sure), then the earlier-made (a more recent match)
    frontier = [(-score[c], 1, c, 0) for c in children[0].values()]
    heapq.heapify(frontier)
    while frontier and len(tokens) < budget:
        _, depth, node, parent = heapq.heappop(frontier)
        index_of[node] = len(tokens)
        tokens.append(token_of[node])
        parents.append(index_of[parent])
        for child in children[node].values():
            heapq.heappush(frontier, (-score[child], depth + 1, child, node))
    return Proposal(tokens, parents=parents)


class NgramTreeSpeculator(Speculator):
    """Deterministic token trees from the sequence's own history; no extra model, no extra memory."""

    proposes_trees = True

    def __init__(self, settings, target) -> None:
        super().__init__(settings, target)
        self.options = settings.plugin_options("ngram_tree", NgramTreeSettings)

    def propose(self, requests):
        o = self.options
        proposals = []
        for r in requests:
            found = continuations(r.token_ids, o.min_n, o.max_n, o.max_matches, min(o.max_depth, r.max_depth))
            proposals.append(build_tree(found, r.num_tokens) if found else Proposal([]))
        return proposals


@hookimpl
def register_speculators(register):
    register(
        "ngram_tree",
        NgramTreeSpeculator,
        settings=NgramTreeSettings,
        description="prompt lookup as a token tree: what followed every earlier match of the last n tokens",
    )
