"""The K types written by tierserve: llama.cpp's reference quantizers (``k_quantize.c``), llama-quantize's choice
of block type per matrix (``models.quant_mix``), ``tierserve quantize --type q4_k_m`` and ``model.quantization =
"q4_k_m"`` on a Hugging Face directory.

``GGML_DIGESTS`` are the digests of what ggml itself writes for ``cases()``: llama.cpp's ``ggml_quantize_chunk``
(built from the source vendored in llama-cpp-python 0.3.36, ``libggml-base``, no importance matrix) run on the same
float32 bytes. On whole models the same code was compared file to file with ``llama-quantize``: SmolLM2-135M's
F32 file and the bench checkpoint's, as Q4_K_M and Q4_0, every tensor's type and bytes equal.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from bench.quality import closeness, teacher_forced_logits
from tests.engine_helpers import PROMPTS, build_checkpoint, make_engine
from tests.gguf_helpers import write_gguf
from tests.test_cpu_gemm import digests_in_build
from tests.test_gguf import dequantized_reference
from tierserve.core.errors import ConfigError
from tierserve.core.sampling_params import SamplingParams
from tierserve.models.checkpoints import load_config
from tierserve.models.quant_mix import Matrix, block_types
from tierserve.plugins.backends import cpu_gemm
from tierserve.plugins.backends.gguf_weights import load_gguf_state
from tierserve.plugins.backends.linear import BlockQ4, BlockQ6K, GroupedInt8
from tierserve.plugins.backends.llama import PagedLlama

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_gemm.library() is None, reason="the K quantizers are in tierserve's kernels")]

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
GGML_DIGESTS = {
    "weights/Q4_K": "c0049e43f27c94f0", "weights/Q5_K": "aaf09a23e3889369", "weights/Q6_K": "05c5839f26cec6aa",
    "outliers/Q4_K": "d37d13802481e723", "outliers/Q5_K": "56f76676034cf5f0", "outliers/Q6_K": "6d9725920153ced0",
    "positive/Q4_K": "aac6a907b3a16ebb", "positive/Q5_K": "50bcf1c1e4dfdcf4", "positive/Q6_K": "967971ccf3604354",
    "zeros/Q4_K": "1a0295f4bf5986c5", "zeros/Q5_K": "2dd23156fbb26642", "zeros/Q6_K": "16d0edc8b7ad7705",
    "constant/Q4_K": "b891a6b6280b625b", "constant/Q5_K": "49ca3628fcecf166", "constant/Q6_K": "59f675462f8bc58d",
    "tiny/Q4_K": "d23b2f2c373eb6c2", "tiny/Q5_K": "6a0dddd33be90848", "tiny/Q6_K": "e3bfc19ad1f27a7b",
    "zero_rows/Q4_K": "12ce9a00bddc0922", "zero_rows/Q5_K": "bc4148c1f3c46f31", "zero_rows/Q6_K": "897da5902550fc30",
}  # fmt: skip


def raw_matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    """Sums of four 24-bit uniforms from PCG64's raw output (fixed by the algorithm, not by numpy's samplers): about
    normal, each value exact in float32."""
    raw = np.random.PCG64(seed).random_raw(rows * cols * 4) >> np.uint64(40)
    return raw.reshape(rows, cols, 4).sum(-1).astype(np.float64) / 2**24 - 2.0


def cases() -> dict[str, np.ndarray]:
    """Weights as trained, outliers (1 in ~12 values 50x), all positive, all zero, constant, tiny, zero rows."""
    spikes = raw_matrix(32, 512, 2)
    return {
        "weights": (raw_matrix(64, 1024, 1) * 0.02).astype(np.float32),
        "outliers": np.where(np.abs(raw_matrix(32, 512, 3)) > 1.5, spikes * 50, spikes).astype(np.float32),
        "positive": (np.abs(raw_matrix(16, 768, 4)) + 0.5).astype(np.float32),
        "zeros": np.zeros((4, 256), np.float32),
        "constant": np.full((4, 256), -0.25, np.float32),
        "tiny": (raw_matrix(8, 256, 5) * 1e-6).astype(np.float32),
        "zero_rows": np.concatenate([np.zeros((2, 256)), raw_matrix(2, 256, 6)]).astype(np.float32),
    }


def quantizer_digests() -> dict[str, str]:
    kernels = cpu_gemm.library()
    return {
        f"{name}/{kind}": hashlib.sha256(kernels.quantize_k(kind, torch.from_numpy(x)).numpy().tobytes()).hexdigest()[:16]
        for name, x in cases().items()
        for kind in K_TYPES
    }


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_each_build_writes_the_bytes_ggml_writes(isa):
    """Every case in every K type: the bytes of llama.cpp's reference quantizer, in both builds (the build this
    process does not run is loaded in a subprocess)."""
    found = digests_in_build(isa, quantizer_digests)
    assert found == GGML_DIGESTS


@pytest.mark.parametrize("kind", K_TYPES)
def test_blocks_read_back_as_the_weights_within_a_step(kind):
    """What the quantizer writes is what gguf's reference dequantizer and tierserve's loader both read: the same
    floats, each within about one quantization step of the original weight."""
    from gguf import GGMLQuantizationType, dequantize

    x = cases()["weights"]
    blocks = cpu_gemm.library().quantize_k(kind, torch.from_numpy(x))
    theirs = dequantize(blocks.numpy().reshape(x.shape[0], -1), GGMLQuantizationType[kind])
    held = BlockQ6K(blocks) if kind == "Q6_K" else BlockQ4(kind, blocks)
    assert np.array_equal(held.dequantize(torch.float32).numpy(), theirs)
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[kind]
    spread = np.ptp(x.reshape(x.shape[0], -1, 32), -1, keepdims=True)  # a block's range over its levels: one step
    error = np.abs(theirs - x).reshape(spread.shape[0], -1, 32)
    assert (error <= 2 * spread / levels).all()
    assert np.sqrt(np.mean((theirs - x) ** 2)) < {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}[kind] * x.std()


def test_quantize_k_checks_its_input():
    kernels = cpu_gemm.library()
    with pytest.raises(ValueError, match="quantize_k: x's width 100 is not whole super-blocks of 256"):
        kernels.quantize_k("Q4_K", torch.zeros(2, 100))
    with pytest.raises(ValueError, match="quantize_k: kind must be one of Q4_K, Q5_K, Q6_K; got 'Q3_K'"):
        kernels.quantize_k("Q3_K", torch.zeros(2, 256))


def smollm2_matrices() -> list[Matrix]:
    """SmolLM2-135M's matrices: 30 layers, width 576, 192-row k and v, 1,536 FFN, tied embeddings (no output)."""
    shapes = {"attn_q": 576, "attn_k": 576, "attn_v": 576, "attn_output": 576, "ffn_gate": 576, "ffn_up": 576,
              "ffn_down": 1536, "attn_norm": 0, "ffn_norm": 0}  # fmt: skip
    found = [Matrix("token_embd.weight", 2, 576), Matrix("output_norm.weight", 1, 576)]
    for layer in range(30):
        found += [Matrix(f"blk.{layer}.{part}.weight", 2 if columns else 1, columns or 576) for part, columns in shapes.items()]
    return found


