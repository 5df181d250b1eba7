"""tierserve's own CPU kernels (``cpu_gemm``): each computes what it says, a row's result does not depend on
the rest of the batch, and without a compiler the engine keeps torch's kernels.

The references are computed here in float64 from the same integers and scales: the q8 kernel is
llama.cpp's Q8_0 dot product (activations rounded to int8 per block of 32, exact int32 block sums,
float32 scaling), so it matches to float32 rounding of the block sums' scaling.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from tests.conftest import REPO_ROOT
from tierserve.plugins.backends import cpu_gemm, cpu_gemm_abi
from tierserve.plugins.backends.cpu_gemm_abi import (
    Q8_ROW, DecoderLayer, DecodeShape, KernelArgumentError, KernelLoadError, Kernels, Layer, Projection,
)
from tierserve.plugins.backends.cpu_gemm_builds import CPU_FLAGS, cpu_flags, object_name
from tierserve.plugins.backends.linear import Int8Linear, LinearFactory, quantize_groups, quantize_rows

pytestmark = [pytest.mark.integration, pytest.mark.skipif(
    cpu_gemm.library() is None and not os.environ.get("CI"), reason=f"cpu_gemm: {cpu_gemm.unavailable_reason()}"
)]


def q8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Q8_0 x Q8_0 in float64: ``scale`` per row ``[N]`` or per 32 columns ``[N, K/32]``."""
    blocks = x.shape[1] // 32
    xb = x.double().view(x.shape[0], blocks, 32)
    dx = xb.abs().amax(dim=2) / 127
    inverse = torch.where(dx == 0, torch.zeros_like(dx), 1 / dx.float().double())
    qx = (xb * inverse[:, :, None]).float()
    qx = (qx.sign() * (qx.abs() + 0.5).floor()).double()  # roundf: half away from zero
    sums = torch.einsum("mbi,nbi->mnb", qx, q.double().view(q.shape[0], blocks, 32))
    dw = scale.double() if scale.dim() == 2 else scale.double()[:, None].expand(-1, blocks)
    return (sums * dx.float().double()[:, None, :] * dw[None]).sum(2)


@pytest.mark.parametrize("grouped", [False, True], ids=["per-row", "per-32"])
def test_q8_kernel_is_the_q8_0_dot_product(grouped):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(99, 96, generator=generator) * 0.05  # 99 rows: a partial last tile of 4
    bias = torch.randn(99, generator=generator)
    x = torch.randn(5, 96, generator=generator)
    x[2, 32:64] = 0  # an all-zero block
    if grouped:
        g = quantize_groups(weight)
        q, scale = g.q, g.scale
        layer = Int8Linear(g, bias, "grouped", torch.float32, small_batch=True)
        assert layer.kernel == "grouped-q8"
    else:
        q, scale = quantize_rows(weight)
        layer = Int8Linear(weight, bias, "q8", torch.float32)
    expected = q8_reference(x, q, scale) + bias.double()
    assert torch.allclose(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    alone = layer(x[:1])
    assert torch.equal(layer(torch.cat([x[:1], 1000 * x[1:2]]))[:1], alone)
    assert torch.equal(layer(x)[:1], alone)


def test_auto_int8_runs_q8_for_small_batches_and_fbgemm_above():
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("no fbgemm in this torch build")
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 64, generator=generator) * 0.05
    x = torch.randn(8, 64, generator=generator)
    layer = Int8Linear(weight, None, "fbgemm", torch.float32, small_batch=True)
    q8, fbgemm = Int8Linear(weight, None, "q8", torch.float32), Int8Linear(weight, None, "fbgemm", torch.float32)
    assert torch.equal(layer(x[:4]), q8(x[:4]))
    assert torch.equal(layer(x), fbgemm(x))
    factory = LinearFactory("auto", torch.device("cpu"), torch.float32, "int8")
    assert factory.kernel == "int8-fbgemm+q8"
    assert LinearFactory("torch", torch.device("cpu"), torch.float32, "int8").kernel == "int8-weight_only"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_kernels_compute_the_product_of_the_weights_held(dtype):
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(37, 48, generator=generator) * 0.05).to(dtype)
    bias = torch.randn(37, generator=generator)
    # a bfloat16 model's rows are bfloat16 values (the AVX-512 build's vdpbf16ps takes them as such)
    x = torch.randn(7, 48, generator=generator).to(dtype).float()
    packed = cpu_gemm.PackedFloat(weight, bias)
    expected = x.double() @ weight.double().T + bias.double()
    assert torch.allclose(packed(x).double(), expected, rtol=1e-5, atol=1e-5)
    alone = packed(x[:1])
    assert torch.equal(packed(x)[:1], alone) and torch.equal(packed(x[:2])[:1], alone)
    assert torch.equal(packed(x)[5:6], packed(x[5:6]))  # the odd row, run alone, sums in the same order
    assert packed(x[:0]).shape == (0, 37)  # no rows: an empty result
    if dtype == torch.bfloat16:  # bfloat16 rows (in and out, on the AVX-512 build): the float32 call's rows rounded
        many = torch.randn(29, 48, generator=generator).bfloat16()
        assert torch.equal(packed(many).bfloat16(), packed(many.float()).bfloat16())


