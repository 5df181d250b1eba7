"""GGUF model files: float ones run exactly as their checkpoint, Q8_0 ones exactly as their dequantized
weights while held at about a byte a weight, and broken ones are refused up front.

The files are written by ``tests/gguf_helpers.py`` with the gguf package's writer (llama.cpp's
own Python package; its tensors were checked byte for byte against llama.cpp's
``convert_hf_to_gguf.py`` output for these checkpoints). The Q8_0 reference is transformers'
GGUF loader, which dequantizes with the gguf package (llama.cpp's reference dequantizer) to
float32: the portable ``int8-g32`` kernel multiplies the same weights in float32, so the tolerance
is that of float32 summation order (measured: every teacher-forced argmax equal, |mean KL| under
4e-9 nats). The default ``int8-g32-q8`` kernel (``cpu_gemm``) also rounds the activations to Q8_0
blocks, as llama.cpp does, so its tolerance is that rounding's (``Q8_AGREEMENT``, ``Q8_KL``).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.quality import closeness, teacher_forced_logits
from tests.engine_helpers import PROMPTS, build_checkpoint, hf_greedy, make_engine
from tests.gguf_helpers import write_gguf
from tierserve.models.checkpoints import load_config, load_tokenizer
from tierserve.core.errors import ConfigError
from tierserve.core.sampling_params import SamplingParams
from tierserve.plugins.backends import cpu_gemm
from tierserve.plugins.backends.gguf_weights import load_gguf_state
from tierserve.plugins.backends.linear import BlockLinear, BlockQ4, BlockQ6K, GroupedInt8, SplitLinear
from tierserve.plugins.backends.llama import PagedLlama

pytestmark = pytest.mark.unit

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
MIN_AGREEMENT, MAX_KL = 1.0, 1e-6  # Q8_0 against its dequantized weights: float32 rounding only
Q8_AGREEMENT, Q8_KL = 0.9, 0.005  # activations rounded to Q8_0 blocks too (llama.cpp's arithmetic)
KERNELS = ["torch"] + (["auto"] if cpu_gemm.library() is not None else [])
ARCHITECTURES = {"llama": ("llama", {}), "qwen3": ("qwen3", {}), "qwen2": ("qwen2", {"tie_word_embeddings": True})}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """architecture -> (checkpoint, {outtype: gguf file})."""
    root = tmp_path_factory.mktemp("gguf")
    found = {}
    for name, (architecture, overrides) in ARCHITECTURES.items():
        checkpoint = build_checkpoint(root, name, architecture, **overrides)
        outtypes = ("f32", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
        found[name] = (checkpoint, {t: write_gguf(checkpoint, root / f"{name}-{t}.gguf", t) for t in outtypes})
    return found


def bf16_checkpoint(checkpoint, target):
    """The checkpoint with every weight rounded to bfloat16 and stored as float32 again: what a BF16 file holds."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    model.save_pretrained(target)
    load_tokenizer(checkpoint).save_pretrained(target)
    return target


def generate(engine) -> list[list[int]]:
    try:
        return [result.token_ids for result in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.close()


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_f32_file_generates_what_its_checkpoint_does(files, architecture):
    checkpoint, gguf = files[architecture]
    engine = make_engine(gguf["f32"])
    assert (engine.info.backend, engine.info.path) == ("native", str(gguf["f32"]))
    assert generate(engine) == hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)


def test_bf16_file_generates_what_its_bf16_rounded_checkpoint_does(files, tmp_path):
    checkpoint, gguf = files["llama"]
    expected = hf_greedy(bf16_checkpoint(checkpoint, tmp_path / "bf16"), PROMPTS, NEW_TOKENS)
    assert generate(make_engine(gguf["bf16"], model__dtype="float32")) == expected


def test_tokenizer_and_chat_template_come_from_the_file(files):
    checkpoint, gguf = files["qwen3"]
    original, from_file = load_tokenizer(checkpoint), load_tokenizer(gguf["f32"])
    for prompt in PROMPTS:
        assert from_file(prompt)["input_ids"] == original(prompt)["input_ids"]
    messages = [{"role": "user", "content": "hi there"}]
    assert from_file.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(messages, tokenize=False)


