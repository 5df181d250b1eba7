"""Perplexity of a GGUF file as tierserve runs it, next to llama.cpp's ``llama-perplexity`` on the same file.

The text is ``bench/data/public_domain_english.txt`` (the Declaration of Independence, the Gettysburg Address,
Lincoln's Second Inaugural and Article I of the Constitution: public domain, ~5,900 SmolLM2 tokens). Both sides
score it as ``llama-perplexity`` does: the token ids are cut into ``n_ctx``-token chunks (a last partial chunk is
dropped), each chunk is evaluated on its own (its first token replaced by BOS when the vocabulary adds one), and
the negative log-likelihood of every token in the chunk's second half is averaged over all chunks;
PPL = exp(mean NLL).

tierserve runs the file at each precision its native backend loads it in: as stored (``model.quantization =
"gguf"``: Q4_0, Q4_1 and Q8_0 kept, the q4 kernel), float32 and bfloat16 (Q4_1 and Q8_0 dequantized) and int8
(``model.quantization = "int8"``: Q8_0 kept, the rest re-quantized in groups of 32).
llama.cpp runs the same weights in the same precision class: the file as stored (4-bit), and the file converted
by its own ``llama-quantize --allow-requantize`` to F32, BF16 and Q8_0.
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent / "data" / "public_domain_english.txt"
N_CTX = 512
# tierserve's precision -> (the load keywords, llama.cpp's file type in the same precision class)
PRECISIONS: dict[str, tuple[dict, str]] = {
    "float32": ({"dtype": torch.float32, "quantization": "none"}, "F32"),
    "bfloat16": ({"dtype": torch.bfloat16, "quantization": "none"}, "BF16"),
    "int8": ({"dtype": torch.float32, "quantization": "int8"}, "Q8_0"),
}


def chunks(ids: list[int], n_ctx: int, bos: int | None) -> list[list[int]]:
    """``llama-perplexity``'s chunks: whole ``n_ctx`` windows, the first token of each replaced by BOS if any."""
    out = []
    for start in range(0, len(ids) // n_ctx * n_ctx, n_ctx):
        window = ids[start : start + n_ctx]
        if bos is not None:
            window = [bos, *window[1:]]
        out.append(window)
    return out


def load_native(path: Path, dtype: torch.dtype, quantization: str):
    """The native backend's model for the GGUF file ``path`` on the CPU, as ``serve`` builds it."""
    from tierserve.models.checkpoints import load_config
    from tierserve.plugins.backends.gguf_weights import load_gguf_state
    from tierserve.plugins.backends.llama import PagedLlama

    config = load_config(path)
    state = load_gguf_state(path, config, dtype, quantization)
    return PagedLlama(config, state, torch.device("cpu"), dtype, "auto", quantization)


def nll_of_chunks(model, windows: list[list[int]]) -> list[float]:
    """Negative log-likelihoods of the second half of each window, each predicted from the tokens before it."""
    first = N_CTX // 2
    out: list[float] = []
    with torch.inference_mode():
        for window in windows:
            [hidden] = model.final_hidden_states([torch.tensor(window)])
            logits = model.lm_head(hidden[first : len(window) - 1]).float()
            targets = torch.tensor(window[first + 1 :])
            out.extend((-logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]).tolist())
    return out


def ppl(nll: list[float]) -> tuple[float, float]:
    """PPL and its standard error (delta method, as llama-perplexity reports ``+/-``)."""
    mean = sum(nll) / len(nll)
    var = sum((x - mean) ** 2 for x in nll) / max(1, len(nll) - 1)
    value = math.exp(mean)
    return value, value * math.sqrt(var / len(nll))


def tierserve_perplexity(path: Path, ids: list[int], bos: int | None, options: dict) -> dict:
    started = time.perf_counter()
    model = load_native(path, **options)
    nll = nll_of_chunks(model, chunks(ids, N_CTX, bos))
    value, error = ppl(nll)
    return {"ppl": value, "stderr": error, "scored_tokens": len(nll), "seconds": time.perf_counter() - started}


def llama_tool(name: str) -> Path:
    from bench.llama_cpp import llama_cpp_source, llama_server_binary

    llama_server_binary()  # configures the build the first time
    source = llama_cpp_source()
    binary = source / "build" / "bin" / name
    if not binary.is_file():
        subprocess.run(["cmake", "--build", "build", "--target", name, "-j", "2"], cwd=source, check=True)
    return binary


def requantized(path: Path, file_type: str, peers: Path) -> Path:
    """``path`` converted by llama.cpp's ``llama-quantize --allow-requantize`` to ``file_type`` (once)."""
    target = peers / "gguf" / f"{path.stem}-as-{file_type}.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        command = [str(llama_tool("llama-quantize")), "--allow-requantize", str(path), str(target), file_type]
        subprocess.run(command, check=True, capture_output=True)
    return target


def llama_perplexity(path: Path, threads: int) -> dict:
    command = [str(llama_tool("llama-perplexity")), "-m", str(path), "-f", str(TEXT), "-c", str(N_CTX), "-t",
               str(threads), "-b", str(N_CTX)]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", done.stdout + done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"llama-perplexity failed on {path}:\n{(done.stdout + done.stderr)[-2000:]}")
    chunks_line = re.search(r"calculating perplexity over (\d+) chunks", done.stderr + done.stdout)
    return {
        "ppl": float(found[1]), "stderr": float(found[2]), "seconds": time.perf_counter() - started,
        "chunks": int(chunks_line[1]) if chunks_line else None,
    }  # fmt: skip


def run(ctx, threads: int = 2) -> dict:
    """The perplexity table for ``ctx.checkpoint`` (a GGUF file)."""
    from bench.llama_cpp import PEERS_DIR
    from tierserve.models.gguf import check_gguf
    from tierserve.models.gguf_reader import GGUFFile

    path = ctx.checkpoint
    metadata = GGUFFile(path)
    add_bos = bool(metadata.value("tokenizer.ggml.add_bos_token", False))
    bos = metadata.value("tokenizer.ggml.bos_token_id") if add_bos else None
    metadata.close()
    ids = ctx.tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    info = check_gguf(path)
    rows = []
    stored = llama_perplexity(path, threads)
    native = tierserve_perplexity(path, ids, bos, {"dtype": torch.float32, "quantization": "gguf"})
    rows.append({"precision": f"as stored ({info.quantization}; tierserve: model.quantization = gguf)",
                 "tierserve": native, "llama.cpp": stored})  # fmt: skip
    for name, (options, file_type) in PRECISIONS.items():
        ours = tierserve_perplexity(path, ids, bos, options)
        theirs = llama_perplexity(requantized(path, file_type, PEERS_DIR), threads)
        rows.append({"precision": f"{name} (llama.cpp: {file_type})", "tierserve": ours, "llama.cpp": theirs})
    return {
        "text": TEXT.name, "tokens": len(ids), "n_ctx": N_CTX, "chunks": len(ids) // N_CTX,
        "scored_tokens": (len(ids) // N_CTX) * (N_CTX - 1 - N_CTX // 2), "rows": rows,
    }  # fmt: skip
