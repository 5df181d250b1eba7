"""Token trees for tree speculation: their layout, each node's depth and ancestors, and their verification.

A tree proposal holds ``n`` draft tokens and one parent per node: ``-1`` is
the root (the sequence's last real token, whose next token the step samples
anyway), any other value the index of an earlier node, so every prefix of
the node list is a tree too (a scheduler that can verify only ``k`` nodes
keeps the first ``k``). Siblings hold distinct tokens.

One forward verifies the whole tree: node ``i`` is stored in the KV slot
after the real tokens at offset ``i``, but is positioned (RoPE) at its depth
and attends to the context and its own ancestors only. Verification walks
from the root: at each node the target's token (greedy) or a multi-candidate
draw (sampled, below) picks the child to follow; the first node with no
matching child ends the walk, and the target's own token there is emitted.
So one step emits the accepted path plus one token, as linear speculation
does, and the KV of the path is then moved to consecutive slots.

Sampled verification (SpecInfer, Miao et al. 2024; multi-candidate
speculative sampling with point-mass proposals): at a node with children
``c1..cm`` and the target's filtered distribution ``p``, child ``cj`` is
accepted with probability ``p(cj)``; on rejection its token's mass is
removed and ``p`` renormalised before the next child; if every child is
rejected, the emitted token is drawn from what is left. The emitted token's
distribution is exactly ``p``: the same rule as sampling from ``p`` without
the candidates until one is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tierserve.core.sampler import SamplingRow

ROOT = -1


def check_tree(tokens: Seq[int], parents: Seq[int]) -> None:
    """Raise ``ValueError`` unless ``parents`` lays out a tree over ``tokens`` (parents first, siblings distinct)."""
    if len(tokens) != len(parents):
        raise ValueError(f"a tree needs one parent per token: {len(tokens)} tokens, {len(parents)} parents")
    seen: set[tuple[int, int]] = set()
    for index, (token, parent) in enumerate(zip(tokens, parents)):
        if not ROOT <= parent < index:
            raise ValueError(f"node {index}: parent {parent} must be -1 (the root) or an earlier node")
        if (parent, token) in seen:
            raise ValueError(f"node {index}: token {token} repeats a sibling's")
        seen.add((parent, token))


def tree_depths(parents: Seq[int]) -> list[int]:
    """Each node's depth: 1 for the root's children."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    return depths


def tree_children(parents: Seq[int]) -> list[list[int]]:
    """``children[i + 1]``: the nodes whose parent is ``i`` (``children[0]``: the root's), in node order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for index, parent in enumerate(parents):
        children[parent + 1].append(index)
    return children


def tree_visibility(parents: Seq[int]) -> torch.Tensor:
    """Bool ``[n, n]``: ``[i, j]`` is True where node ``j`` is node ``i`` or one of its ancestors."""
    import torch

    n = len(parents)
    visible = torch.eye(n, dtype=torch.bool)
    for index, parent in enumerate(parents):
        if parent != ROOT:
            visible[index] |= visible[parent]
    return visible


def within_depth(tokens: Seq[int], parents: Seq[int], max_depth: int) -> tuple[list[int], list[int]]:
    """The tree without its nodes deeper than ``max_depth`` (parents renumbered)."""
    depths = tree_depths(parents)
    kept: dict[int, int] = {ROOT: ROOT}
    for index, depth in enumerate(depths):
        if depth <= max_depth:
            kept[index] = len(kept) - 1
    return [tokens[i] for i in kept if i != ROOT], [kept[parents[i]] for i in kept if i != ROOT]


def path_to(node: int, parents: Seq[int]) -> list[int]:
    """The nodes from the root's child down to ``node`` (empty for the root)."""
    path: list[int] = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def verify_tree(
    logits: torch.Tensor,
    tokens: Seq[int],
    parents: Seq[int],
    rows: Seq[SamplingRow],
    greedy: bool,
) -> tuple[list[int], list[int]]:
    """Walk the tree against the target; returns the tokens to emit and the accepted nodes, root side first.

    Args:
        logits: ``[n + 1, vocab]``: the target's logits at the root (row 0) and at each node (row ``i + 1``).
        tokens: the nodes' tokens.
        parents: the nodes' parents (``-1``: the root).
        rows: per logits row, the sampling parameters, generator and banned tokens at that row's depth.
        greedy: whether the request decodes greedily.
    """
    import torch

    from tierserve.core.sampler import adjust_logits, adjusts, draw, filtered_probs

    children = tree_children(parents)
    if any(adjusts(r) for r in rows):
        logits = logits.to(torch.float32, copy=True)
        adjust_logits(logits, rows)
    path: list[int] = []
    node = ROOT
    if greedy:
        targets = logits.argmax(dim=-1).tolist()
        while True:
            target = targets[node + 1]
            following = next((c for c in children[node + 1] if tokens[c] == target), None)
            if following is None:
                return [tokens[i] for i in path] + [target], path
            path.append(following)
            node = following

    probs = filtered_probs(logits.to(torch.float32), rows)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    generator = rows[0].generator
    while True:
        target = probs[node + 1]
        p = target.clone()
        following = None
        for child in children[node + 1]:
            token = tokens[child]
            uniform = float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device))
            if uniform < float(p[token]):
                following = child
                break
            p[token] = 0.0
            left = float(p.sum())
            if left <= 0.0:  # rounding left nothing: p was (numerically) all on rejected candidates
                p = target
                break
            p /= left
        if following is None:
            emitted = int(draw(p[None], [rows[node + 1]])[0])
            return [tokens[i] for i in path] + [emitted], path
        path.append(following)
        node = following
