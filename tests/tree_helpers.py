"""Token-tree speculation in tests: Medusa head files as the Medusa project writes them, and an outside
speculator plugin that proposes trees whose right path is deliberately not the first one."""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

from tierserve.settings.config import load_settings
from tierserve.engine import EngineClient
from tierserve.core.hookspecs import hookimpl
from tierserve.core.plugins import load_plugins
from tierserve.core.speculation import Proposal, Speculator
from tierserve.core.token_tree import ROOT


def write_medusa_heads(
    directory: Path, checkpoint: Path, heads: int = 3, layers: int = 1, seed: int = 0,
    from_lm_head: bool = False, file: str = "medusa_lm_head.safetensors",
) -> Path:  # fmt: skip
    """Random Medusa heads for ``checkpoint`` (``{head}.{block}.linear.*``, ``{head}.{blocks}.weight``).

    ``from_lm_head``: each projection is the model's own output matrix and the residual blocks are zero,
    as Medusa initialises them before training: every head then guesses the token the model would
    predict next, which is right whenever the model repeats a token."""
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    hidden, vocab = config.get("hidden_size") or config["n_embd"], config["vocab_size"]
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        output = next(n for n in ("lm_head.weight", "model.embed_tokens.weight", "transformer.wte.weight") if n in names)
        lm_head = weights.get_tensor(output)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for head in range(heads):
        for block in range(layers):
            scale = 0.0 if from_lm_head else 0.02
            state[f"{head}.{block}.linear.weight"] = torch.randn(hidden, hidden, generator=generator) * scale
            state[f"{head}.{block}.linear.bias"] = torch.zeros(hidden)
        state[f"{head}.{layers}.weight"] = lm_head.clone() if from_lm_head else torch.randn(vocab, hidden, generator=generator)
    directory.mkdir(parents=True, exist_ok=True)
    if file.endswith(".pt"):
        torch.save(state, directory / file)
    else:
        save_file(state, str(directory / file))
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers}))
    return directory


def wrong(token: int) -> int:
    """A token other than ``token``."""
    return (token + 1) % 64 + 3


class DecoyTrees(Speculator):
    """Knows each request's right continuation (``references``: prompt + expected output) and proposes a tree
    whose first branch is wrong, with the right path further on and a wrong sibling under each of its nodes:
    a step can only accept deep if the mask hides the decoys, the depths position the nodes and the KV of the
    accepted path moves to consecutive slots."""

    proposes_trees = True
    references: list[list[int]] = []

    def propose(self, requests):
        proposals = []
        for request in requests:
            history = request.token_ids
            reference = next((r for r in self.references if r[: len(history)] == history), None)
            if reference is None:
                proposals.append(Proposal([]))
                continue
            right = reference[len(history) : len(history) + request.max_depth]
            tokens: list[int] = []
            parents: list[int] = []

            def add(token: int, parent: int) -> int:
                tokens.append(token)
                parents.append(parent)
                return len(tokens) - 1

            if right:
                decoy = add(wrong(right[0]), ROOT)  # a wrong first branch, two deep
                if request.max_depth > 1:
                    add(right[0], decoy)
            node = ROOT
            for depth, token in enumerate(right):
                node = add(token, node)
                following = right[depth + 1] if depth + 1 < len(right) else token
                if depth + 2 <= request.max_depth:
                    add(wrong(following), node)  # a wrong child under it, before the right one
            proposals.append(Proposal(tokens[: request.num_tokens], parents=parents[: request.num_tokens]))
        return proposals


def decoy_engine(path: Path, references: list[list[int]], **settings) -> EngineClient:
    """An in-process engine on ``path`` speculating with ``DecoyTrees`` over ``references``."""
    DecoyTrees.references = references
    return tree_engine(path, DecoyTrees, **settings)


class LikelyTrees(Speculator):
    """Proposes the reference model's three likeliest next tokens and, under the likeliest, its two likeliest
    followers: trees that sampling accepts along different branches, or rejects, at each depth."""

    proposes_trees = True
    model = None  # a transformers model of the same checkpoint, set by the test

    def propose(self, requests):
        by_length: dict[int, list[int]] = {}  # histories of one length run as one batch
        for index, request in enumerate(requests):
            by_length.setdefault(len(request.token_ids), []).append(index)
        proposals: list[Proposal] = [Proposal([])] * len(requests)
        for indices in by_length.values():
            histories = torch.tensor([requests[i].token_ids for i in indices])
            with torch.inference_mode():
                top = self.model(histories).logits[:, -1].topk(3).indices
                longer = torch.cat([histories, top[:, :1]], dim=1)
                under = self.model(longer).logits[:, -1].topk(2).indices
            for row, i in enumerate(indices):
                request = requests[i]
                tokens, parents = top[row].tolist() + under[row].tolist(), [ROOT, ROOT, ROOT, 0, 0]
                if request.max_depth < 2:
                    tokens, parents = tokens[:3], parents[:3]
                proposals[i] = Proposal(tokens[: request.num_tokens], parents=parents[: request.num_tokens])
        return proposals


def tree_engine(path: Path, speculator: type[Speculator], **settings) -> EngineClient:
    """An in-process engine on ``path`` speculating with the outside plugin ``speculator``."""
    plugin = types.ModuleType(speculator.__name__)

    @hookimpl
    def register_speculators(register):
        register(speculator.__name__, speculator, description="a test tree speculator")

    plugin.register_speculators = register_speculators
    plugins = load_plugins(allowlist=[])
    plugins.add_plugin(plugin, speculator.__name__, "0", "tests")
    overrides = {("model", "path"): str(path), ("model", "device"): "cpu", ("speculative", "method"): speculator.__name__}
    for dotted, value in settings.items():
        section, key = dotted.split("__")
        overrides[(section, key)] = value
    loaded = load_settings(None, environ={}, overrides=overrides, plugins=plugins)
    return EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
