"""Random PEFT LoRA adapters for the tiny test checkpoints, saved the way PEFT saves them."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(checkpoint: Path, out: Path, seed: int, targets: list[str], rank: int, alpha: int, **config) -> Path:
    """A PEFT adapter with random (not zero) A and B matrices."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config)
    get_peft_model(base, lora).save_pretrained(out)
    return out
