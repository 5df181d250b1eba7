"""``medusa``: Medusa heads (Cai et al. 2024) on the target's last hidden state propose a token tree.

Head ``i`` reads the final hidden state (after the last norm) at the position
whose next token the step just sampled and guesses the token ``i + 1``
positions after that one: ``x + SiLU(W x + b)`` per residual block, then a
projection to the vocabulary. The tree's shape is a list of paths of top-k
ranks (Medusa's ``medusa_choices``): ``[1, 0]`` is head 0's second guess
followed by head 1's first. Verification keeps the output exactly the
target's, whatever the heads predict; good heads only make it faster.

The heads load from the Medusa project's files: a directory (or the file
itself) with ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``, whose
state dict holds ``{head}.{block}.linear.weight`` / ``.bias`` per residual
block and ``{head}.{blocks}.weight`` for the projection, and optionally a
``config.json`` with ``medusa_num_heads`` and ``medusa_num_layers``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tierserve.core.errors import ConfigError
from tierserve.core.hookspecs import hookimpl
from tierserve.core.speculation import Proposal, Speculator
from tierserve.core.token_tree import ROOT

# torch loads when the speculator is built, so listing plugins or serving HTTP never pays for it.
if TYPE_CHECKING:
    import torch

HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
# Medusa's small default trees: the top guesses of the first heads first, then their best continuations
DEFAULT_CHOICES = [
    [0], [1], [2], [0, 0], [3], [0, 1], [1, 0], [0, 0, 0], [0, 2], [2, 0], [1, 1], [0, 0, 1], [0, 1, 0],
    [0, 0, 0, 0], [4], [3, 0], [0, 3], [1, 0, 0], [0, 0, 2], [0, 0, 0, 1], [0, 0, 0, 0, 0],
]


class MedusaSettings(BaseModel):
    """``[plugins.medusa]``: where the heads are and the tree they propose."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="a Medusa checkpoint: directory with medusa_lm_head.safetensors|.pt, or the file")
    choices: list[list[int]] = Field(
        default_factory=lambda: [list(c) for c in DEFAULT_CHOICES],
        description="the tree: paths of top-k ranks, one per head, in priority order, each after its parent path "
        "(the step's node budget keeps the first ones); the default tree is cut to the heads the file has",
    )

    @field_validator("choices")
    @classmethod
    def _parents_first(cls, choices: list[list[int]]) -> list[list[int]]:
        seen: set[tuple[int, ...]] = set()
        for choice in choices:
            path = tuple(choice)
            if not path or min(path) < 0:
                raise ValueError(f"{choice}: a path is one or more top-k ranks (0 = a head's best guess)")
            if path in seen:
                raise ValueError(f"{choice} is listed twice")
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"{choice} comes before its parent path {list(path[:-1])}")
            seen.add(path)
        return choices