def test_the_mixes_are_llama_quantize_s():
    """llama-quantize's type counts for SmolLM2 as Q4_K_M (read from its output file): v and down in Q6_K in the
    layers it gives more bits, the tied embedding table as the head; widths of 576 fall back to Q5_0 and Q8_0."""
    def counts(types):
        return {kind: list(types.values()).count(kind) for kind in set(types.values())}

    types = block_types(smollm2_matrices(), "q4_k_m", 30)
    assert counts(types) == {"Q8_0": 15, "Q5_0": 166, "Q6_K": 14, "Q4_K": 16}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_v.weight"] == "Q8_0"
    assert types["blk.3.ffn_down.weight"] == "Q4_K" and types["blk.5.ffn_down.weight"] == "Q6_K"
    assert "output_norm.weight" not in types and "blk.0.attn_norm.weight" not in types
    assert counts(block_types(smollm2_matrices(), "q4_0", 30)) == {"Q4_0": 210, "Q8_0": 1}  # the head: Q8_0
    assert counts(block_types(smollm2_matrices(), "q4_k_m", 30, pure=True)) == {"Q5_0": 181, "Q4_K": 30}


def test_tierserve_quantize_writes_q4_k_m_that_serves(tmp_path, capsys):
    """``tierserve quantize F32.gguf OUT.gguf --type q4_k_m`` on a checkpoint of widths 256 and 512: the file holds
    llama-quantize's mix (Q6_K head, v and down where it puts them, Q4_K elsewhere) and every metadata key, and
    tierserve serves it on its block kernels within Q8_0 activation rounding of transformers' model of the same
    file; a directory quantized at load to q4_k_m holds the same bytes."""
    import gguf

    from tierserve.cli.main import main
    from tierserve.plugins.backends.block_quantize import quantize_state
    from tierserve.plugins.backends.native import load_safetensors

    checkpoint = build_checkpoint(tmp_path, "llama256", "llama", hidden_size=256, intermediate_size=512)
    source = write_gguf(checkpoint, tmp_path / "llama256-f32.gguf", "f32")
    target = tmp_path / "llama256-q4_k_m.gguf"
    assert main(["quantize", str(source), str(target), "--type", "q4_k_m"]) == 0
    assert "tensors in Q4_K_M" in capsys.readouterr().out
    written = gguf.GGUFReader(target)
    assert written.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert {f.name for f in written.fields.values()} == {f.name for f in gguf.GGUFReader(source).fields.values()}
    kinds = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in written.tensors}
    last = load_config(checkpoint).num_hidden_layers - 1  # use_more_bits: the last eighth of the layers
    assert kinds["output.weight"] == kinds[f"blk.{last}.attn_v.weight"] == kinds[f"blk.{last}.ffn_down.weight"] == "Q6_K"
    assert kinds["blk.0.attn_v.weight"] == kinds["blk.0.ffn_down.weight"] == kinds["token_embd.weight"] == "Q4_K"
    assert kinds["blk.0.attn_q.weight"] == "Q4_K" and kinds["blk.0.attn_norm.weight"] == "F32"

    _, ids, expected = dequantized_reference(target)
    config = load_config(target)
    dequantized = PagedLlama(config, load_gguf_state(target, config, torch.float32, "none"), torch.device("cpu"),
                             torch.float32, quantization="none")  # fmt: skip
    found = closeness(expected, teacher_forced_logits(dequantized, ids))
    assert found.greedy_agreement == 1.0 and found.mean_kl <= 1e-6, found  # the file reads as transformers reads it
    state = load_gguf_state(target, config, torch.float32, "gguf")
    compared = (f"model.layers.{last}.mlp.down_proj.weight", f"model.layers.{last}.self_attn.v_proj.weight",
                "lm_head.weight", "model.layers.0.mlp.up_proj.weight")  # rows in the same order (no RoPE permutation)
    in_file = {name: state[name] for name in compared}  # the model takes the state's tensors over
    model = PagedLlama(config, state, torch.device("cpu"), torch.float32, quantization="gguf")
    assert model.linear_kernel.endswith("+q4+q6k"), model.linear_kernel
    found = closeness(expected, teacher_forced_logits(model, ids))
    print(f"llama Q4_K_M written by tierserve quantize vs its dequantized reference: {found}")
    # activations rounded to Q8_0 blocks (llama.cpp's arithmetic) move this random 256-wide model more than the
    # 64-wide ones of test_gguf: measured 0.91 / 0.013 here, and 0.95 / 0.009 for a Q4_0 file of it on the same kernels
    assert found.greedy_agreement >= 0.85 and found.mean_kl <= 0.03, found

    at_load = quantize_state(load_safetensors(checkpoint), "q4_k_m")
    for name, held in in_file.items():
        assert at_load[name].kind == held.kind and torch.equal(at_load[name].blocks, held.blocks), name