def test_the_tokenizers_load_without_torch(files):
    """A directory's tokenizer and a GGUF file's (converted once, then cached) load without importing torch: the
    HTTP process tokenizes and never runs the model, and torch would cost it ~250 MB."""
    checkpoint, gguf = files["qwen3"]
    load_tokenizer(gguf["f32"])  # converted here (transformers' GGUF conversion imports torch), cached
    script = ("import sys; from pathlib import Path; from tierserve.models.checkpoints import load_tokenizer;"
              "print([type(load_tokenizer(Path(p))).__name__ for p in sys.argv[1:]], 'torch' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script, str(checkpoint), str(gguf["f32"])], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False", done.stdout


def test_the_paged_transformers_backend_runs_a_gguf_file(files):
    checkpoint, gguf = files["llama"]
    engine = make_engine(gguf["f32"], backend="transformers")
    assert engine.info.backend == "transformers"
    assert generate(engine) == hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)


def dequantized_reference(path):
    """transformers' float32 model of the dequantized file, the token ids of ``PROMPTS`` and its logits for them."""
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path)
    ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    with torch.inference_mode():
        expected = [reference(torch.tensor([seq])).logits[0] for seq in ids]
    return reference, ids, expected


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_q8_0_runs_as_its_dequantized_weights(files, architecture, kernel):
    """Teacher-forced logits against transformers' float32 model of the dequantized file, and greedy output:
    exact with the portable kernel (``torch``), within Q8_0 activation rounding with ``auto``."""
    _, gguf = files[architecture]
    path = gguf["q8_0"]
    reference, ids, expected = dequantized_reference(path)
    config = load_config(path)
    model = PagedLlama(config, load_gguf_state(path, config, torch.float32, "int8"), torch.device("cpu"),
                       torch.float32, linear_kernel=kernel, quantization="int8")  # fmt: skip
    suffix = "+int8-g32" if kernel == "torch" else "+int8-g32-q8"
    assert model.linear_kernel.endswith(suffix)
    found = closeness(expected, teacher_forced_logits(model, ids))
    print(f"{architecture} Q8_0 ({kernel}) vs dequantized reference: {found}")
    if kernel == "torch":
        assert found.greedy_agreement >= MIN_AGREEMENT and found.mean_kl <= MAX_KL, found
    else:
        assert found.greedy_agreement >= Q8_AGREEMENT and found.mean_kl <= Q8_KL, found

    engine = make_engine(path, model__quantization="int8", model__linear_kernel=kernel)
    assert engine.info.linear_kernel.endswith(suffix)
    outputs = generate(engine)
    if kernel == "torch":
        for seq, output in zip(ids, outputs):
            assert output == argmax_continuation(reference, seq)
    else:  # later tokens drift apart once one differs; the first ones keep to the reference
        firsts = [int(logits[-1].argmax()) == output[0] for logits, output in zip(expected, outputs)]
        assert sum(firsts) * 2 >= len(firsts), firsts


@pytest.mark.skipif(cpu_gemm.library() is None, reason="the fused decode runs tierserve's kernels")
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2's embeddings are the tied Q8_0 head
def test_q8_0_fused_decode_equals_the_layer_loop(files, architecture):
    """A Q8_0 file's scales per 32 columns through the one-call decode: the layer loop's logits to the bit."""
    from tests.test_cpu_gemm import fused_and_layer_loop_logits

    _, gguf = files[architecture]
    engine = make_engine(gguf["q8_0"], model__quantization="int8", kv_cache__enable_prefix_caching=False)
    fused, loop, fused_steps = fused_and_layer_loop_logits(engine, PROMPTS[:2])
    assert fused_steps == 11 and len(fused) == len(loop) == 12
    assert all(torch.equal(a, b) for a, b in zip(fused, loop))


def argmax_continuation(model, seq: list[int]) -> list[int]:
    """``NEW_TOKENS`` argmax tokens, end-of-sequence ones included (as ``ignore_eos``)."""
    ids = list(seq)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(seq) :]


