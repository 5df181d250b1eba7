"""GGUF Q4_0 / Q4_1 / Q4_K and Q6_K weights kept in their blocks (cpu_gemm.c's ts_q4_gemm, ts_q6k_gemm): against a float64 reference of the
dequantized blocks and the Q8_0-rounded activations, the same bits in the AVX2 and AVX-512 builds, and a row's
result independent of the batch it runs in."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tierserve.plugins.backends import cpu_gemm
from tests.gguf_helpers import random_q4_k, random_q5_k, random_q6_k
from tierserve.plugins.backends.cpu_gemm_abi import Kernels
from tierserve.plugins.backends.cpu_gemm_builds import CPU_FLAGS, ISAS, cpu_flags, object_name
from tierserve.plugins.backends.linear import BlockQ4, BlockQ6K

pytestmark = pytest.mark.unit

if cpu_gemm.library() is None:
    pytest.skip(f"tierserve's CPU kernels do not run here: {cpu_gemm.unavailable_reason()}", allow_module_level=True)


def random_blocks(kind: str, rows: int, groups: int, seed: int) -> torch.Tensor:
    """uint8 blocks as ``BlockQ4`` holds them (the file's layout): Q4_0, Q4_1, Q5_0 and Q5_1 from llama.cpp's
    reference quantizer (the gguf package's) on random weights, Q4_K and Q5_K random super-blocks."""
    if kind == "Q4_K":
        return torch.from_numpy(random_q4_k(rows, groups * 32, seed))
    if kind == "Q5_K":
        return torch.from_numpy(random_q5_k(rows, groups * 32, seed))
    weights = np.random.default_rng(seed).standard_normal((rows, groups * 32)).astype(np.float32) * 0.05
    data = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(data).reshape(rows, groups, -1))


def dequantized(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """float64 ``[rows, groups * 32]``: the blocks as llama.cpp dequantizes them (gguf's reference)."""
    rows = blocks.shape[0]
    values = gguf.quants.dequantize(blocks.numpy().reshape(rows, -1), gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(values).double().reshape(rows, -1)


def q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's quantize_row_q8_0 rounds it (d = max|x| / 127 in float32, half away from zero), float64."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    scaled = blocks * inv
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (q.double() * d.double()).view_as(x)


@pytest.fixture(scope="module")
def builds() -> dict[str, Kernels]:
    found = {}
    for isa in ISAS:
        path = cpu_gemm.KERNEL_DIR / object_name(isa)
        if path.exists() and set(CPU_FLAGS[isa]) <= cpu_flags():
            found[isa] = Kernels(path, isa)
    return found


def run(kernels: Kernels, packed: cpu_gemm.PackedQ4, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], packed.out_features)
    kernels.q4_matmul(packed.nibbles, packed.scale, packed.mins, packed.bias, x, out)
    return out


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K"])
@pytest.mark.parametrize(("n", "k"), [(64, 512), (18, 1536), (7, 256)])
def test_q4_matches_the_float64_reference_of_its_blocks(builds, kind, n, k):
    blocks = random_blocks(kind, n, k // 32, seed=n + k)
    bias = torch.randn(n)
    packed = cpu_gemm.PackedQ4(kind, blocks, bias)
    x = torch.randn(5, k) * 3
    expected = q8_rounded(x) @ dequantized(kind, blocks).T + bias.double()
    for isa, kernels in builds.items():
        got = run(kernels, packed, x).double()
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= 2e-6 * scale + 1e-6, isa


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K"])
def test_both_builds_give_the_same_bits_at_every_batch_size(builds, kind):
    if len(builds) < 2:
        pytest.skip("this CPU runs one build only")
    blocks = random_blocks(kind, 96, 48, seed=7)  # 1536 columns
    packed = cpu_gemm.PackedQ4(kind, blocks, None)
    x = torch.randn(9, 1536)
    outputs = {isa: run(kernels, packed, x) for isa, kernels in builds.items()}
    avx2, avx512 = outputs["avx2"], outputs["avx512"]
    assert torch.equal(avx2, avx512)
    for kernels in builds.values():
        for i in range(x.shape[0]):  # each row alone: the same bits as in the batch of 9
            assert torch.equal(run(kernels, packed, x[i : i + 1].contiguous())[0], avx2[i])


def test_packing_refuses_what_is_not_q4_blocks():
    with pytest.raises(ValueError, match=r"Q4_1 blocks must be uint8 \[out, in / 32, 20\]"):
        cpu_gemm.PackedQ4("Q4_1", torch.zeros(4, 2, 18, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match=r"Q5_K blocks must be uint8 \[out, in / 256, 176\]"):
        cpu_gemm.PackedQ4("Q5_K", torch.zeros(4, 2, 144, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="Q2_K blocks"):
        cpu_gemm.PackedQ4("Q2_K", torch.zeros(4, 2, 84, dtype=torch.uint8), None)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K"])
def test_blocks_dequantize_as_llama_cpp_does(kind):
    """The file's blocks read (nibbles, fifth bits, the K types' 6-bit scales and minimums: d * scale and
    -dmin * min per block of 32) as gguf's (llama.cpp's reference) dequantization reads them, to the bit."""
    blocks = random_blocks(kind, 6, 32, seed=3)
    reference = gguf.quants.dequantize(blocks.numpy().reshape(6, -1), gguf.GGMLQuantizationType[kind])
    ours = BlockQ4(kind, blocks).dequantize().numpy()
    assert np.array_equal(reference, ours)


def run_q6(kernels: Kernels, packed: cpu_gemm.PackedQ6K, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], packed.out_features)
    kernels.q6k_matmul(packed.bits, packed.scale, packed.d, packed.bias, x, out)
    return out


def test_q6_k_dequantizes_as_llama_cpp_does():
    """The file's Q6_K super-blocks read as gguf's (llama.cpp's reference) dequantize_row_q6_K reads them, to the
    bit, random scales (-128 included) and all."""
    sb = random_q6_k(5, 768, seed=4)
    reference = gguf.quants.dequantize(sb.reshape(5, -1), gguf.GGMLQuantizationType.Q6_K)
    assert np.array_equal(reference, BlockQ6K(torch.from_numpy(sb)).dequantize().numpy())


@pytest.mark.parametrize(("n", "k"), [(64, 512), (18, 1536), (7, 256)])
def test_q6_k_matches_the_float64_reference_of_its_blocks(builds, n, k):
    weight = BlockQ6K(torch.from_numpy(random_q6_k(n, k, seed=n + k)))
    bias = torch.randn(n)
    packed = cpu_gemm.PackedQ6K(*weight.values(), bias)
    x = torch.randn(5, k) * 3
    expected = q8_rounded(x) @ weight.dequantize().double().T + bias.double()
    for isa, kernels in builds.items():
        got = run_q6(kernels, packed, x).double()
        assert (got - expected).abs().max().item() <= 2e-6 * expected.abs().max().item() + 1e-6, isa


def test_q6_k_gives_the_same_bits_in_both_builds_at_every_batch_size(builds):
    if len(builds) < 2:
        pytest.skip("this CPU runs one build only")
    weight = BlockQ6K(torch.from_numpy(random_q6_k(38, 1536, seed=8)))  # 38 rows: a padded last tile
    packed = cpu_gemm.PackedQ6K(*weight.values(), None)
    x = torch.randn(9, 1536)
    outputs = {isa: run_q6(kernels, packed, x) for isa, kernels in builds.items()}
    assert torch.equal(outputs["avx2"], outputs["avx512"])
    for kernels in builds.values():
        for i in range(x.shape[0]):
            assert torch.equal(run_q6(kernels, packed, x[i : i + 1].contiguous())[0], outputs["avx2"][i])


def test_q6_k_refuses_a_width_of_partial_super_blocks():
    q = torch.zeros(4, 288, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not whole super-blocks of 256"):
        cpu_gemm.PackedQ6K(q, torch.zeros(4, 18, dtype=torch.int8), torch.zeros(4, 1), None)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_a_long_prefill_gives_each_row_its_own_bits(builds, kind):
    """Past 64 rows the kernels run blocks of rows against panels of tiles: each row still gets the bits it gets
    alone, in both builds."""
    if kind == "Q6_K":
        weight = BlockQ6K(torch.from_numpy(random_q6_k(70, 512, seed=5)))
        packed = cpu_gemm.PackedQ6K(*weight.values(), None)
        call = run_q6
    else:
        packed = cpu_gemm.PackedQ4(kind, random_blocks(kind, 70, 16, seed=5), None)  # 512 columns
        call = run
    x = torch.randn(150, 512)
    for kernels in builds.values():
        batch = call(kernels, packed, x)
        for i in (0, 63, 64, 101, 149):
            assert torch.equal(call(kernels, packed, x[i : i + 1].contiguous())[0], batch[i])
