"""Writing a tiny test checkpoint as a GGUF file with the ``gguf`` package's writer (no llama.cpp checkout needed).

It writes what llama.cpp's ``convert_hf_to_gguf.py`` writes for a Llama/Qwen
checkpoint with a byte-level BPE tokenizer: the same metadata keys, the
tokenizer as ``gpt2`` tokens/merges with a ``qwen2`` pre-tokenizer, the
converter's q/k row permutation for llama (``LlamaModel.permute``), the
tensor names of gguf's own name map, 1-D tensors in F32 and matrices in the
requested type, quantized by the gguf package (llama.cpp's reference quantizer).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

OUTTYPES = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16,
            "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
            "q4_1": gguf.GGMLQuantizationType.Q4_1, "q4_k": gguf.GGMLQuantizationType.Q4_K,
            "q4_k_m": gguf.GGMLQuantizationType.Q4_K, "q5_0": gguf.GGMLQuantizationType.Q5_0,
            "q5_1": gguf.GGMLQuantizationType.Q5_1}  # fmt: skip
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
              "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S,
              "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
              "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1}  # fmt: skip
# llama-quantize's Q4_K_M keeps these in Q6_K (the rest Q4_K): v and down (in most layers) and the output head
Q6_K_TENSORS = ("attn_v", "ffn_down", "output")


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half row order to GGML's interleaved one."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _tokenizer(writer: gguf.GGUFWriter, checkpoint: Path, config: dict) -> None:
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    special = {token["id"]: token for token in data["added_tokens"]}
    vocab = {**data["model"]["vocab"], **{t["content"]: i for i, t in special.items()}}
    by_id = {i: text for text, i in vocab.items()}
    size = config["vocab_size"]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    kinds = [
        gguf.TokenType.CONTROL if i in special and special[i]["special"]
        else gguf.TokenType.USER_DEFINED if i in special or i not in by_id
        else gguf.TokenType.NORMAL
        for i in range(size)
    ]  # fmt: skip
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    template = checkpoint / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def random_q4_k(rows: int, columns: int, seed: int, width: int = 144) -> np.ndarray:
    """uint8 ``[rows, columns / 256, width]`` Q4_K super-blocks (``width`` 176: Q5_K's, with fifth bits): small
    float16 d and dmin, random 6-bit scales and minimums and nibbles (what a file's bytes may hold; every loader
    must read them as llama.cpp does)."""
    rng = np.random.default_rng(seed)
    sb = rng.integers(0, 256, (rows, columns // 256, width), dtype=np.uint8)
    for at in (0, 2):
        halves = (rng.random((rows, columns // 256, 1)) * 0.002).astype(np.float16)
        sb[..., at : at + 2] = halves.view(np.uint8).reshape(rows, columns // 256, 2)
    return sb


def random_q5_k(rows: int, columns: int, seed: int) -> np.ndarray:
    """uint8 ``[rows, columns / 256, 176]`` Q5_K super-blocks, as ``random_q4_k``'s."""
    return random_q4_k(rows, columns, seed, width=176)


def random_q6_k(rows: int, columns: int, seed: int) -> np.ndarray:
    """uint8 ``[rows, columns / 256, 210]`` Q6_K super-blocks: random nibbles, high bit pairs and int8 scales
    (-128 included), a small float16 d."""
    rng = np.random.default_rng(seed)
    sb = rng.integers(0, 256, (rows, columns // 256, 210), dtype=np.uint8)
    d = (rng.random((rows, columns // 256, 1)) * 0.00004).astype(np.float16)  # |w| up to ~0.16, as trained
    sb[..., 208:210] = d.view(np.uint8).reshape(rows, columns // 256, 2)
    return sb


def write_gguf(checkpoint: Path, target: Path, outtype: str) -> Path:
    """``checkpoint`` (a llama, qwen2 or qwen3 directory) as a GGUF file at ``target`` in ``outtype`` (f32, bf16, q8_0,
    q4_0, q4_1, q5_0, q5_1; q4_k: random super-blocks, for widths that are multiples of 256; q4_k_m: the same with random
    Q6_K super-blocks for ``Q6_K_TENSORS``, as llama-quantize mixes them)."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = config["model_type"]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(target, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(checkpoint.name)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(FILE_TYPES[outtype])
    if arch == "llama":  # as the converter: qwen's files carry neither
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer(writer, checkpoint, config)

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    qtype = OUTTYPES[outtype]
    for hf_name, tensor in load_file(checkpoint / "model.safetensors").items():
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            continue
        data = tensor.to(torch.float32).numpy()
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            data = _permute(data, heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            data = _permute(data, kv_heads)
        kind = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.Q4_K:  # the gguf package has no K quantizer: seeded random blocks
            seed = zlib.crc32(f"{name}.{suffix}".encode())
            if outtype == "q4_k_m" and name.rsplit(".", 1)[-1] in Q6_K_TENSORS:
                stored = random_q6_k(data.shape[0], data.shape[1], seed=seed)
                writer.add_tensor(f"{name}.{suffix}", stored.reshape(data.shape[0], -1),
                                  raw_dtype=gguf.GGMLQuantizationType.Q6_K)  # fmt: skip
                continue
            stored = random_q4_k(data.shape[0], data.shape[1], seed=seed)
            writer.add_tensor(f"{name}.{suffix}", stored.reshape(data.shape[0], -1), raw_dtype=kind)
            continue
        stored = gguf.quants.quantize(data, kind) if kind != gguf.GGMLQuantizationType.F32 else data
        writer.add_tensor(f"{name}.{suffix}", stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