def test_q8_0_weights_stay_int8(files):
    """Every matrix (embedding and lm_head included) is held as the file's int8 values and scales."""
    _, gguf = files["llama"]
    config = load_config(gguf["q8_0"])
    state = load_gguf_state(gguf["q8_0"], config, torch.float32, "int8")
    grouped = [t for t in state.values() if isinstance(t, GroupedInt8)]
    assert len(grouped) == 2 + 7 * config.num_hidden_layers
    model = PagedLlama(config, state, torch.device("cpu"), torch.float32, quantization="int8")
    layers = [model.lm_head] + [m for layer in model.layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    assert all(layer.weight.dtype == torch.int8 and layer.kernel.startswith("grouped") for layer in layers)
    weights = sum(layer.weight.numel() for layer in layers) + model.embed.weight.numel()
    held = sum(layer.weight.nbytes + layer.scale.nbytes for layer in layers)
    held += model.embed.weight.nbytes + model.embed.scale.nbytes
    print(f"Q8_0 matrices held: {held} bytes for {weights} weights, {held / weights:.3f} bytes per weight")
    assert model.embed.weight.dtype == torch.int8
    assert held / weights == pytest.approx(1 + 4 / 32)  # int8 values plus one float32 scale per 32


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2's embeddings are tied
def test_memory_estimate_counts_q8_0_as_it_is_held(files, architecture):
    """The registry's pre-load estimate (its memory budget check) is the bytes the int8 matrices take."""
    from tierserve.settings.config import load_settings
    from tierserve.server.model_memory import estimate_memory

    _, gguf = files[architecture]
    config = load_config(gguf["q8_0"])
    model = PagedLlama(config, load_gguf_state(gguf["q8_0"], config, torch.float32, "int8"), torch.device("cpu"),
                       torch.float32, quantization="int8")  # fmt: skip
    layers = [model.lm_head] + [m for layer in model.layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    held = sum(layer.weight.nbytes + layer.scale.nbytes for layer in layers)
    if architecture == "qwen2":  # tied: the embedding reads the output head's table, held once
        assert model.embed.weight.data_ptr() == model.lm_head.weight.data_ptr()
    else:
        held += model.embed.weight.nbytes + model.embed.scale.nbytes
    overrides = {("model", "path"): str(gguf["q8_0"]), ("model", "quantization"): "int8", ("model", "device"): "cpu"}
    estimate = estimate_memory(load_settings(None, environ={}, overrides=overrides).settings).weight_bytes
    assert held <= estimate <= 1.05 * held  # plus the small float tensors (norms, biases)


@pytest.mark.skipif(cpu_gemm.library() is None, reason="Q4 blocks run on tierserve's kernels")
@pytest.mark.parametrize("outtype", ["q4_0", "q4_1", "q5_0", "q5_1"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2's embeddings are tied
def test_q4_runs_as_its_dequantized_weights(files, architecture, outtype):
    """``model.quantization = "gguf"``: the Q4 blocks kept, against transformers' float32 model of the
    dequantized file, within Q8_0 activation rounding (llama.cpp's arithmetic), through the engine too."""
    _, gguf = files[architecture]
    path = gguf[outtype]
    _, ids, expected = dequantized_reference(path)
    config = load_config(path)
    model = PagedLlama(config, load_gguf_state(path, config, torch.float32, "gguf"), torch.device("cpu"),
                       torch.float32, quantization="gguf")  # fmt: skip
    assert model.linear_kernel.endswith("+q4"), model.linear_kernel
    assert all(isinstance(m, BlockLinear) for layer in model.layers for m in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                            layer.down))  # fmt: skip
    found = closeness(expected, teacher_forced_logits(model, ids))
    print(f"{architecture} {outtype} (q4) vs dequantized reference: {found}")
    assert found.greedy_agreement >= Q8_AGREEMENT and found.mean_kl <= Q8_KL, found

    engine = make_engine(path, model__quantization="gguf")
    assert engine.info.linear_kernel.endswith("+q4")
    outputs = generate(engine)
    firsts = [int(logits[-1].argmax()) == output[0] for logits, output in zip(expected, outputs)]
    assert sum(firsts) * 2 >= len(firsts), firsts


@pytest.mark.skipif(cpu_gemm.library() is None, reason="Q4 blocks run on tierserve's kernels")
@pytest.mark.parametrize("outtype", ["q4_0", "q4_1", "q5_0", "q5_1"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2: q/k/v biases and the tied Q4 table
def test_q4_fused_decode_equals_the_layer_loop(files, architecture, outtype):
    """Q4 projections through the one-call decode (ts_decode_layers): the layer loop's logits to the bit."""
    from tests.test_cpu_gemm import fused_and_layer_loop_logits

    _, gguf = files[architecture]
    engine = make_engine(gguf[outtype], model__quantization="gguf", kv_cache__enable_prefix_caching=False)
    fused, loop, fused_steps = fused_and_layer_loop_logits(engine, PROMPTS[:3])
    assert fused_steps == 11 and len(fused) == len(loop) == 12
    assert all(torch.equal(a, b) for a, b in zip(fused, loop))


@pytest.mark.skipif(cpu_gemm.library() is None, reason="Q4 blocks run on tierserve's kernels")
def test_q4_k_runs_as_its_dequantized_weights_and_decodes_in_one_call(tmp_path):
    """A Q4_K file (widths of 256): its super-blocks as 32-weight blocks with float32 scales, against
    transformers' model of the dequantized file, and the one-call decode equal to the layer loop."""
    from tests.test_cpu_gemm import fused_and_layer_loop_logits

    checkpoint = build_checkpoint(tmp_path, "llama256", "llama", hidden_size=256, intermediate_size=512)
    path = write_gguf(checkpoint, tmp_path / "llama256-q4_k.gguf", "q4_k")
    _, ids, expected = dequantized_reference(path)
    config = load_config(path)
    state = load_gguf_state(path, config, torch.float32, "gguf")
    assert {t.kind for t in state.values() if isinstance(t, BlockQ4)} == {"Q4_K"}
    model = PagedLlama(config, state, torch.device("cpu"), torch.float32, quantization="gguf")
    assert model.linear_kernel.endswith("+q4")
    found = closeness(expected, teacher_forced_logits(model, ids))
    print(f"llama Q4_K (q4) vs dequantized reference: {found}")
    assert found.greedy_agreement >= Q8_AGREEMENT and found.mean_kl <= Q8_KL, found
    engine = make_engine(path, model__quantization="gguf", kv_cache__enable_prefix_caching=False)
    fused, loop, fused_steps = fused_and_layer_loop_logits(engine, PROMPTS[:3])
    assert fused_steps == 11 and all(torch.equal(a, b) for a, b in zip(fused, loop))


@pytest.mark.skipif(cpu_gemm.library() is None, reason="GGUF blocks run on tierserve's kernels")
def test_q4_k_m_keeps_q6_k_and_q4_k_apart_and_decodes_in_one_call(tmp_path):
    """A Q4_K_M-style file (v, down and the head in Q6_K, the rest Q4_K): every block kept in its own type (q and
    k in Q4_K with v in Q6_K: a split projection, nothing re-quantized), against transformers' model of the
    dequantized file, and the one-call decode (the split q/k/v included) equal to the layer loop, bit for bit."""
    from tests.test_cpu_gemm import fused_and_layer_loop_logits

    checkpoint = build_checkpoint(tmp_path, "llama256", "llama", hidden_size=256, intermediate_size=512)
    path = write_gguf(checkpoint, tmp_path / "llama256-q4_k_m.gguf", "q4_k_m")
    _, ids, expected = dequantized_reference(path)
    config = load_config(path)
    state = load_gguf_state(path, config, torch.float32, "gguf")
    assert {t.kind for t in state.values() if isinstance(t, (BlockQ4, BlockQ6K))} == {"Q4_K", "Q6_K"}
    assert not any(isinstance(t, GroupedInt8) for name, t in state.items() if name != "model.embed_tokens.weight")
    model = PagedLlama(config, state, torch.device("cpu"), torch.float32, quantization="gguf")
    assert model.linear_kernel.endswith("+q4+q6k"), model.linear_kernel
    assert isinstance(model.layers[0].qkv, SplitLinear) and model.layers[0].qkv.kernel == "q4-q4k+q6-k"
    assert isinstance(model.layers[0].down, BlockLinear) and model.layers[0].down.kernel == "q6-k"
    found = closeness(expected, teacher_forced_logits(model, ids))
    print(f"llama Q4_K_M (q4 + q6k) vs dequantized reference: {found}")
    assert found.greedy_agreement >= Q8_AGREEMENT and found.mean_kl <= Q8_KL, found
    engine = make_engine(path, model__quantization="gguf", kv_cache__enable_prefix_caching=False)
    fused, loop, fused_steps = fused_and_layer_loop_logits(engine, PROMPTS[:3])
    assert fused_steps == 11 and all(torch.equal(a, b) for a, b in zip(fused, loop))


@pytest.mark.skipif(cpu_gemm.library() is None, reason="Q4 blocks run on tierserve's kernels")
@pytest.mark.parametrize(("outtype", "block_bytes"), [("q4_0", 18), ("q4_1", 20)])
def test_q4_weights_stay_at_their_bits_and_the_estimate_counts_them(files, outtype, block_bytes):
    from tierserve.server.model_memory import estimate_memory
    from tierserve.settings.config import load_settings

    _, gguf = files["llama"]
    config = load_config(gguf[outtype])
    state = load_gguf_state(gguf[outtype], config, torch.float32, "gguf")
    blocks = [t for t in state.values() if isinstance(t, BlockQ4)]
    # every layer matrix, the untied output head and the embedding table (its rows dequantized as read)
    assert len(blocks) == 7 * config.num_hidden_layers + 2
    assert isinstance(state["model.embed_tokens.weight"], BlockQ4)
    model = PagedLlama(config, state, torch.device("cpu"), torch.float32, quantization="gguf")
    layers = [model.lm_head] + [m for layer in model.layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    packed = [layer.packed for layer in layers]
    weights = sum(p.out_features * p.in_features for p in packed)
    held = sum(p.nibbles.nbytes + p.scale.nbytes + (p.mins.nbytes if p.mins is not None else 0) for p in packed)
    padding = sum((-p.out_features % 4) * p.in_features for p in packed) * block_bytes / 32
    assert held == pytest.approx(weights * block_bytes / 32 + padding)  # the file's bytes, regrouped
    overrides = {("model", "path"): str(gguf[outtype]), ("model", "quantization"): "gguf", ("model", "device"): "cpu"}
    estimate = estimate_memory(load_settings(None, environ={}, overrides=overrides).settings).weight_bytes
    held += model.embed.weight.nbytes  # the file's blocks
    assert 0.9 * held <= estimate <= 1.2 * held


def test_gguf_quantization_is_for_gguf_files_on_the_native_backend(files):
    checkpoint, gguf = files["llama"]
    with pytest.raises(ConfigError, match=r"model.quantization = 'gguf' keeps a GGUF file's blocks as stored, but "
                                          r"model.path .* is a Hugging Face directory; use model.quantization = 'q4_0', 'q4_1', 'q8_0', "
                                          r"'q4_k', 'q5_k', 'q6_k', 'q4_k_m', 'q5_k_m' or 'int8'"):
        make_engine(checkpoint, model__quantization="gguf")
    with pytest.raises(ConfigError, match=r"model.quantization = 'gguf' keeps GGUF blocks on the native backend only"):
        make_engine(gguf["q4_0"], model__quantization="gguf", model__backend="transformers")


def test_q8_0_without_int8_is_dequantized_to_the_model_dtype(files):
    checkpoint, gguf = files["llama"]
    state = load_gguf_state(gguf["q8_0"], load_config(gguf["q8_0"]), torch.float32, "none")
    assert all(t.dtype == torch.float32 for t in state.values())


def test_fingerprint_names_the_quantization(files):
    _, gguf = files["llama"]
    prints = {}
    for outtype, quantization in (("f32", "none"), ("f32", "int8"), ("q8_0", "int8")):
        engine = make_engine(gguf[outtype], model__quantization=quantization)
        prints[outtype, quantization] = engine.info.fingerprint
        engine.close()
    assert len(set(prints.values())) == 3, prints


def test_fingerprint_reads_every_tensor(files, tmp_path):
    """Two files of one size that differ in one tensor past the first MiB never share KV."""
    import gguf as gguf_package

    from tierserve.models.gguf import gguf_fingerprint

    _, gguf = files["llama"]
    data = bytearray(gguf["f32"].read_bytes())
    late = [t for t in gguf_package.GGUFReader(gguf["f32"]).tensors if int(t.data_offset) > 1 << 20]
    assert late and len(data) <= 2 << 20  # the first-and-last-MiB samples do not reach it
    data[int(late[0].data_offset) + 1] ^= 0x01
    edited = tmp_path / gguf["f32"].name
    edited.write_bytes(bytes(data))
    assert gguf_fingerprint(edited) != gguf_fingerprint(gguf["f32"])


def test_truncated_file_is_refused(files, tmp_path):
    _, gguf = files["llama"]
    data = gguf["f32"].read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 64):
        broken = tmp_path / f"cut-{cut}.gguf"
        broken.write_bytes(data[:cut])
        with pytest.raises(ConfigError, match=r"truncated or corrupt"):
            make_engine(broken)


def test_corrupt_file_is_refused(files, tmp_path):
    _, gguf = files["llama"]
    data = bytearray(gguf["f32"].read_bytes())
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(data[4:]))
    with pytest.raises(ConfigError, match=r"not a readable GGUF file .*magic"):
        make_engine(not_gguf)
    garbled = tmp_path / "garbled.gguf"
    data[16:24] = (2**62).to_bytes(8, "little")  # the metadata count
    garbled.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"truncated or corrupt"):
        make_engine(garbled)


@pytest.mark.parametrize("anchor", [b"{%- for message", b"tokenizer.ggml.tokens", b"tokenizer.ggml.merges"],
                         ids=["chat-template", "tokens", "merges"])  # fmt: skip
def test_corrupt_metadata_text_is_refused(files, tmp_path, anchor):
    _, gguf = files["llama"]
    data = bytearray(gguf["f32"].read_bytes())
    data[data.index(anchor) + 60] = 0xFF  # not UTF-8: the text cannot be read back
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"corrupt"):  # refused up front, by the reader or the text check
        make_engine(broken)


def test_gguf_file_must_be_named_gguf(files, tmp_path):
    _, gguf = files["llama"]
    (tmp_path / "model.q8").write_bytes(gguf["f32"].read_bytes())
    with pytest.raises(ConfigError, match=r"model.gguf_file = 'model.q8': a GGUF file's name ends in .gguf"):
        make_engine(tmp_path, model__gguf_file="model.q8")


def test_unknown_architecture_and_tensor_type_are_named(tmp_path):
    import gguf
    import numpy as np

    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(odd, "fancyformer")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ConfigError, match=r"GGUF architecture 'fancyformer' cannot be loaded; supported: .*llama.*qwen3"):
        make_engine(odd)

    typed = tmp_path / "typed.gguf"
    writer = gguf.GGUFWriter(typed, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float64), raw_dtype=gguf.GGMLQuantizationType.F64)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ConfigError, match=r"'token_embd.weight' has GGML type F64, which cannot be loaded; supported: F32, F16, BF16, .*Q8_0"):
        make_engine(typed)


