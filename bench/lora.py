"""LoRA: output tokens/s of one batch whose requests use 4 different adapters, against the base model alone.

Both engines run in this process on the same checkpoint and the same requests
(``--requests`` random token-id prompts, greedy, eos ignored); the runs
alternate, ``--repeats`` times each, and the ratio of medians is reported.
The adapters are random PEFT-format adapters of ``--rank`` on every
projection (q, k, v, o, gate, up, down), written under the results folder:
what matters here is their cost, not their output.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.harness import BenchContext
from bench.stats import median, ratio

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(checkpoint: Path, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for ``checkpoint``."""
    config = json.loads((checkpoint / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = (config.get("num_key_value_heads") or heads) * head_dim
    shapes = {
        "self_attn.q_proj": (hidden, heads * head_dim), "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden),
    }  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (size_in, size_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, size_in, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(size_out, rank, generator=generator) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                      "bias": "none", "base_model_name_or_path": str(checkpoint)}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out


def run(ctx: BenchContext, requests: int, prompt_len: int, output_len: int, adapters: int, rank: int, repeats: int) -> dict:
    from tierserve.settings.config import load_settings
    from tierserve.engine import EngineClient
    from tierserve.core.sampling_params import SamplingParams

    paths = [write_adapter(ctx.checkpoint, ctx.results_dir / "lora-adapters" / f"a{i}", rank, i) for i in range(adapters)]
    vocab = json.loads((ctx.checkpoint / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    blocks = 2 * requests * -(-(prompt_len + output_len) // 16)

    def engine(max_loras: int) -> EngineClient:
        overrides = {
            ("model", "path"): str(ctx.checkpoint), ("model", "max_loras"): max_loras, ("model", "max_lora_rank"): rank,
            ("model", "lora_adapters"): {f"a{i}": str(p) for i, p in enumerate(paths)} if max_loras else {},
            ("scheduler", "max_num_seqs"): max(64, requests), ("kv_cache", "l1_capacity"): blocks,
            ("kv_cache", "enable_prefix_caching"): False, ("logging", "level"): "warning",
        }  # fmt: skip
        loaded = load_settings("development", environ={}, overrides=overrides)
        return EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)

    systems = {"base": (engine(0), None), "mixed": (engine(adapters), [f"a{i % adapters}" for i in range(requests)])}
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in systems}
    for eng, names in systems.values():  # warm-up
        eng.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), lora_names=names[:2] if names else None)
    for _ in range(repeats):
        for name, (eng, names) in systems.items():
            start = time.perf_counter()
            results = eng.generate(prompts, params, lora_names=names)
            elapsed = time.perf_counter() - start
            assert all(len(r.token_ids) == output_len for r in results)
            rates[name].append(requests * output_len / elapsed)
            print(f"{name}: {rates[name][-1]:.1f} tok/s", flush=True)
    for eng, _ in systems.values():
        eng.close()
    summary = {name: median(values) for name, values in rates.items()}
    return {
        "config": {"requests": requests, "prompt_len": prompt_len, "output_len": output_len, "adapters": adapters,
                   "rank": rank, "repeats": repeats, "modules": list(TARGETS)},  # fmt: skip
        "rates": rates,
        "summary": {**summary, "mixed_over_base": ratio(summary["mixed"], summary["base"])},
    }