def load_heads(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The heads' state dict and config from a Medusa directory or file; ConfigError naming what is wrong."""
    files = [path] if path.is_file() else [path / name for name in HEAD_FILES if (path / name).is_file()]
    if not files:
        raise ConfigError(f"plugins.medusa.path: {path} holds none of {', '.join(HEAD_FILES)}")
    file = files[0]
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            import torch

            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: say which
        raise ConfigError(f"plugins.medusa.path: cannot read Medusa heads from {file}: {error}") from error
    if not state:
        raise ConfigError(f"plugins.medusa.path: {file} holds no tensors; Medusa heads are "
                          "{head}.{block}.linear.weight|bias and {head}.{blocks}.weight")  # fmt: skip
    config_file = file.parent / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return state, config


class MedusaHeads:
    """The heads as tensors on the target's device: per head, its residual blocks and its projection."""

    def __init__(self, state: dict[str, torch.Tensor], config: dict, hidden_size: int, vocab_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        keys = [re.fullmatch(r"(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)", k) for k in state]
        if not all(keys):
            unknown = sorted(k for k, m in zip(state, keys) if m is None)
            raise ConfigError(f"plugins.medusa.path: unexpected tensors {unknown[:3]}; Medusa heads are "
                              "{head}.{block}.linear.weight|bias and {head}.{blocks}.weight")  # fmt: skip
        num_heads = config.get("medusa_num_heads", 1 + max(int(m.group(1)) for m in keys))
        num_layers = config.get("medusa_num_layers", max(int(m.group(2)) for m in keys))

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            tensor = state.get(name)
            if tensor is None or tuple(tensor.shape) != shape:
                found = "missing" if tensor is None else f"shaped {tuple(tensor.shape)}"
                raise ConfigError(f"plugins.medusa.path: {name} is {found}; the target (hidden {hidden_size}, "
                                  f"vocab {vocab_size}) needs {shape}")  # fmt: skip
            return tensor.to(device=device, dtype=dtype)

        self.blocks = [
            [(take(f"{h}.{b}.linear.weight", (hidden_size, hidden_size)), take(f"{h}.{b}.linear.bias", (hidden_size,)))
             for b in range(num_layers)]
            for h in range(num_heads)
        ]  # fmt: skip
        self.projections = [take(f"{h}.{num_layers}.weight", (vocab_size, hidden_size)) for h in range(num_heads)]

    def __len__(self) -> int:
        return len(self.projections)

    def top(self, hidden: torch.Tensor, ranks: list[int]) -> list[torch.Tensor]:
        """For hidden states ``[batch, hidden]``: head ``i``'s ``ranks[i]`` best tokens per row ``[batch, ranks[i]]``."""
        import torch.nn.functional as F

        out = []
        for head, k in enumerate(ranks):
            x = hidden.to(self.projections[head].dtype)
            for weight, bias in self.blocks[head]:
                x = x + F.silu(F.linear(x, weight, bias))
            out.append(F.linear(x, self.projections[head]).topk(k, dim=-1).indices)
        return out


class MedusaSpeculator(Speculator):
    """Token trees from Medusa heads: one small matmul per head on the hidden state the step already has."""

    proposes_trees = True
    needs_hidden_states = True

    def __init__(self, settings, target) -> None:
        super().__init__(settings, target)
        options = settings.plugin_options("medusa", MedusaSettings)
        if not options.path:
            raise ConfigError("plugins.medusa.path: set it to a Medusa checkpoint when [speculative] method is medusa")
        path = Path(options.path).expanduser()
        if not path.exists():
            raise ConfigError(f"plugins.medusa.path: {path} does not exist")
        hidden_size = getattr(getattr(target, "config", None), "hidden_size", None)
        if hidden_size is None:
            raise ConfigError(f"medusa needs a backend that reports its hidden size, not {type(target).__name__}")
        state, config = load_heads(path)
        self.heads = MedusaHeads(state, config, hidden_size, target.vocab_size, target.device, target.dtype)
        deep = [c for c in options.choices if len(c) > len(self.heads)]
        if deep and "choices" not in options.model_fields_set:  # the default tree, cut to the heads there are
            options = options.model_copy(update={"choices": [c for c in options.choices if c not in deep]})
        elif deep:
            raise ConfigError(f"plugins.medusa.choices: {deep[0]} is {len(deep[0])} deep; {path} has "
                              f"{len(self.heads)} heads, so a path is at most that long")  # fmt: skip
        wide = [c for c in options.choices if max(c) >= target.vocab_size]
        if wide:
            raise ConfigError(f"plugins.medusa.choices: {wide[0]} asks for a guess past the vocabulary "
                              f"({target.vocab_size} tokens); ranks go from 0 to {target.vocab_size - 1}")  # fmt: skip
        self.choices = [tuple(c) for c in options.choices]

    def propose(self, requests):
        if not requests:
            return []
        depth = max(r.max_depth for r in requests)
        used = [c for c in self.choices if len(c) <= depth][: max(r.num_tokens for r in requests)]
        if not used:
            return [Proposal([]) for _ in requests]
        ranks = [0] * max(len(c) for c in used)
        for choice in used:
            for level, rank in enumerate(choice):
                ranks[level] = max(ranks[level], rank + 1)
        import torch

        with torch.inference_mode():
            guesses = [g.tolist() for g in self.heads.top(torch.stack([r.hidden for r in requests]), ranks)]
        proposals = []
        for row, request in enumerate(requests):
            index: dict[tuple[int, ...], int] = {(): ROOT}
            tokens, parents = [], []
            for choice in used:
                if len(tokens) == request.num_tokens:
                    break
                if len(choice) > request.max_depth:
                    continue
                index[choice] = len(tokens)
                tokens.append(guesses[len(choice) - 1][row][choice[-1]])
                parents.append(index[choice[:-1]])
            proposals.append(Proposal(tokens, parents=parents))
        return proposals


@hookimpl
def register_speculators(register):
    register(
        "medusa",
        MedusaSpeculator,
        settings=MedusaSettings,
        description="Medusa heads on the target's hidden state propose a token tree (native backend)",
    )
