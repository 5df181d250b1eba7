"""LoRA adapters on the native backend: PEFT checkpoints read into fixed slots, applied per request in a shared batch.

An adapter is a PEFT ``LORA`` checkpoint (``adapter_config.json`` and
``adapter_model.safetensors``). Each of ``max_loras`` slots holds one adapter's
A and B matrices for every layer, zero-padded to ``max_lora_rank``. The fused
projections (q/k/v, gate/up) hold their parts side by side: A stacks the parts'
A rows, B is block diagonal, so one pair of matmuls serves the fused output and
the zero padding adds exact zeros.

A step that mixes adapters groups its rows by slot and runs one pair of small
matmuls per slot present (punica's segmented gather-matmul), added to the base
projection's output: no weights are ever merged, so requests with different
adapters, and with none, decode in the same batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tierserve.core.errors import RequestError

if TYPE_CHECKING:
    from collections.abc import Sequence as Seq

    from tierserve.core.batch import ScheduledChunk

# PEFT module name -> (our fused projection, the part of it)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter read from disk: ``weights[(layer, module)] = (A [r, in], B [out, r])``."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str  # hash of the adapter's files: part of its requests' cache keys

    @property
    def modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})


def _fail(message: str) -> RequestError:
    return RequestError(message, param="lora_path")


def read_adapter(name: str, path: str | Path, *, max_rank: int, num_layers: int) -> LoraAdapter:
    """Read and check a PEFT LoRA checkpoint directory.

    Raises:
        RequestError (param ``lora_path``): a missing or unreadable file, a rank over ``max_rank``,
            or a PEFT feature the slots cannot hold (DoRA, trained biases, ``modules_to_save``,
            per-module rank or alpha patterns, embedding or unknown target modules).
    """
    from safetensors.torch import load_file

    directory = Path(path).expanduser()
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise _fail(f"lora_path: {str(directory)!r} holds no adapter_config.json (a PEFT LoRA adapter directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise _fail(f"lora_path: {config_file} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _fail(f"lora_path: {config_file} holds a JSON {type(config).__name__}, not an object of PEFT settings")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise _fail(f"lora_path: peft_type {config.get('peft_type')!r} is not supported; only LORA adapters are")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    found = [key for key, bad in unsupported.items() if bad]
    if found:
        raise _fail(f"lora_path: adapter_config.json sets {', '.join(found)}, which tierserve's LoRA slots do not support")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise _fail(f"lora_path: adapter_config.json's r must be a positive integer (the LoRA rank); got {rank!r}")
    if rank > max_rank:
        raise _fail(f"lora_path: the adapter's rank r = {rank} is above model.max_lora_rank ({max_rank})")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _fail(f"lora_path: adapter_config.json's lora_alpha must be a finite number; got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weight_file = next((directory / f for f in _WEIGHT_FILES if (directory / f).is_file()), None)
    if weight_file is None or weight_file.suffix != ".safetensors":
        raise _fail(f"lora_path: {str(directory)!r} holds no adapter_model.safetensors")
    try:
        tensors = load_file(str(weight_file))
    except Exception as exc:  # safetensors raises its own types for truncated or foreign files
        raise _fail(f"lora_path: {weight_file} is not a readable safetensors file: {exc}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGETS:
            raise _fail(
                f"lora_path: weight {key!r} is not a LoRA matrix of a supported module "
                f"({', '.join(TARGETS)})"
            )
        layer = int(match.group(1))
        if layer >= num_layers:
            raise _fail(f"lora_path: weight {key!r} names layer {layer}; the model has {num_layers}")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise _fail(f"lora_path: weight {key!r} is a {tensor.dim()}-D {tensor.dtype} tensor; LoRA A and B are "
                        "2-D float matrices")  # fmt: skip
        if not torch.isfinite(tensor).all():
            raise _fail(f"lora_path: weight {key!r} holds NaN or infinite values")
        parts.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor.float()
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for where, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise _fail(f"lora_path: layer {where[0]} {where[1]} has lora_{''.join(pair)} only; both A and B are needed")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise _fail(f"lora_path: layer {where[0]} {where[1]} has shapes {tuple(a.shape)}/{tuple(b.shape)}, not rank {rank}")
        weights[where] = (a, b)
    if not weights:
        raise _fail(f"lora_path: {weight_file} holds no LoRA weights")
    digest = hashlib.sha256(config_file.read_bytes())
    digest.update(weight_file.read_bytes())
    return LoraAdapter(name, str(directory), rank, scaling, weights, digest.hexdigest()[:16])


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """Which rows of a step's flat token batch use which slot: ``(slot, rows)`` per slot present."""

    segments: list[tuple[int, slice | torch.Tensor]]


