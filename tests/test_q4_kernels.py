"""GGUF Q4_0 / Q4_1 / Q4_K and Q6_K weights kept in their blocks (cpu_gemm.c's ts_q4_gemm, ts_q6k_gemm): against a float64 reference of the
dequantized blocks and the Q8_0-rounded activations, the same bits in the AVX2 and AVX-512 builds, and a row's
result independent of the batch it runs in."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tierserve.plugins.backends import cpu_gemm
from tests.gguf_helpers import random_q4_k, random_q6_k
from tierserve.plugins.backends.cpu_gemm_abi import Kernels
from tierserve.plugins.backends.cpu_gemm_builds import CPU_FLAGS, ISAS, cpu_flags, object_name
from tierserve.plugins.backends.linear import BlockQ4, BlockQ6K

pytestmark = pytest.mark.unit

if cpu_gemm.library() is None:
    pytest.skip(f"tierserve's CPU kernels do not run here: {cpu_gemm.unavailable_reason()}", allow_module_level=True)


def random_blocks(kind: str, rows: int, groups: int, seed: int) -> torch.Tensor:
    """uint8 blocks as ``BlockQ4`` holds them: ``[rows, groups, 18|20]``, float16 d (and m) and 16 bytes of
    nibbles as llama.cpp writes Q4_0 / Q4_1, or Q4_K super-blocks ``[rows, groups / 8, 144]``."""
    if kind == "Q4_K":
        return torch.from_numpy(random_q4_k(rows, groups * 32, seed))
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, groups, 1, generator=gen) * 0.02 + 0.001).half()
    parts = [d.view(torch.uint8)]
    if kind == "Q4_1":
        m = ((torch.rand(rows, groups, 1, generator=gen) - 0.5) * 0.2).half()
        parts.append(m.view(torch.uint8))
    parts.append(torch.randint(0, 256, (rows, groups, 16), generator=gen, dtype=torch.uint8))
    return torch.cat(parts, -1)


def dequantized(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """float64 ``[rows, groups * 32]``: w = d * (nibble - 8) (Q4_0) or d * nibble + m (Q4_1, Q4_K)."""
    if kind == "Q4_K":
        return BlockQ4(kind, blocks).dequantize().double()
    d = blocks[..., 0:2].contiguous().view(torch.float16).double()
    qs = blocks[..., -16:].long()
    nibbles = torch.cat([qs & 0xF, qs >> 4], -1).double()  # weight i < 16: low nibble of byte i
    if kind == "Q4_0":
        w = d * (nibbles - 8)
    else:
        w = d * nibbles + blocks[..., 2:4].contiguous().view(torch.float16).double()
    return w.reshape(blocks.shape[0], -1)


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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
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
    with pytest.raises(ValueError, match="Q5_0 blocks"):
        cpu_gemm.PackedQ4("Q5_0", torch.zeros(4, 2, 22, dtype=torch.uint8), None)


def test_q4_k_dequantizes_as_llama_cpp_does():
    """Q4_K's super-blocks read (6-bit scales and minimums unpacked, d * scale and -dmin * min per block of 32)
    as gguf's (llama.cpp's reference) dequantization reads the file's bytes, to the bit."""
    sb = random_q4_k(6, 1024, seed=3)
    reference = gguf.quants.dequantize(sb.reshape(6, -1), gguf.GGMLQuantizationType.Q4_K)
    ours = BlockQ4("Q4_K", torch.from_numpy(sb)).dequantize().numpy()
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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q6_K"])
def test_a_long_prefill_gives_each_row_its_own_bits(builds, kind):
    """Past 64 rows the kernels run blocks of rows against panels of tiles: each row still gets the bits it gets
    alone, in both builds."""
    if kind == "Q6_K":
        weight = BlockQ6K(torch.from_numpy(random_q6_k(70, 512, seed=5)))
        packed = cpu_gemm.PackedQ6K(*weight.values(), None)
        call = run_q6
    else:
        packed = cpu_gemm.PackedQ4(kind, random_blocks(kind, 70, 16, seed=5), None)
        call = run
    x = torch.randn(150, 512)
    for kernels in builds.values():
        batch = call(kernels, packed, x)
        for i in (0, 63, 64, 101, 149):
            assert torch.equal(call(kernels, packed, x[i : i + 1].contiguous())[0], batch[i])
