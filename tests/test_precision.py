"""Reduced precisions: int8 weights and bfloat16 KV stay close to float32, and are never confused with it.

Float32 stays exact against ``transformers`` (``test_engine_exactness``). The
tolerances here are for rounding, stated per variant: on these random-weight
checkpoints, whose next-token distributions are nearly flat (the hardest case
for greedy agreement), each variant must keep the most likely token at
``MIN_AGREEMENT`` of the teacher-forced positions with a mean KL(float32 ||
variant) under ``MAX_KL`` nats. ``fbgemm`` also rounds the activations to 7
bits, so its bounds are the widest (measured: agreement 0.81-0.87, KL
0.001-0.011; ``weight_only`` 0.89-0.95 and 0.0002-0.0024; bfloat16 weights
0.96-0.99 and under 0.0006; ``python -m bench quality``).
"""

from __future__ import annotations

import pytest
import torch

from bench.quality import closeness, load_model, teacher_forced_logits
from tests.engine_helpers import PROMPTS, build_checkpoint, make_engine
from tierserve.core.errors import ConfigError
from tierserve.core.sampling_params import SamplingParams
from tierserve.plugins.backends import cpu_gemm
from tierserve.plugins.backends.linear import Int8Linear, int8_kernels, quantize_rows

pytestmark = pytest.mark.unit

MIN_AGREEMENT = {"int8-fbgemm": 0.75, "int8-fbgemm+q8": 0.75, "int8-weight_only": 0.85, "int8-dequantize": 0.85, "bfloat16": 0.9}
MAX_KL = {"int8-fbgemm": 0.025, "int8-fbgemm+q8": 0.025, "int8-weight_only": 0.006, "int8-dequantize": 0.006, "bfloat16": 0.002}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

ARCHITECTURES = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
}
INT8_KERNELS = int8_kernels(torch.device("cpu"))


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    architecture, overrides = ARCHITECTURES[request.param]
    return build_checkpoint(tmp_path_factory.mktemp("precision"), request.param, architecture, **overrides)


def first_tokens_agree(expected: list[list[int]], actual: list[list[int]]) -> bool:
    """The first generated token matches float32's for at least half the prompts (later tokens drift apart
    once one differs, so whole continuations say little; teacher-forced closeness is tested above)."""
    return sum(e[0] == a[0] for e, a in zip(expected, actual)) * 2 >= len(expected)


def token_ids(path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]


@pytest.mark.parametrize("linear_kernel", ["auto", "torch"])
def test_int8_weights_stay_close_to_float32(checkpoint, linear_kernel):
    """``auto``: the fastest int8 kernel here; ``torch``: the portable one."""
    ids = token_ids(checkpoint)
    reference = teacher_forced_logits(load_model(checkpoint, torch.float32), ids)
    model = load_model(checkpoint, torch.float32, "int8", linear_kernel)
    expected = INT8_KERNELS[0] if linear_kernel == "auto" else [k for k in INT8_KERNELS if k != "fbgemm"][0]
    small_batch = "+q8" if linear_kernel == "auto" and cpu_gemm.library() is not None else ""
    assert model.linear_kernel == f"int8-{expected}{small_batch}"
    found = closeness(reference, teacher_forced_logits(model, ids))
    assert found.greedy_agreement >= MIN_AGREEMENT[model.linear_kernel], found
    assert found.mean_kl <= MAX_KL[model.linear_kernel], found


def test_bfloat16_weights_stay_close_to_float32(checkpoint):
    ids = token_ids(checkpoint)
    reference = teacher_forced_logits(load_model(checkpoint, torch.float32), ids)
    found = closeness(reference, teacher_forced_logits(load_model(checkpoint, torch.bfloat16), ids))
    assert found.greedy_agreement >= MIN_AGREEMENT["bfloat16"], found
    assert found.mean_kl <= MAX_KL["bfloat16"], found