def test_avx512_build_gives_the_avx2_builds_q8_and_float32_bits(tmp_path):
    """The AVX-512 build sums a q8 block with vpdpbusd: the same int32 lanes as AVX2's maddubs + madd, so
    the same float32 results to the bit; float32 panels are one multiply-add chain per output element in
    both builds (12 rows a group there, 6 here), so the same bits too (the AVX2 build runs in a subprocess)."""
    if cpu_gemm.isa() != "avx512":
        pytest.skip("this process runs the AVX2 build")
    generator = torch.Generator().manual_seed(11)
    weight, x = torch.randn(70, 128, generator=generator) * 0.05, torch.randn(5, 128, generator=generator)
    bias, many = torch.randn(70, generator=generator), torch.randn(29, 128, generator=generator)
    # a prefill-sized call: the AVX-512 build's per-call activation signs outgrow the buffer a thread keeps
    wide, tall = torch.randn(70, 4096, generator=generator) * 0.05, torch.randn(260, 4096, generator=generator)
    torch.save({"weight": weight, "x": x, "bias": bias, "many": many, "wide": wide, "tall": tall}, tmp_path / "inputs.pt")
    script = (
        "import sys, torch; from tierserve.plugins.backends import cpu_gemm;"
        "from tierserve.plugins.backends.linear import Int8Linear, quantize_groups;"
        "assert cpu_gemm.isa() == 'avx2' and not cpu_gemm.bf16_dot(), cpu_gemm.unavailable_reason();"
        "d = torch.load(sys.argv[1]);"
        "rows = Int8Linear(d['weight'], None, 'q8', torch.float32)(d['x']);"
        "groups = Int8Linear(quantize_groups(d['weight']), None, 'grouped', torch.float32, True)(d['x']);"
        "floats = cpu_gemm.PackedFloat(d['weight'], d['bias'])(d['many']);"
        "tall = Int8Linear(d['wide'], None, 'q8', torch.float32)(d['tall']);"
        "torch.save({'rows': rows, 'groups': groups, 'floats': floats, 'tall': tall}, sys.argv[2])"
    )
    env = {**os.environ, cpu_gemm.ISA_VARIABLE: "avx2"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    avx2 = torch.load(tmp_path / "out.pt")
    assert torch.equal(Int8Linear(weight, None, "q8", torch.float32)(x), avx2["rows"])
    assert torch.equal(Int8Linear(quantize_groups(weight), None, "grouped", torch.float32, True)(x), avx2["groups"])
    assert torch.equal(cpu_gemm.PackedFloat(weight, bias)(many), avx2["floats"])
    assert torch.equal(Int8Linear(wide, None, "q8", torch.float32)(tall), avx2["tall"])


def kernels_only(folder, *isas: str):
    """``folder`` holding copies of this install's builds of ``isas`` (as an install that made only those)."""
    folder.mkdir(exist_ok=True)
    for isa in isas:
        shutil.copy(cpu_gemm.KERNEL_DIR / object_name(isa), folder / object_name(isa))
    return folder


def run_with_kernels_in(folder, script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``script`` in a new interpreter (environment ``env``, else this one's) whose ``cpu_gemm`` loads its
    builds from ``folder``."""
    setup = (
        "from pathlib import Path; from tierserve.plugins.backends import cpu_gemm;"
        f"cpu_gemm.KERNEL_DIR = Path({str(folder)!r});"
    )
    return subprocess.run([sys.executable, "-c", setup + script], env=os.environ if env is None else env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_an_install_without_the_avx512_build_runs_avx2(tmp_path):
    """``auto`` on an AVX-512 CPU where the install could not build the AVX-512 object (a compiler without
    -mavx512bf16): the AVX2 build loads instead (warned), and the fingerprint says avx2."""
    if cpu_gemm.isa() != "avx512":
        pytest.skip("this process runs the AVX2 build")
    script = (
        "import torch; print(cpu_gemm.library() is not None, cpu_gemm.isa(), cpu_gemm.bf16_dot(),"
        "cpu_gemm.fingerprint_tag(torch.device('cpu')))"
    )
    env = {key: value for key, value in os.environ.items() if key != cpu_gemm.ISA_VARIABLE}
    done = run_with_kernels_in(kernels_only(tmp_path / "kernels", "avx2"), script, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "avx2", "False", f"/cpu-gemm-avx2-v{cpu_gemm.KERNEL_VERSION}"]
    assert "cpu_gemm_avx512_not_built" in done.stderr


def test_a_compiler_without_avx512_bf16_still_builds_the_avx2_kernels(tmp_path):
    """``setup.py`` with a compiler that refuses -mavx512bf16: the AVX2 object is built, the AVX-512 one is
    left out with a warning, and the build succeeds (the install goes on)."""
    compiler = tmp_path / "old-cc"
    compiler.write_text('#!/bin/sh\ncase "$*" in *-mavx512bf16*) echo "unrecognized option" >&2; exit 1;; esac\nexec cc "$@"\n')
    compiler.chmod(0o755)
    out, temp = tmp_path / "lib", tmp_path / "temp"
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(out), "--build-temp", str(temp)],
        cwd=REPO_ROOT, env={**os.environ, "CC": str(compiler)}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    built = sorted(path.name for path in out.rglob("*.so"))
    assert built == [object_name("avx2")]
    assert "_cpu_gemm_avx512" in done.stdout + done.stderr and "failed" in done.stdout + done.stderr


def test_an_unknown_isa_is_refused_with_the_allowed_values():
    script = "from tierserve.plugins.backends import cpu_gemm; print(cpu_gemm.library(), cpu_gemm.unavailable_reason())"
    env = {**os.environ, cpu_gemm.ISA_VARIABLE: "sse9"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "None TIERSERVE_CPU_GEMM_ISA: got 'sse9', allowed: auto, avx2, avx512" in done.stdout


def test_float32_weights_run_the_panel_kernel_on_avx512_at_every_batch_size():
    """``auto`` float32 on the AVX-512 build: tierserve's panels (no oneDNN copy held); a row's result is the
    same bits alone, in a decode batch and in a prefill-sized call (rows split into groups of up to 12)."""
    factory = LinearFactory("auto", torch.device("cpu"), torch.float32)
    if not cpu_gemm.float_panels():
        assert factory.kernel in ("onednn", "torch")
        return
    assert factory.kernel == "f32-panels"
    generator = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(100, 64, generator=generator) * 0.05, torch.randn(100, generator=generator)
    layer = factory(weight, bias)
    assert layer.own is not None and layer.weight is layer.own.weight  # one copy of the weight
    x = torch.randn(300, 64, generator=generator)
    full = layer(x)
    assert torch.allclose(full.double(), x.double() @ weight.double().T + bias.double(), rtol=1e-5, atol=1e-5)
    for rows in (1, 4, 13, 32, 299):
        assert torch.equal(layer(x[-rows:]), full[-rows:]), rows
    assert torch.equal(cpu_gemm.PackedFloat(weight, None).unpacked(), weight)


def test_bfloat16_weights_run_the_own_kernel_where_onednn_lacks_them():
    factory = LinearFactory("auto", torch.device("cpu"), torch.bfloat16)
    from tierserve.plugins.backends.linear import _onednn_available

    if cpu_gemm.bf16_dot():
        assert factory.kernel == "bf16-panels"
    elif _onednn_available(torch.device("cpu"), torch.bfloat16):
        assert factory.kernel == "onednn"
    else:
        assert factory.kernel.startswith("bf16-avx2")
        layer = factory(torch.randn(16, 32).to(torch.bfloat16))
        assert layer(torch.randn(2, 32).to(torch.bfloat16)).dtype == torch.bfloat16
    assert LinearFactory("torch", torch.device("cpu"), torch.bfloat16).kernel == "torch"


def test_bfloat16_panels_give_a_row_the_same_bits_at_every_batch_size():
    """The AVX-512 build runs bfloat16 weights on vdpbf16ps panels at every size (one copy held): a row's
    bits are the same alone, in a decode batch and in a prefill-sized call, and the product is the
    bfloat16 weights' (within float32 summation order, then bfloat16 rounding)."""
    factory = LinearFactory("auto", torch.device("cpu"), torch.bfloat16)
    if factory.kernel != "bf16-panels":
        pytest.skip("no AVX512-BF16 panel kernel on this CPU")
    generator = torch.Generator().manual_seed(6)
    weight = (torch.randn(70, 96, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(70, generator=generator).bfloat16()
    layer = factory(weight, bias)
    assert layer.weight is layer.own.weight and torch.equal(layer.own.unpacked(), weight.float())
    x = torch.randn(300, 96, generator=generator).bfloat16()
    full = layer(x)
    expected = (x.double() @ weight.double().T + bias.double()).bfloat16().float()
    assert torch.allclose(full.float(), expected, rtol=1e-2, atol=1e-2)
    for rows in (1, 3, 4, 13, 32, 299):
        assert torch.equal(layer(x[-rows:]), full[-rows:]), rows


def test_bfloat16_prefill_chunks_run_onednn_on_the_widened_weight():
    """From WIDE_ROWS rows a bf16-avx2 layer runs oneDNN's float32 GEMM on its weight widened for the call:
    the product of the same bfloat16 weights (within float32 summation order of the kernel's result)."""
    from tierserve.plugins.backends.linear import WIDE_ROWS, _onednn_available

    factory = LinearFactory("auto", torch.device("cpu"), torch.bfloat16)
    if not factory.kernel.startswith("bf16-avx2"):
        pytest.skip("bfloat16 matmuls do not run bf16-avx2 on this CPU")
    assert factory.kernel.endswith("+onednn-f32") == _onednn_available(torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(37, 64, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(37, generator=generator).bfloat16()
    layer = factory(weight, bias)
    assert torch.equal(layer.own.unpacked(), weight.float())
    x = torch.randn(WIDE_ROWS + 3, 64, generator=generator).bfloat16()
    expected = (x.double() @ weight.double().T + bias.double()).bfloat16()
    wide, kernel = layer(x), layer(x[:WIDE_ROWS - 1])
    assert wide.dtype == torch.bfloat16 and torch.allclose(wide.float(), expected.float(), rtol=1e-2, atol=1e-2)
    differing = (wide[: WIDE_ROWS - 1] != kernel).float().mean()  # bfloat16 rounding of two float32 sum orders
    assert differing < 0.05, differing


def test_without_the_built_kernels_torch_kernels_run(tmp_path):
    """An install that built no kernels (no C compiler then): the library is not loaded, the log and
    ``unavailable_reason()`` say why and what to do, and int8 and bfloat16 layers fall back to torch's kernels."""
    script = (
        "import torch; from tierserve.plugins.backends.linear import LinearFactory;"
        "assert cpu_gemm.library() is None; print(cpu_gemm.unavailable_reason());"
        "print(LinearFactory('auto', torch.device('cpu'), torch.float32, 'int8').kernel);"
        "print(LinearFactory('auto', torch.device('cpu'), torch.bfloat16).kernel)"
    )
    result = run_with_kernels_in(kernels_only(tmp_path / "kernels"), script)
    assert result.returncode == 0, result.stderr
    reason, int8_kernel, bf16_kernel = result.stdout.strip().splitlines()
    assert "kernels were not built" in reason and "install gcc and reinstall tierserve" in reason
    assert "cpu_gemm_unavailable" in result.stderr
    assert "+q8" not in int8_kernel and bf16_kernel in ("onednn", "torch")


def test_loading_the_kernels_compiles_nothing(tmp_path):
    """The first use of the kernels loads the objects the install built: with no compiler on the path and
    an empty cache directory, they load and compute, and nothing is written to the cache."""
    cache, empty = tmp_path / "cache", tmp_path / "no-compilers"
    empty.mkdir()
    script = (
        "import torch; from tierserve.plugins.backends import cpu_gemm;"
        "layer = cpu_gemm.PackedQ8(torch.ones(8, 32, dtype=torch.int8), torch.ones(8), None);"
        "print(cpu_gemm.library().isa, layer(torch.ones(1, 32))[0, 0].item())"
    )
    env = {**os.environ, "PATH": str(empty), "CC": "false", "TIERSERVE_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [cpu_gemm.isa(), "32.0"]
    assert not cache.exists() or not any(cache.rglob("*"))


def test_elementwise_kernels_match_torch():
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 40, generator=generator) * 3  # q_norm's shape: [tokens, heads, head_dim], 40: a tail of 8
    weight = torch.randn(40, generator=generator)
    expected = torch.nn.functional.rms_norm(x, (40,), weight, 1e-6)
    assert torch.allclose(cpu_gemm.rms_norm(x, weight, 1e-6), expected, rtol=1e-5, atol=1e-6)
    assert cpu_gemm.rms_norm(torch.randn(200, 40), weight, 1e-6) is None  # a prefill: torch's op
    rows = torch.randn(cpu_gemm.LOOP_NORM_ELEMENTS // 40, 40, generator=generator)  # the layer loop allows more
    loop = cpu_gemm.rms_norm(rows, weight, 1e-6, max_elements=cpu_gemm.LOOP_NORM_ELEMENTS)
    assert torch.allclose(loop, torch.nn.functional.rms_norm(rows, (40,), weight, 1e-6), rtol=1e-5, atol=1e-6)
    more = torch.cat([rows, rows[:1]])
    assert cpu_gemm.rms_norm(more, weight, 1e-6, max_elements=cpu_gemm.LOOP_NORM_ELEMENTS) is None
    # decode rows; prefill rows, shared among the threads; 42 columns: a tail of 2; 150: bfloat16 spans of 64 and 22
    for rows, width in ((2, 84), (37, 84), (5, 300)):
        gate_up = torch.randn(rows, width, generator=generator) * 4
        gate_up[0, :4] = torch.tensor([-100.0, -87.5, 60.0, 0.0])  # clamped exponents, and zero
        gate, up = gate_up.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate.double()) * up.double()
        assert torch.allclose(cpu_gemm.silu_mul(gate_up).double(), expected, rtol=1e-6, atol=1e-7)
        bf16 = gate_up.bfloat16()
        gate, up = bf16.chunk(2, dim=-1)
        assert torch.equal(cpu_gemm.silu_mul(bf16), (torch.nn.functional.silu(gate.float()).bfloat16() * up))
    assert cpu_gemm.silu_mul(gate_up.double()) is None


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [4, 16])  # 16: positions also run eight at a time
def test_decode_attention_reads_the_blocks_in_place(kv_dtype, block):
    """Three sequences of different lengths through scattered blocks, one with positions masked (a sliding
    window), against softmax attention over the gathered keys and values; asked for it, each row's
    log-sum-exp of its scaled scores too, with the same output."""
    generator = torch.Generator().manual_seed(5)
    kv_heads, head_dim = 2, 16
    keys = torch.randn(12 * block, kv_heads, head_dim, generator=generator).to(kv_dtype)
    values = torch.randn(12 * block, kv_heads, head_dim, generator=generator).to(kv_dtype)
    q = torch.randn(3, 6, head_dim, generator=generator)
    blocks = torch.tensor([[7, 2, 9], [0, 11, 3], [5, 1, 0]])
    ctx = 3 * block - 1
    lengths = [ctx, ctx - 2, 3]
    mask = torch.zeros(3, 1, 1, ctx, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, ..., :n] = True
    mask[0, ..., : block + 3] = False  # outside a window
    out = cpu_gemm.decode_attention(q, keys, values, blocks, block, ctx, mask, 0.25)
    again, lse = cpu_gemm.decode_attention(q, keys, values, blocks, block, ctx, mask, 0.25, with_lse=True)
    assert torch.equal(again, out) and lse.shape == (3, 6)
    for row in range(3):
        slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in blocks[row].tolist()])[:ctx]
        keep = mask[row, 0, 0]
        k, v = keys[slots][keep].float(), values[slots][keep].float()  # [n, kv_heads, d]
        for head in range(6):
            kv = head // 3
            scores = k[:, kv] @ q[row, head] * 0.25
            weights = torch.softmax(scores, dim=0)
            assert torch.allclose(out[row, head], weights @ v[:, kv], rtol=1e-5, atol=1e-5)
            assert torch.allclose(lse[row, head], torch.logsumexp(scores, dim=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_of_a_row_does_not_depend_on_its_batch(kv_dtype):
    """A sequence of 20 tokens alone, and next to one of 40 (so the call reads 40 positions, the first
    row's last 20 masked): the same bits, whatever the 16-token blocks' fill."""
    generator = torch.Generator().manual_seed(6)
    keys = torch.randn(8 * 16, 4, 64, generator=generator).to(kv_dtype)
    values = torch.randn(8 * 16, 4, 64, generator=generator).to(kv_dtype)
    q = torch.randn(2, 12, 64, generator=generator)
    blocks = torch.tensor([[5, 1, 0], [2, 7, 3]])
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., 20:] = False
    alone = cpu_gemm.decode_attention(q[:1], keys, values, blocks[:1, :2], 16, 20, None, 0.125)
    batched = cpu_gemm.decode_attention(q, keys, values, blocks, 16, 40, mask, 0.125)
    assert torch.equal(batched[:1], alone)


def test_memory_estimate_counts_the_small_batch_copy(tmp_path):
    """``auto`` int8 holds the q8 kernel's copy next to fbgemm's (bfloat16 one copy, whichever kernel): the
    pre-load estimate says so."""
    from tests.engine_helpers import build_checkpoint
    from tierserve.settings.config import load_settings
    from tierserve.server.model_memory import estimate_memory

    path = build_checkpoint(tmp_path, "llama", "llama")
    estimates = {}
    for kernel in ("auto", "torch"):
        overrides = {("model", "path"): str(path), ("model", "quantization"): "int8", ("model", "device"): "cpu",
                     ("plugins.native", "linear_kernel"): kernel}  # fmt: skip
        estimates[kernel] = estimate_memory(load_settings(None, environ={}, overrides=overrides).settings).weight_bytes
    assert estimates["auto"] == 2 * estimates["torch"]
    bf16 = {}
    for kernel in ("auto", "torch"):
        overrides = {("model", "path"): str(path), ("model", "dtype"): "bfloat16", ("model", "device"): "cpu",
                     ("plugins.native", "linear_kernel"): kernel}  # fmt: skip
        bf16[kernel] = estimate_memory(load_settings(None, environ={}, overrides=overrides).settings).weight_bytes
    assert bf16["auto"] == bf16["torch"]  # one copy: panels replaced oneDNN's next to the dot kernel's


def test_torch_kernels_are_used_throughout_when_asked(tmp_path):
    """``linear_kernel = "torch"``: no tierserve kernel runs, and the fingerprint says which set computed."""
    from tests.engine_helpers import build_checkpoint
    from tierserve.plugins.backends.native import NativeBackend
    from tierserve.settings.config import load_settings

    path = build_checkpoint(tmp_path, "llama", "llama")
    backends = {}
    for kernel in ("auto", "torch"):
        overrides = {("model", "path"): str(path), ("model", "device"): "cpu", ("plugins.native", "linear_kernel"): kernel}
        backends[kernel] = NativeBackend(load_settings(None, environ={}, overrides=overrides).settings)
    assert backends["torch"].model.own_kernels is False and backends["torch"].model.arena.own_kernels is False
    assert backends["auto"].model.arena.own_kernels is True
    assert backends["auto"].fingerprint != backends["torch"].fingerprint


def record_steps(model) -> tuple[list[torch.Tensor], list[tuple[bool, bool]]]:
    """Wrap ``model``'s forward and fused call (white-box): every forward's logits, and for each fused call
    whether it computed the step and whether that step's rows read a shared prefix."""
    fused = model.fused_decode
    logits: list[torch.Tensor] = []
    calls: list[tuple[bool, bool]] = []
    forward, run = model.forward, fused.run

    def recording_forward(batch):
        out = forward(batch)
        logits.append(out[0].clone())
        return out

    def counted_run(batch):
        hidden = run(batch)
        calls.append((hidden is not None, batch.groups[0].shared is not None))
        return hidden

    model.forward, fused.run = recording_forward, counted_run
    return logits, calls


def fused_and_layer_loop_logits(engine, prompts: list[str], steps: int = 12) -> tuple[list, list, int]:
    """Every step's logits of one greedy batch decoded with the fused decode (``ts_decode_layers``) and
    again through the Python layer loop, and how many steps the fused call computed (the engine should not
    cache prefixes: the second run would prefill differently)."""
    from tierserve.core.sampling_params import SamplingParams

    model = engine.driver.core.backend.model  # white-box: the stack each step runs
    assert model.fused_decode is not None
    logits, calls = record_steps(model)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    try:
        engine.generate(prompts, params)
        with_fused = logits[:]
        logits.clear()
        model.fused_decode = None
        engine.generate(prompts, params)
    finally:
        engine.close()
    return with_fused, logits, sum(ran for ran, _ in calls)


@pytest.mark.parametrize(
    ("architecture", "options"),
    [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 8}),
     ("llama", {"kv_cache__dtype": "bfloat16"}), ("llama", {"model__dtype": "bfloat16"}),
     ("qwen3", {"model__dtype": "bfloat16"}), ("mistral", {"sliding_window": 8, "model__dtype": "bfloat16"}),
     ("llama", {"model__dtype": "float32"}), ("qwen2", {"model__dtype": "float32"}),
     ("qwen3", {"model__dtype": "float32"}), ("llama", {"model__dtype": "float32", "kv_cache__dtype": "bfloat16"})],
    ids=["llama", "qwen2-qkv-bias", "qwen3-qk-norm", "mistral-window-8", "bfloat16-kv", "bf16-llama", "bf16-qwen3",
         "bf16-mistral-window-8", "f32-llama", "f32-qwen2-qkv-bias", "f32-qwen3-qk-norm", "f32-bfloat16-kv"],
)  # fmt: skip
def test_fused_decode_equals_the_layer_loop(tmp_path, architecture, options):
    """Decodes whose matrices all run tierserve's kernels (int8 weights on q8; bfloat16 weights on
    bf16-avx2 or bf16-panels; float32 weights on f32-panels, the AVX-512 build) run every layer in one C
    call: each step's logits are the Python layer loop's to the bit (the same kernels, RoPE, roundings and
    residual adds in the same order)."""
    from tests.engine_helpers import PROMPTS, build_checkpoint, make_engine

    window = {"sliding_window": options["sliding_window"]} if "sliding_window" in options else {}
    settings = {key: value for key, value in options.items() if "__" in key}
    if "model__dtype" not in settings:
        settings["model__quantization"] = "int8"
    path = build_checkpoint(tmp_path, architecture, architecture, **window)
    engine = make_engine(path, kv_cache__enable_prefix_caching=False, **settings)
    if engine.driver.core.backend.model.fused_decode is None:
        engine.close()
        assert engine.info.linear_kernel == "onednn"  # float32 (AVX2 build) or bfloat16 prepacked by oneDNN
        pytest.skip("these matmuls run oneDNN on this CPU")
    fused, loop, fused_steps = fused_and_layer_loop_logits(engine, PROMPTS[:3])
    assert fused_steps == 11  # every decode step; the prefill runs the layer loop
    assert len(fused) == len(loop) == 12
    for step, (a, b) in enumerate(zip(fused, loop)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_of_many_rows_equals_the_layer_loop(tmp_path, dtype):
    """Float panels run the fused decode up to NORM_ROWS rows (the rows split among the threads for the
    norms, RoPE and residual adds): 27 sequences of different lengths (three panel row groups, uneven) get
    the layer loop's logits to the bit; 65 sequences keep the layer loop."""
    from tests.engine_helpers import build_checkpoint, make_engine

    path = build_checkpoint(tmp_path, "llama", "llama")
    engine = make_engine(path, kv_cache__enable_prefix_caching=False, model__dtype=dtype)
    if engine.driver.core.backend.model.fused_decode is None:
        engine.close()
        pytest.skip("these matmuls run oneDNN on this CPU")
    prompts = [[5 + (i * 13 + j * 7) % 150 for j in range(3 + i % 11)] for i in range(27)]
    fused, loop, fused_steps = fused_and_layer_loop_logits(engine, prompts, steps=5)
    assert fused_steps == 4 and len(fused) == len(loop) == 5
    for step, (a, b) in enumerate(zip(fused, loop)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"
    engine = make_engine(path, kv_cache__enable_prefix_caching=False, model__dtype=dtype, scheduler__max_num_seqs=96)
    many = [[5 + (i * 13 + j * 7) % 150 for j in range(4)] for i in range(cpu_gemm.NORM_ROWS + 1)]
    fused, loop, fused_steps = fused_and_layer_loop_logits(engine, many, steps=2)
    assert fused_steps == 0 and all(torch.equal(a, b) for a, b in zip(fused, loop))


@pytest.mark.parametrize(
    "options",
    [{"model__quantization": "int8"}, {"model__dtype": "bfloat16"}, {"model__dtype": "float32"},
     {"model__dtype": "float32", "kv_cache__dtype": "bfloat16"}, {"model__quantization": "int8", "kv_cache__dtype": "bfloat16"}],
    ids=["int8", "bf16", "f32", "f32-bfloat16-kv", "int8-bfloat16-kv"],
)  # fmt: skip
def test_fused_decode_reads_a_shared_prefix_once_and_equals_the_layer_loop(tmp_path, options):
    """Sequences that share a cached prefix decode in one fused call that reads the prefix once for all rows
    (the AVX-512 build): each step's logits are the layer loop's (which reads it once too) to the bit, at
    every weight and KV precision, while the rows' own parts have different lengths."""
    from tierserve.core.sampling_params import SamplingParams
    from tests.engine_helpers import build_checkpoint, make_engine

    path = build_checkpoint(tmp_path, "llama", "llama")
    engine = make_engine(path, **options)
    model = engine.driver.core.backend.model
    fused = model.fused_decode
    if fused is None or not fused.prefill_attention:
        engine.close()
        pytest.skip("the fused decode of a shared prefix runs on the AVX-512 build's own kernels only")
    prefix = [5 + (i * 11) % 150 for i in range(100)]  # 6 whole blocks of 16 shared
    prompts = [prefix + [7 + i + j for j in range(2 + 3 * i)] for i in range(4)]
    logits, calls = record_steps(model)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = []
    try:
        for salt, stack in (("fused", fused), ("layer-loop", None)):  # a salt each: both prefill the same
            model.fused_decode = stack
            logits.clear()
            engine.warm([prefix], cache_salt=salt)
            logits.clear()
            engine.generate(prompts, params, cache_salt=salt)
            runs.append(logits[:])
    finally:
        engine.close()
    assert sum(ran and shared for ran, shared in calls) == 9  # every decode step after the prefill, fused
    with_fused, loop = runs
    assert len(with_fused) == len(loop) == 10
    for step, (a, b) in enumerate(zip(with_fused, loop)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"


def test_fused_decode_runs_only_plain_few_row_decodes(tmp_path):
    """Five int8 sequences (above the q8 kernel's batch: fbgemm runs them) and oneDNN's float32 weights keep
    the layer loop."""
    from tests.engine_helpers import PROMPTS, build_checkpoint, make_engine

    path = build_checkpoint(tmp_path, "llama", "llama")
    engine = make_engine(path, model__quantization="int8", kv_cache__enable_prefix_caching=False)
    fused, loop, fused_steps = fused_and_layer_loop_logits(engine, (PROMPTS * 2)[:5], steps=4)
    assert fused_steps == 0 and all(torch.equal(a, b) for a, b in zip(fused, loop))
    engine = make_engine(path, plugins__native__linear_kernel="onednn")
    try:
        assert engine.driver.core.backend.model.fused_decode is None
    finally:
        engine.close()


def test_fused_decode_keeps_equal_as_the_context_outgrows_its_scratch(tmp_path):
    """The fused call's scratch is kept between steps and grown when a step's context needs more (it is
    sized in steps of 1024 positions): a sequence whose context passes 1024 while it decodes, next to a
    short one, still gets the layer loop's logits to the bit at every step."""
    from tests.engine_helpers import build_checkpoint, make_engine

    path = build_checkpoint(tmp_path, "llama", "llama", max_position_embeddings=2048)
    engine = make_engine(path, model__quantization="int8", kv_cache__enable_prefix_caching=False)
    long_prompt = [5 + (i * 7) % 150 for i in range(1018)]  # 1019-1030 positions over the decode
    fused, loop, fused_steps = fused_and_layer_loop_logits(engine, [long_prompt, [5, 6, 7]], steps=12)
    assert fused_steps == 11
    for step, (a, b) in enumerate(zip(fused, loop)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"


def prefill_reference(q, keys, values, table, block, ctx, keep, scale):
    """Softmax attention in float64 of one sequence's queries ``[Q, heads, d]`` over its gathered positions."""
    slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in table.tolist()])[:ctx]
    k, v = keys[slots].double(), values[slots].double()  # [ctx, kv_heads, d]
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,chd->hqc", q.double(), k.repeat_interleave(group, dim=1)) * scale
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.einsum("hqc,chd->qhd", weights, v.repeat_interleave(group, dim=1))


def prefill_attention_or_skip(*args):
    out = cpu_gemm.prefill_attention(*args)
    if out is None:
        pytest.skip("prefill attention runs on the AVX-512 build only")
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("queries", "heads", "kv_heads", "head_dim", "ctx"),
    [(75, 12, 4, 64, 300), (20, 14, 2, 64, 83), (9, 4, 4, 48, 140), (33, 6, 1, 16, 33), (5, 8, 2, 128, 70)],
)
def test_prefill_attention_reads_the_blocks_in_place(kv_dtype, queries, heads, kv_heads, head_dim, ctx):
    """A chunk of queries after a cached prefix, through scattered blocks: causal (the queries the last
    positions), and with a mask (a sliding window and a dropped span), against softmax in float64."""
    generator = torch.Generator().manual_seed(queries)
    block, num_blocks = 16, 40
    keys = torch.randn(num_blocks * block, kv_heads, head_dim, generator=generator).to(kv_dtype)
    values = torch.randn(num_blocks * block, kv_heads, head_dim, generator=generator).to(kv_dtype)
    table = torch.randperm(num_blocks, generator=generator)[: -(-ctx // block)]
    q = torch.randn(queries, heads, head_dim, generator=generator)
    positions = torch.arange(ctx)
    own = torch.arange(ctx - queries, ctx)[:, None]
    causal = positions[None] <= own
    windowed = causal & (positions[None] > own - 40) | (positions[None] < 4)  # a window, plus sink tokens
    windowed[:, 6:9] = False
    for keep, mask in ((causal, None), (windowed, windowed[None, None])):
        out = prefill_attention_or_skip(q, keys, values, table[None], block, ctx, mask, head_dim**-0.5)
        expected = prefill_reference(q, keys, values, table, block, ctx, keep, head_dim**-0.5)
        assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("queries", "heads", "kv_heads", "head_dim", "ctx"),
    [(75, 12, 4, 64, 300), (20, 14, 2, 64, 83), (9, 4, 4, 48, 140), (33, 6, 1, 16, 33), (5, 8, 2, 128, 71)],
)
def test_prefill_attention_of_a_bfloat16_model_multiplies_in_bfloat16(queries, heads, kv_heads, head_dim, ctx):
    """bfloat16 queries on bfloat16 keys and values (vdpbf16ps; the weights rounded to bfloat16 for the
    values): within bfloat16's rounding of float64 softmax on the same inputs, causal and masked, and a row's
    bits the same alone as in a longer call."""
    generator = torch.Generator().manual_seed(queries + 1)
    block, num_blocks = 16, 40
    keys = torch.randn(num_blocks * block, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    values = torch.randn(num_blocks * block, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=generator)[: -(-ctx // block)]
    q = torch.randn(queries, heads, head_dim, generator=generator).to(torch.bfloat16)
    positions = torch.arange(ctx)
    own = torch.arange(ctx - queries, ctx)[:, None]
    causal = positions[None] <= own
    windowed = causal & (positions[None] > own - 40) | (positions[None] < 4)
    windowed[:, 6:9] = False
    for keep, mask in ((causal, None), (windowed, windowed[None, None])):
        out = prefill_attention_or_skip(q, keys, values, table[None], block, ctx, mask, head_dim**-0.5)
        assert out.dtype == torch.bfloat16
        expected = prefill_reference(q.float(), keys, values, table, block, ctx, keep, head_dim**-0.5)
        assert torch.allclose(out.double(), expected, rtol=2e-2, atol=1e-2)
        assert float((out.double() - expected).abs().mean()) < 1e-3
    whole = prefill_attention_or_skip(q, keys, values, table[None], block, ctx, None, head_dim**-0.5)
    last = prefill_attention_or_skip(q[-1:], keys, values, table[None], block, ctx, None, head_dim**-0.5)
    assert torch.equal(last[0], whole[-1])  # the last query sees every position either way


def test_prefill_attention_rounds_float32_queries_on_bfloat16_kv_when_asked():
    """``round_queries`` (prompt rows of a float32 model with ``kv_cache.dtype = "bfloat16"``): float32
    output within bfloat16's rounding of float64 softmax, the same as queries rounded beforehand; without
    it float32 queries keep float32 products (1e-5). The cache fingerprint names the rounding."""
    generator = torch.Generator().manual_seed(21)
    block, ctx, queries = 16, 300, 75
    keys = torch.randn(40 * block, 4, 64, generator=generator).to(torch.bfloat16)
    values = torch.randn(40 * block, 4, 64, generator=generator).to(torch.bfloat16)
    table = torch.randperm(40, generator=generator)[: -(-ctx // block)]
    q = torch.randn(queries, 12, 64, generator=generator)
    keep = torch.arange(ctx)[None] <= torch.arange(ctx - queries, ctx)[:, None]
    expected = prefill_reference(q, keys, values, table, block, ctx, keep, 0.125)
    rounded = cpu_gemm.prefill_attention(q, keys, values, table[None], block, ctx, None, 0.125, round_queries=True)
    if rounded is None:
        pytest.skip("prefill attention runs on the AVX-512 build only")
    assert rounded.dtype == torch.float32
    assert torch.allclose(rounded.double(), expected, rtol=2e-2, atol=1e-2)
    assert float((rounded.double() - expected).abs().mean()) < 1e-3
    beforehand = q.to(torch.bfloat16).float()
    again = cpu_gemm.prefill_attention(beforehand, keys, values, table[None], block, ctx, None, 0.125, round_queries=True)
    assert torch.equal(again, rounded)
    plain = cpu_gemm.prefill_attention(q, keys, values, table[None], block, ctx, None, 0.125)
    assert torch.allclose(plain.double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(plain, rounded)
    cpu = torch.device("cpu")
    named = cpu_gemm.fingerprint_tag(cpu, torch.float32, torch.bfloat16)
    assert named.endswith("/bf16-prompt-attention")
    assert named != cpu_gemm.fingerprint_tag(cpu, torch.float32, torch.float32)
    assert not cpu_gemm.fingerprint_tag(cpu, torch.bfloat16, torch.bfloat16).endswith("attention")


def test_prefill_attention_of_a_row_depends_on_nothing_but_its_own_positions():
    """A sequence's queries alone (causal, no mask) and next to a longer one (one call for both, the masks
    saying who sees what): the same bits, and the causal path gives the masked path's."""
    generator = torch.Generator().manual_seed(8)
    keys = torch.randn(30 * 16, 4, 64, generator=generator)
    values = torch.randn(30 * 16, 4, 64, generator=generator)
    q = torch.randn(2 * 40, 12, 64, generator=generator)
    tables = torch.tensor([list(range(0, 14)), list(range(14, 28))])
    alone = prefill_attention_or_skip(q[:40], keys, values, tables[:1, :8], 16, 120, None, 0.125)
    causal = torch.arange(120)[None] <= torch.arange(80, 120)[:, None]
    same = prefill_attention_or_skip(q[:40], keys, values, tables[:1, :8], 16, 120, causal, 0.125)
    assert torch.equal(same, alone)
    mask = torch.zeros(2, 40, 220, dtype=torch.bool)
    mask[0, :, :120] = causal
    mask[1] = torch.arange(220)[None] <= torch.arange(180, 220)[:, None]
    batched = prefill_attention_or_skip(q, keys, values, tables, 16, 220, mask, 0.125)
    assert torch.equal(batched[:40], alone)


def test_prefill_attention_over_a_shared_prefix_gives_each_rows_log_sum_exp():
    """Decode rows of several conversations as the queries of one call over their common prefix (no causal
    limit, every row sees it all): the output and each row's log-sum-exp, as ``merge_attention`` needs
    them, against float64; a row's result is the same when it is computed alone."""
    generator = torch.Generator().manual_seed(11)
    block, ctx = 16, 200
    keys = torch.randn(20 * block, 2, 64, generator=generator)
    values = torch.randn(20 * block, 2, 64, generator=generator)
    table = torch.arange(3, 3 + -(-ctx // block))
    q = torch.randn(7, 14, 64, generator=generator)
    found = cpu_gemm.prefill_attention(q, keys, values, table[None], block, ctx, None, 0.125, False, True)
    if found is None:
        pytest.skip("prefill attention runs on the AVX-512 build only")
    out, lse = found
    keep = torch.ones(7, ctx, dtype=torch.bool)
    assert torch.allclose(out.double(), prefill_reference(q, keys, values, table, block, ctx, keep, 0.125), atol=1e-5)
    slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in table.tolist()])[:ctx]
    scores = torch.einsum("qhd,chd->qhc", q.double(), keys[slots].double().repeat_interleave(7, dim=1)) * 0.125
    assert lse.shape == (7, 14)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, dim=-1), atol=1e-5)
    alone, alone_lse = cpu_gemm.prefill_attention(q[2:3], keys, values, table[None], block, ctx, None, 0.125,
                                                  False, True)  # fmt: skip
    assert torch.equal(alone[0], out[2]) and torch.equal(alone_lse[0], lse[2])


def test_fbgemm_input_rows_are_torchs_to_the_bit():
    """``unit_rows`` (one C pass) builds what Int8Linear's fbgemm path built with torch's ops: each row over
    its largest |x| (a zero row over 1e-12, a NaN row NaN), the (1, -1, 0...) row below, the divisors."""
    if cpu_gemm.library() is None:
        pytest.skip("tierserve's CPU kernels are not built here")
    generator = torch.Generator().manual_seed(5)
    for rows, width in ((1, 768), (7, 100), (72, 3072)):
        x = torch.randn(rows, width, generator=generator) * torch.rand(rows, 1, generator=generator) * 30
        if rows > 3:
            x[1], x[2], x[3, 4] = 0.0, 1e-20, float("nan")
        span = torch.zeros(1, width)
        span[0, :2] = torch.tensor([1.0, -1.0])
        norms = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
        expected = torch.cat([x / norms, span])
        out, found = cpu_gemm.unit_rows(x)
        assert torch.equal(found.isnan(), norms.isnan()) and torch.equal(found.nan_to_num(), norms.nan_to_num())
        assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.nan_to_num(), expected.nan_to_num())
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return  # the rows are checked; no fbgemm layer to run them
    weight = torch.randn(96, 100, generator=generator) * 0.02
    layer = Int8Linear(weight, None, "fbgemm", torch.float32)
    x = torch.randn(9, 100, generator=generator)
    norms = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
    by_torch = layer.op(torch.cat([x / norms, layer.span]), layer.weight, True)[:-1].mul_(norms)
    assert torch.equal(layer(x), by_torch)


def pattern(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    """Float32 values in [-scale, scale) from integer hashing: the same inputs on every torch version (its
    random generators promise no such thing)."""
    i = torch.arange(math.prod(shape), dtype=torch.int64) + seed * 1_000_003
    h = (i * 1103515245 + 12345) & 0x7FFFFFFF
    h = ((h ^ (h >> 13)) * 1664525 + 1013904223) & 0x7FFFFFFF
    h = h ^ (h >> 16)
    return ((h.double() / 2**31 - 0.5) * (2 * scale)).float().view(shape)


def int8s(seed: int, *shape: int) -> torch.Tensor:
    return (pattern(seed, *shape) * 127).round().to(torch.int8)


def digest(*tensors: torch.Tensor) -> str:
    """The first 16 hex digits of the sha256 of the tensors' bytes."""
    hashed = hashlib.sha256()
    for tensor in tensors:
        hashed.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()[:16]


def fused_decode_digest(dtype: torch.dtype, kv_dtype: torch.dtype, shared: bool) -> str:
    """Three rows through two layers of ``ts_decode_layers`` (float32: q8 and panel projections mixed, a
    qkv bias, q/k norms, a masked layer; bfloat16: the bfloat16 kernel throughout; ``shared``: a prefix every
    row shares, read once): the hidden rows after it and the arena it wrote."""
    shape = DecodeShape(hidden_size=64, heads=4, kv_heads=2, head_dim=16, intermediate_size=96)
    rows, block, ctx = 3, 16, 20
    qkv_n = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    sizes = {"qkv": (qkv_n, 64), "o": (64, 64), "gate_up": (192, 64), "down": (64, 96)}

    def projection(seed: int, name: str, kind: str) -> Projection:
        n, k = sizes[name]
        bias = pattern(seed + 2, n) if name == "qkv" else None
        if kind == "q8-row":
            return cpu_gemm.PackedQ8(int8s(seed, n, k), pattern(seed + 1, n, scale=0.01).abs(), bias).projection()
        if kind == "q8-groups":
            return cpu_gemm.PackedQ8(int8s(seed, n, k), pattern(seed + 1, n, k // 32, scale=0.01).abs(), bias).projection()
        return cpu_gemm.PackedFloat(pattern(seed, n, k, scale=0.1).to(dtype), bias).projection()

    kinds = ({"qkv": "q8-row", "o": "float", "gate_up": "q8-groups", "down": "q8-row"}, dict.fromkeys(sizes, "float"))
    if dtype == torch.bfloat16:
        kinds = (dict.fromkeys(sizes, "float"),) * 2
    layers = [
        DecoderLayer(
            pattern(100 * i + 1, 64).to(dtype).float(), pattern(100 * i + 2, 64).to(dtype).float(),
            pattern(100 * i + 3, 16).to(dtype).float(), pattern(100 * i + 4, 16).to(dtype).float(),
            *(projection(100 * i + 10 * j + 10, name, kinds[i][name]) for j, name in enumerate(sizes)),
        )
        for i in range(2)
    ]  # fmt: skip
    stack = cpu_gemm.library().decode_stack(shape, layers, act_bf16=dtype == torch.bfloat16)
    keys = [pattern(50 + i, 10 * block, 2, 16).to(kv_dtype) for i in range(2)]
    values = [pattern(60 + i, 10 * block, 2, 16).to(kv_dtype) for i in range(2)]
    stack.set_arena(keys, values)
    blocks = torch.tensor([[3, 1], [0, 5], [4, 2]])
    slots = blocks[:, (ctx - 1) // block] * block + (ctx - 1) % block
    window = torch.ones(rows, ctx, dtype=torch.uint8)
    window[:, :6] = 0
    hidden = pattern(70, rows, 64).to(dtype).float()
    stack.run(
        hidden, pattern(71, rows, 16), pattern(72, rows, 16), slots, blocks, block, ctx, [None, window], 1e-6, 0.25,
        torch.empty(rows * shape.work_floats(ctx)), torch.empty(rows * shape.widest, dtype=torch.int8),
        torch.empty(rows * shape.widest // 32), torch.tensor([8, 9]) if shared else None, 2 * block if shared else 0,
    )  # fmt: skip
    return digest(hidden, *keys, *values)


def kernel_digests() -> dict[str, str]:
    """Every kernel of this process's build run on fixed inputs: a digest of each one's output bits."""
    out = {}
    x, weight, bias = pattern(1, 7, 96), pattern(2, 70, 96, scale=0.1), pattern(3, 70)
    out["f32_gemm"] = digest(cpu_gemm.PackedFloat(weight, bias)(x))
    packed = cpu_gemm.PackedFloat(weight.bfloat16(), bias)
    out["bf16_gemm"] = digest(packed(x.bfloat16().float()), packed(x))
    if cpu_gemm.bf16_dot():
        out["bf16_gemm_bf16_rows"] = digest(packed(x.bfloat16()))
    q, row_scales, group_scales = int8s(4, 99, 96), pattern(5, 99, scale=0.01).abs(), pattern(6, 99, 3, scale=0.01).abs()
    xq = pattern(7, 5, 96)
    xq[2, 32:64] = 0
    out["q8_gemm_rows"] = digest(cpu_gemm.PackedQ8(q, row_scales, pattern(8, 99))(xq))
    out["q8_gemm_groups"] = digest(cpu_gemm.PackedQ8(q, group_scales, None)(xq))
    block, ctx = 16, 47
    table = torch.tensor([[7, 2, 9], [0, 11, 3], [5, 1, 4]])
    mask = torch.ones(3, ctx, dtype=torch.bool)
    mask[0, :19], mask[2, 5:] = False, False
    for kv in (torch.float32, torch.bfloat16):
        keys, values = pattern(9, 12 * block, 2, 64).to(kv), pattern(10, 12 * block, 2, 64).to(kv)
        name = "f32" if kv == torch.float32 else "bf16"
        q = pattern(11, 3, 6, 64)
        found, lse = cpu_gemm.decode_attention(q, keys, values, table, block, ctx, mask, 0.125, with_lse=True)
        out[f"decode_attention_{name}"] = digest(found, lse)
        if kv == torch.bfloat16:
            found = cpu_gemm.decode_attention(q.bfloat16(), keys, values, table, block, ctx, None, 0.125)
            out["decode_attention_bf16_queries"] = digest(found)
        q = pattern(12, 2 * 20, 6, 64)
        cache = (keys, values, torch.tensor([[7, 2, 9, 3], [0, 11, 5, 1]]), block, 50)
        causal = cpu_gemm.prefill_attention(q, *cache, None, 0.125)
        if causal is None:
            continue  # the AVX2 build has no prefill kernel
        own = torch.arange(50 - 20, 50)[:, None]
        keep = (torch.arange(50)[None] <= own) & (torch.arange(50)[None] > own - 24)
        masked = cpu_gemm.prefill_attention(q, *cache, torch.stack([keep, keep]), 0.125)
        whole, whole_lse = cpu_gemm.prefill_attention(q, *cache, None, 0.125, False, True)
        out[f"prefill_attention_{name}"] = digest(causal, masked, whole, whole_lse)
        if kv == torch.bfloat16:
            out["prefill_attention_bf16_queries"] = digest(cpu_gemm.prefill_attention(q.bfloat16(), *cache, None, 0.125))
            rounded = cpu_gemm.prefill_attention(q, *cache, None, 0.125, round_queries=True)
            out["prefill_attention_rounded_queries"] = digest(rounded)
    a, b = pattern(13, 5, 4, 32), pattern(14, 5, 4, 32)
    out["merge_attention"] = digest(cpu_gemm.merge_attention(a, pattern(15, 5, 4), b, pattern(16, 5, 4)))
    rows, norm = pattern(17, 3, 5, 40, scale=3), pattern(18, 40)
    bf16 = cpu_gemm.rms_norm(rows.bfloat16(), norm.bfloat16(), 1e-6)
    out["rms_norm"] = digest(cpu_gemm.rms_norm(rows, norm, 1e-6), bf16)
    rows = pattern(19, 7, 100, scale=30)
    rows[1] = 0
    out["unit_rows"] = digest(*cpu_gemm.unit_rows(rows))
    gate_up = pattern(20, 37, 300, scale=8)
    gate_up[0, :4] = torch.tensor([-100.0, -87.5, 60.0, 0.0])
    out["silu_mul"] = digest(cpu_gemm.silu_mul(gate_up), cpu_gemm.silu_mul(gate_up.bfloat16()))
    out["decode_layers_f32"] = fused_decode_digest(torch.float32, torch.float32, shared=False)
    out["decode_layers_f32_bf16_kv"] = fused_decode_digest(torch.float32, torch.bfloat16, shared=False)
    out["decode_layers_bf16"] = fused_decode_digest(torch.bfloat16, torch.bfloat16, shared=False)
    if cpu_gemm.library().has_prefill_attention:
        out["decode_layers_f32_shared"] = fused_decode_digest(torch.float32, torch.float32, shared=True)
        out["decode_layers_bf16_shared"] = fused_decode_digest(torch.bfloat16, torch.bfloat16, shared=True)
    return out


# Each KERNEL_VERSION's output bits for kernel_digests()' inputs, per build (gcc 12, glibc 2.36: CI's machine).
# When a kernel's results change, test_each_build_computes_its_kernel_versions_bits fails: bump KERNEL_VERSION
# in plugins/backends/cpu_gemm_builds.py and add the new version's digests here; never edit an earlier version's.
GOLDEN = {
    1: {
        "avx2": {
            "f32_gemm": "d8c110650bde231a", "bf16_gemm": "bdaf3cdc4cf08314", "q8_gemm_rows": "b7d8d8a66fab4316",
            "q8_gemm_groups": "6da560169a99a879", "decode_attention_f32": "43bb7c6615d5d68a",
            "decode_attention_bf16": "d8c81cb2fd0c85e9", "decode_attention_bf16_queries": "4d366f4c3c243bf4",
            "merge_attention": "330a87de94466bf5", "rms_norm": "3d34c9772a013298", "unit_rows": "ba6f3e427fbec417",
            "silu_mul": "add97eef8bfefc50", "decode_layers_f32": "ead9fdc983a89028",
            "decode_layers_f32_bf16_kv": "c77c75ababf1fbbc", "decode_layers_bf16": "e6873c793febf206",
        },
        "avx512": {
            "f32_gemm": "d8c110650bde231a", "bf16_gemm": "173d5425478dd03e", "bf16_gemm_bf16_rows": "41c7b3aed6f57df3",
            "q8_gemm_rows": "b7d8d8a66fab4316", "q8_gemm_groups": "6da560169a99a879",
            "decode_attention_f32": "4d21b49804be2e9b", "prefill_attention_f32": "599c44f7fbd0791a",
            "decode_attention_bf16": "7ce528343996fdc6", "decode_attention_bf16_queries": "4d366f4c3c243bf4",
            "prefill_attention_bf16": "7aeffb206818bd1c", "prefill_attention_bf16_queries": "7faccb8c3d89cc40",
            "prefill_attention_rounded_queries": "f0fa1dc5f52e096d", "merge_attention": "330a87de94466bf5",
            "rms_norm": "3d34c9772a013298", "unit_rows": "ba6f3e427fbec417", "silu_mul": "add97eef8bfefc50",
            "decode_layers_f32": "37619f58cfa37bdf", "decode_layers_f32_bf16_kv": "39f1ff4c181407bf",
            "decode_layers_bf16": "e6873c793febf206", "decode_layers_f32_shared": "aa20e5e478192060",
            "decode_layers_bf16_shared": "20347bec7095c3d5",
        },
    },
}  # fmt: skip
GOLDEN[2] = GOLDEN[1]  # version 2 added ts_quantize_k (k_quantize.c); every kernel's bits stayed version 1's


def digests_in_build(isa: str, digests: Callable[[], dict[str, str]]) -> dict[str, str]:
    """``digests()`` computed by the ``isa`` build: here if this process runs it, else in a subprocess that loads
    it (``digests`` a module-level function of a tests module). Skips where this CPU cannot run the build."""
    if isa == "avx512" and not cpu_flags().issuperset(CPU_FLAGS["avx512"]):
        pytest.skip("this CPU cannot run the AVX-512 build")
    if isa == cpu_gemm.isa():
        return digests()
    module = "tests." + digests.__module__.rsplit(".", 1)[-1]  # pytest may import the file as a top-level module
    script = f"import json; from {module} import {digests.__name__}; print(json.dumps({digests.__name__}()))"
    env = {**os.environ, cpu_gemm.ISA_VARIABLE: isa}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_each_build_computes_its_kernel_versions_bits(isa):
    """Every kernel of each build on fixed inputs gives the output bits recorded for this KERNEL_VERSION (the
    cache fingerprint's name for them): a change of results without a version bump fails here. The build
    this process does not run is run in a subprocess that loads it."""
    found = digests_in_build(isa, kernel_digests)
    version = cpu_gemm.KERNEL_VERSION
    assert version in GOLDEN, f"no digests recorded for KERNEL_VERSION {version}: add GOLDEN[{version}] = {found}"
    expected = GOLDEN[version][isa]
    changed = sorted(name for name in found.keys() | expected.keys() if found.get(name) != expected.get(name))
    assert not changed, (
        f"the {isa} build's results changed under KERNEL_VERSION {version} ({', '.join(changed)}): bump "
        f"KERNEL_VERSION in plugins/backends/cpu_gemm_builds.py and record GOLDEN[{version + 1}][{isa!r}] = {found}"
    )


def test_kernel_calls_check_their_tensors():
    """A kernel handed a tensor it cannot take (dtype, shape, contiguity, too small a scratch) raises an error
    that names the kernel, the argument, what it takes and what it got, before the C code runs."""
    lib = cpu_gemm.library()
    packed = cpu_gemm.PackedQ8(int8s(1, 8, 64), torch.ones(8), None)
    x, out = pattern(2, 2, 64), torch.empty(2, 8)
    scratch = {"q8_rows": torch.empty(2, 64, dtype=torch.int8), "q8_scales": torch.empty(2, 2)}
    lib.matmul(packed.checked, x, out, **scratch)
    assert torch.equal(out, packed(x))
    with pytest.raises(KernelArgumentError,
                       match=r"q8_gemm: x must be a contiguous cpu float32 tensor \[2, 64\]; got cpu float64"):  # fmt: skip
        lib.matmul(packed.checked, x.double(), out, **scratch)
    strided = torch.empty(8, 2).T
    with pytest.raises(KernelArgumentError, match=r"q8_gemm: out must be a contiguous cpu float32 tensor \[2, 8\]; "
                       r"got cpu float32 \[2, 8\] \(strides \(1, 2\)\)"):  # fmt: skip
        lib.matmul(packed.checked, x, strided, **scratch)
    with pytest.raises(KernelArgumentError, match=r"q8_gemm: q8_rows must be .* int8 tensor \[2, 64\]; got .* \[1, 64\]"):
        lib.matmul(packed.checked, x, out, q8_rows=scratch["q8_rows"][:1], q8_scales=scratch["q8_scales"])
    with pytest.raises(KernelArgumentError, match=r"q8_gemm: packed scale must be .* float32 tensor \[8\]; got .* \[7\]"):
        lib.matmul_weight(Projection(Q8_ROW, packed.weight, packed.scale[:7], None), 8, 64)
    with pytest.raises(KernelArgumentError, match=r"f32_gemm: packed weight must be .* tensor \[2, 48, 32\]; got .*\[2, 64, 32\]"):
        lib.matmul_weight(cpu_gemm.PackedFloat(pattern(3, 40, 64), None).projection(), 40, 48)
    floats = cpu_gemm.PackedFloat(pattern(3, 40, 64), None)
    with pytest.raises(KernelArgumentError, match=r"f32_gemm: x must be .* float32 tensor \[3, 64\]; got .* \[3, 48\]"):
        floats(pattern(4, 3, 48))  # rows of another width than the weight's
    keys = pattern(5, 4 * 16, 2, 16)
    q, blocks = pattern(6, 2, 4, 16), torch.tensor([[0, 1], [2, 3]])
    attention = (torch.empty(2, 4, 16), torch.empty(2 * 4 * 30))
    lib.decode_attention(q, keys, keys, blocks, 16, 30, None, 0.25, *attention)
    with pytest.raises(KernelArgumentError, match=r"decode_attention: blocks must be .* int64 tensor \[2, 2\]; got .* int32"):
        lib.decode_attention(q, keys, keys, blocks.int(), 16, 30, None, 0.25, *attention)
    with pytest.raises(KernelArgumentError, match="decode_attention: 2 blocks of 16 hold fewer than ctx = 40"):
        lib.decode_attention(q, keys, keys, blocks, 16, 40, None, 0.25, torch.empty(2, 4, 16), torch.empty(2 * 4 * 40))
    with pytest.raises(KernelArgumentError, match=r"decode_attention: v_cache must be .* float32 tensor \[64, 2, 16\]; got .* bf"):
        lib.decode_attention(q, keys, keys.bfloat16(), blocks, 16, 30, None, 0.25, *attention)
    with pytest.raises(KernelArgumentError, match=r"decode_attention: scores must be .* tensor of at least 240 elements"):
        lib.decode_attention(q, keys, keys, blocks, 16, 30, None, 0.25, attention[0], attention[1][:100])


def test_a_build_that_disagrees_with_the_binding_is_refused(monkeypatch):
    """The binding checks each loaded object: its struct layouts (names, offsets, sizes, as the C declares
    them) and its kernel version must be this code's, else it is refused with both sides named."""
    lib = cpu_gemm.library()
    fields = Layer._fields_
    swapped = type("Layer", (ctypes.Structure,), {"_fields_": [fields[2], fields[1], fields[0], *fields[3:]]})
    monkeypatch.setitem(cpu_gemm_abi.STRUCTS, "ts_layer", swapped)
    with pytest.raises(KernelLoadError, match=r"ts_layer: cpu_gemm.c declares \[\('input_norm', 0, 8\), \('qkv_"):
        Kernels(lib.path, lib.isa)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_gemm_abi, "KERNEL_VERSION", cpu_gemm.KERNEL_VERSION + 1)
    with pytest.raises(KernelLoadError, match=f"holds kernel version {cpu_gemm.KERNEL_VERSION}, this tierserve binds "
                       f"version {cpu_gemm.KERNEL_VERSION + 1}: rebuild the kernels"):  # fmt: skip
        Kernels(lib.path, lib.isa)


@pytest.mark.slow
def test_the_avx2_build_passes_these_tests_too(tmp_path):
    """On an AVX-512 machine (CI's) this file runs again in a process that loads the AVX2 build, so both
    builds are tested wherever the AVX-512 one is."""
    if cpu_gemm.isa() != "avx512":
        pytest.skip("this process runs the AVX2 build already")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-p", "no:xdist", "-p", "no:cacheprovider", "--noconftest",
         "-o", "addopts=", "-q", "-x", "-k", "not avx2_build_passes and not kernel_versions_bits",
         f"--basetemp={tmp_path}"],
        cwd=REPO_ROOT, env={**os.environ, cpu_gemm.ISA_VARIABLE: "avx2"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