class LoraSlots:
    """``max_loras`` adapter slots over a model's layers, and the per-step application.

    Args:
        layer_shapes: per projection, its input size and the output sizes of its parts
            (``{"qkv": (hidden, [q, kv, kv]), ...}``).
        num_layers: decoder layers.
        max_loras: slots (adapters resident at once).
        max_rank: the rank every slot is padded to.
    """

    def __init__(
        self,
        layer_shapes: dict[str, tuple[int, list[int]]],
        num_layers: int,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        self.shapes = layer_shapes
        # a[proj][layer]: [slots, parts*R, in]; b[proj][layer]: [slots, out, parts*R]
        self.a: dict[str, list[torch.Tensor]] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        for proj, (size_in, outs) in layer_shapes.items():
            width = len(outs) * max_rank
            self.a[proj] = [torch.zeros(max_loras, width, size_in, device=device, dtype=dtype) for _ in range(num_layers)]
            self.b[proj] = [torch.zeros(max_loras, sum(outs), width, device=device, dtype=dtype) for _ in range(num_layers)]
        self.scaling = [0.0] * max_loras
        self.used: list[set[str]] = [set() for _ in range(max_loras)]  # per slot, the projections it touches
        self.slot_of: dict[str, int] = {}
        self.adapters: dict[str, LoraAdapter] = {}

    def add(self, adapter: LoraAdapter) -> int:
        """Copy an adapter into a free slot; ``RequestError`` when every slot is taken or shapes differ."""
        if adapter.name in self.slot_of:
            raise RequestError(f"lora_name: an adapter named {adapter.name!r} is already loaded", param="lora_name")
        free = [s for s in range(self.max_loras) if s not in self.slot_of.values()]
        if not free:
            raise RequestError(
                f"lora_name: all {self.max_loras} adapter slots are in use (model.max_loras); unload one first "
                f"(loaded: {', '.join(sorted(self.slot_of))})",
                param="lora_name",
            )
        slot = free[0]
        self._clear(slot)
        r, R = adapter.rank, self.max_rank
        for (layer, module), (a, b) in adapter.weights.items():
            proj, part = TARGETS[module]
            size_in, outs = self.shapes[proj]
            offset = sum(outs[:part])
            if tuple(a.shape) != (r, size_in) or tuple(b.shape) != (outs[part], r):
                self._clear(slot)
                raise _fail(
                    f"lora_path: layer {layer} {module} has shapes {tuple(a.shape)}/{tuple(b.shape)}; this model "
                    f"needs ({r}, {size_in})/({outs[part]}, {r}) (an adapter for another base model?)"
                )
            self.a[proj][layer][slot, part * R : part * R + r] = a.to(self.dtype)
            self.b[proj][layer][slot, offset : offset + outs[part], part * R : part * R + r] = b.to(self.dtype)
            self.used[slot].add(proj)
        self.scaling[slot] = adapter.scaling
        self.slot_of[adapter.name] = slot
        self.adapters[adapter.name] = adapter
        return slot

    def remove(self, name: str) -> None:
        slot = self.slot_of.pop(name)
        self.adapters.pop(name)
        self._clear(slot)

    def _clear(self, slot: int) -> None:
        for proj in self.used[slot]:
            for tensor in self.a[proj] + self.b[proj]:
                tensor[slot].zero_()
        self.used[slot] = set()
        self.scaling[slot] = 0.0

    def batch(self, ordered: Seq[ScheduledChunk]) -> LoraBatch | None:
        """The segments of a step whose chunks (in row order) name adapters; None when none does."""
        rows: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for chunk in ordered:
            name = chunk.seq.lora_name
            if name is not None:
                rows.setdefault(self.slot_of[name], []).append((row, row + chunk.num_tokens))
            row += chunk.num_tokens
        if not rows:
            return None
        segments: list[tuple[int, slice | torch.Tensor]] = []
        device = self.device
        for slot, ranges in rows.items():
            if all(end == start for (_, end), (start, _) in zip(ranges, ranges[1:])):
                segments.append((slot, slice(ranges[0][0], ranges[-1][1])))
            else:
                index = torch.cat([torch.arange(start, end) for start, end in ranges]).to(device)
                segments.append((slot, index))
        return LoraBatch(segments)

    def apply(self, lora: LoraBatch, proj: str, layer: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus every segment's ``B(A x) * scaling`` for projection ``proj`` of ``layer``."""
        a_all, b_all = self.a[proj][layer], self.b[proj][layer]
        for slot, rows in lora.segments:
            if proj not in self.used[slot]:
                continue
            delta = (x[rows] @ a_all[slot].T) @ b_all[slot].T * self.scaling[slot]
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out