@pytest.mark.parametrize("kernel", INT8_KERNELS + (["q8"] if cpu_gemm.library() is not None else []))
def test_every_int8_kernel_computes_the_quantized_product(kernel):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator) * 0.05
    bias = torch.randn(96, generator=generator)
    x = torch.randn(3, 64, generator=generator)
    linear = Int8Linear(weight, bias, kernel, torch.float32)
    q, scale = quantize_rows(weight)
    expected = x @ (q.float() * scale[:, None]).T + bias
    assert torch.allclose(linear(x), expected, rtol=0.03, atol=0.03)
    # a row's result does not depend on what else is in the batch (a huge row included); the
    # dequantize fallback is a float matmul, whose summation order may change with the batch size
    alone = linear(x[:1])
    same = torch.equal if kernel != "dequantize" else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert same(linear(torch.cat([x[:1], 1000 * x[1:2]]))[:1], alone)
    assert same(linear(x)[:1], alone)


def test_int8_weights_take_a_quarter_of_the_bytes(checkpoint):
    model = load_model(checkpoint, torch.float32, "int8", "torch")
    float_model = load_model(checkpoint, torch.float32)
    layer, float_layer = model.layers[0], float_model.layers[0]
    assert layer.gate_up.weight.dtype == torch.int8
    assert layer.gate_up.weight.numel() == float_layer.gate_up.weight.numel()
    assert model.embed.weight.dtype == torch.int8  # the table is int8 too, tied or not


@pytest.mark.parametrize("linear_kernel", ["auto", "torch"])
def test_int8_engine_generates_close_to_float32(checkpoint, linear_kernel):
    """A prefix cache hit reproduces the int8 output exactly where one kernel runs every batch size
    (``torch``); ``auto`` runs q8 for calls of at most 4 rows and fbgemm above, which round the
    activations differently, so a rerun whose uncached tail is short agrees in its first token only (whole
    blocks reused here: a partial block's copy would leave the rerun one row, q8's, against the prefill's
    fbgemm rows)."""
    float_engine = make_engine(checkpoint)
    int8_engine = make_engine(
        checkpoint, model__quantization="int8", model__linear_kernel=linear_kernel, kv_cache__reuse_partial_blocks=False
    )
    try:
        assert int8_engine.info.quantization == "int8"
        assert int8_engine.info.fingerprint != float_engine.info.fingerprint
        expected = [r.token_ids for r in float_engine.generate(PROMPTS, GREEDY)]
        actual = [r.token_ids for r in int8_engine.generate(PROMPTS, GREEDY)]
        assert first_tokens_agree(expected, actual), (expected, actual)
        again = int8_engine.generate(PROMPTS[4:5], GREEDY)[0]
        assert again.cached_tokens > 0
        if int8_engine.info.linear_kernel.endswith("+q8"):
            assert again.token_ids[0] == actual[4][0]
        else:
            assert again.token_ids == actual[4]
    finally:
        float_engine.close()
        int8_engine.close()


def test_bfloat16_kv_with_float32_weights(checkpoint):
    float_engine = make_engine(checkpoint)
    engine = make_engine(checkpoint, kv_cache__dtype="bfloat16")
    try:
        assert (engine.info.dtype, engine.info.kv_dtype) == ("float32", "bfloat16")
        assert engine.info.kv_block_bytes * 2 == float_engine.info.kv_block_bytes
        expected = [r.token_ids for r in float_engine.generate(PROMPTS, GREEDY)]
        actual = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        assert first_tokens_agree(expected, actual), (expected, actual)
    finally:
        float_engine.close()
        engine.close()


def test_onednn_is_refused_for_int8_weights(tmp_path):
    path = build_checkpoint(tmp_path, "llama", "llama")
    with pytest.raises(ValueError, match="'onednn' runs float weights; with model.quantization = 'int8'"):
        make_engine(path, model__quantization="int8", model__linear_kernel="onednn")


def test_the_unpaged_backend_refuses_a_kv_dtype(tmp_path):
    path = build_checkpoint(tmp_path, "llama", "llama")
    with pytest.raises(ConfigError, match="kv_cache.dtype = 'bfloat16' is supported by the paged backends only"):
        make_engine(path, backend="transformers-unpaged", kv_cache__dtype="bfloat16")
