"""The no-server reference: Hugging Face ``generate()`` in this process, on the same checkpoint and token ids."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class HFGenerate:
    """Greedy ``generate()`` with eos ignored (``min_new_tokens = max_new_tokens``), stock PyTorch kernels."""

    name = "hf-generate"

    def __init__(self, checkpoint: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def generate(self, batch: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Prompt ids ``[batch, len]`` (no padding) followed by exactly ``new_tokens`` greedy tokens."""
        with torch.inference_mode():
            return self.model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=self.pad_id,
            )

    def encode(self, prompts: list[str]) -> torch.Tensor:
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        if len({len(i) for i in ids}) != 1:
            raise ValueError("the static batch reference needs prompts of one token length (no padding)")
        return torch.tensor(ids)

    def static_batch(self, prompts: list[str], new_tokens: int) -> dict:
        """All prompts as one batch: output tokens/s, and the batch's time to first token (a 1-token generate)."""
        batch = self.encode(prompts)
        start = time.perf_counter()
        self.generate(batch, 1)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = self.generate(batch, new_tokens)
        wall = time.perf_counter() - start
        produced = out[:, batch.shape[1] :].numel()
        return {
            "requests": len(prompts),
            "errors": 0,
            "output_tokens": produced,
            "prompt_tokens": batch.numel(),
            "wall_s": wall,
            "output_tok_s": produced / wall,
            "ttft_p50_s": ttft,
            "ttft_p99_s": ttft,
            "tpot_p50_s": (wall - ttft) / max(new_tokens - 1, 1),
            "tpot_p99_s": (wall - ttft) / max(new_tokens - 1, 1),
        }

    def warm_up(self) -> None:
        self.generate(torch.tensor([[5, 6, 7, 8]]), 4)