def test_gguf_file_needs_a_directory(files):
    _, gguf = files["llama"]
    with pytest.raises(ConfigError, match=r"model.gguf_file = 'x.gguf' names a file inside the directory model.path"):
        make_engine(gguf["f32"], model__gguf_file="x.gguf")


@pytest.mark.skipif(cpu_gemm.library() is None, reason="GGUF blocks run on tierserve's kernels")
@pytest.mark.parametrize("quantization", ["q4_0", "q4_1", "q8_0"])
def test_a_directory_quantized_at_load_holds_the_blocks_llama_cpp_writes(files, quantization):
    """``model.quantization = "q4_0"`` (``q4_1``, ``q8_0``) on a Hugging Face directory: each weight matrix holds
    the very bytes the GGUF file of that type has for it (llama.cpp's reference quantizer), the layers run the
    block kernels, and the model's logits stay within Q8_0 activation rounding of transformers' model of those
    dequantized weights; the engine serves it under a fingerprint of its own per type."""
    from tierserve.plugins.backends.block_quantize import quantize_state
    from tierserve.plugins.backends.native import load_safetensors

    checkpoint, gguf = files["llama"]
    ours = quantize_state(load_safetensors(checkpoint), quantization)
    theirs = load_gguf_state(gguf[quantization], load_config(gguf[quantization]), torch.float32, "gguf")
    name = "model.layers.1.mlp.down_proj.weight"  # rows in the same order in both (no RoPE permutation)
    if quantization == "q8_0":
        assert torch.equal(ours[name].q, theirs[name].q) and torch.equal(ours[name].scale, theirs[name].scale)
    else:
        assert ours[name].kind == quantization.upper() and torch.equal(ours[name].blocks, theirs[name].blocks)

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers' model of the weights as rounded
        for key, tensor in ours.items():
            if not isinstance(tensor, torch.Tensor):
                dequantized = tensor.dequantize(torch.float32)
                reference.get_parameter(key).copy_(dequantized)
    tokenizer = load_tokenizer(checkpoint)
    ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    with torch.inference_mode():
        expected = [reference(torch.tensor([seq])).logits[0] for seq in ids]
    model = PagedLlama(load_config(checkpoint), ours, torch.device("cpu"), torch.float32, quantization=quantization)
    kernel = "q4" if quantization != "q8_0" else "int8-g32"
    assert kernel in model.linear_kernel, model.linear_kernel
    found = closeness(expected, teacher_forced_logits(model, ids))
    print(f"llama {quantization} at load vs its dequantized weights: {found}")
    assert found.greedy_agreement >= Q8_AGREEMENT and found.mean_kl <= Q8_KL, found

    engine = make_engine(checkpoint, model__quantization=quantization)
    try:
        fingerprint = engine.info.fingerprint
        assert engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finally:
        engine.close()
    other = make_engine(checkpoint, model__quantization="q4_1" if quantization == "q4_0" else "q4_0")
    try:
        assert other.info.fingerprint != fingerprint
    finally:
        other.close()