def test_a_directory_quantized_at_load_to_k_types_serves(tmp_path):
    """``model.quantization = "q4_k"`` / ``"q4_k_m"`` on a Hugging Face directory: the engine starts on the block
    kernels, generates, and names the type in its fingerprint; a width that is not whole super-blocks falls back
    to llama-quantize's 32-weight type (here the tiny checkpoint's 64-wide matrices: Q5_0 and Q8_0)."""
    from tierserve.plugins.backends.block_quantize import quantize_state
    from tierserve.plugins.backends.native import load_safetensors

    narrow = build_checkpoint(tmp_path, "llama", "llama")
    state = quantize_state(load_safetensors(narrow), "q4_k_m")
    assert isinstance(state["model.layers.0.self_attn.q_proj.weight"], BlockQ4)
    assert state["model.layers.0.self_attn.q_proj.weight"].kind == "Q5_0"
    assert isinstance(state["model.layers.1.self_attn.v_proj.weight"], GroupedInt8)  # the last layer's Q6_K: Q8_0
    checkpoint = build_checkpoint(tmp_path, "llama256", "llama", hidden_size=256, intermediate_size=512)
    fingerprints = set()
    for quantization in ("q4_k", "q4_k_m"):
        engine = make_engine(checkpoint, model__quantization=quantization)
        try:
            fingerprints.add(engine.info.fingerprint)
            [result] = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            assert len(result.token_ids) == 4
        finally:
            engine.close()
    assert len(fingerprints) == 2


def test_tierserve_quantize_refuses_what_it_cannot_write(tmp_path, capsys):
    from tierserve.cli.main import main

    checkpoint = build_checkpoint(tmp_path, "llama", "llama")
    source = write_gguf(checkpoint, tmp_path / "llama-q4_0.gguf", "q4_0")
    assert main(["quantize", str(source), str(tmp_path / "again.gguf"), "--type", "q4_k_m"]) == 2
    assert "holds Q4_0 weights" in capsys.readouterr().err and not (tmp_path / "again.gguf").exists()
    with pytest.raises(ConfigError, match="--type 'q3_k_m': allowed: q4_0, q4_1"):
        from tierserve.plugins.backends.gguf_quantize import quantize_gguf

        quantize_gguf(source, tmp_path / "x.gguf", "q3_k_m")