def test_quantizing_at_load_is_for_directories_on_the_native_backend(files):
    checkpoint, gguf = files["llama"]
    with pytest.raises(ConfigError, match="is a GGUF file: use model.quantization = 'gguf'"):
        make_engine(gguf["q4_0"], model__quantization="q4_0")
    with pytest.raises(ConfigError, match="keeps GGUF blocks on the native backend only"):
        make_engine(checkpoint, "transformers", model__quantization="q4_1")


def test_tierserve_quantize_writes_the_file_llama_cpp_s_quantizer_writes(files, tmp_path, capsys):
    """``tierserve quantize F32.gguf OUT.gguf --type q4_0``: every metadata key copied, each weight matrix in the
    blocks llama.cpp's reference quantizer writes (byte for byte those of a file quantized from the checkpoint),
    norms kept, and the output head in Q8_0 as llama-quantize puts a head whose width is not whole super-blocks."""
    import gguf as gguf_package

    from tierserve.cli.main import main

    _, gguf = files["llama"]
    target = tmp_path / "requantized-q4_0.gguf"
    assert main(["quantize", str(gguf["f32"]), str(target), "--type", "q4_0"]) == 0
    assert "tensors in Q4_0" in capsys.readouterr().out
    ours, theirs = gguf_package.GGUFReader(target), gguf_package.GGUFReader(gguf["q4_0"])
    assert {f.name for f in ours.fields.values()} == {f.name for f in theirs.fields.values()}
    assert ours.get_field("general.file_type").contents() == gguf_package.LlamaFileType.MOSTLY_Q4_0
    by_name = {t.name: t for t in theirs.tensors}
    for tensor in ours.tensors:
        if tensor.name == "output.weight":
            assert gguf_package.GGMLQuantizationType(tensor.tensor_type).name == "Q8_0"
            continue
        assert tensor.tensor_type == by_name[tensor.name].tensor_type, tensor.name
        assert np.array_equal(np.asarray(tensor.data), np.asarray(by_name[tensor.name].data)), tensor.name

    assert main(["quantize", str(gguf["f32"]), str(target), "--type", "q8_0"]) == 2
    assert "exists: give a new file name" in capsys.readouterr().err
    assert main(["quantize", str(gguf["q4_1"]), str(tmp_path / "again.gguf"), "--type", "q4_0"]) == 2
    assert "holds Q4_1 weights" in capsys.readouterr().err and not (tmp_path / "again.gguf").exists()
    with pytest.raises(SystemExit):
        main(["quantize", str(gguf["f32"]), str(tmp_path / "k.gguf"), "--type", "q3_k_m"])
