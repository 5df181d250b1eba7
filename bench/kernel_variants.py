"""Builds of tierserve's C kernels with other prefetch distances, timed against each other in one process.

    python -m bench.kernel_variants bf16 8,16,32,64     (bf16-panels: BF16_PREFETCH, 128-byte panel rows ahead)
    python -m bench.kernel_variants q8 8,16,32 --rows 2  (q8, per-row scales: Q8_PREFETCH, blocks of 128 bytes)

Each distance is its own build of ``cpu_gemm.c`` (this machine's build's flags
plus ``-D<MACRO>=<distance>``, compiled here with ``$CC`` or ``cc``), loaded
side by side through ``cpu_gemm_abi.Kernels``; the bench model's 48 layer
matmuls (12 layers of qkv, o, gate_up, down) run through each build in turn,
repeat after repeat, so the builds share the machine's moods. Every build's
output must equal the first's to the bit (a prefetch moves no arithmetic).
Prints the median and best time per pass and the weight bytes streamed per
second. Not part of the tests: the defaults in ``cpu_gemm.c`` came from it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tierserve.plugins.backends import cpu_gemm
from tierserve.plugins.backends.cpu_gemm import PackedFloat, PackedQ8
from tierserve.plugins.backends.cpu_gemm_abi import Kernels
from tierserve.plugins.backends.cpu_gemm_builds import LINK_FLAGS, compile_flags

SHAPES = [(1280, 768), (768, 768), (6144, 768), (768, 3072)]  # the bench model's qkv, o, gate_up, down
LAYERS = 12
MACROS = {"bf16": "BF16_PREFETCH", "q8": "Q8_PREFETCH"}


def build(macro: str, distance: int, folder: Path) -> Kernels:
    """``cpu_gemm.c`` compiled with this machine's build's flags and ``-D<macro>=<distance>``, bound as
    ``cpu_gemm`` binds the installed build."""
    isa = cpu_gemm.isa()
    target = folder / f"cpu_gemm-{macro}-{distance}.so"
    compiler = shlex.split(os.environ.get("CC", "")) or ["cc"]
    flags = [*compile_flags(isa), *LINK_FLAGS, "-shared", "-fPIC", f"-D{macro}={distance}"]
    subprocess.run([*compiler, *flags, str(Path(cpu_gemm.__file__).with_name("cpu_gemm.c")), "-o", str(target)], check=True)
    return Kernels(target, isa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=sorted(MACROS))
    parser.add_argument("distances", help="comma-separated prefetch distances, e.g. 8,16,32")
    parser.add_argument("--rows", type=int, default=1, help="activation rows per call (decode: 1-4)")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    if cpu_gemm.library() is None:
        raise SystemExit(f"tierserve's C kernels do not run here: {cpu_gemm.unavailable_reason()}")
    distances = [int(d) for d in args.distances.split(",")]
    torch.manual_seed(0)
    if args.kernel == "bf16":
        layers = [[PackedFloat(torch.randn(n, k).mul_(0.02).bfloat16(), None) for n, k in SHAPES] for _ in range(LAYERS)]
    else:
        layers = [
            [PackedQ8(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 100, None) for n, k in SHAPES]
            for _ in range(LAYERS)
        ]
    rows = args.rows
    inputs = {k: torch.randn(rows, k) for _, k in SHAPES}
    outputs = {n: torch.empty(rows, n) for n, _ in SHAPES}
    widest = max(k for _, k in SHAPES)
    quantized = {k: torch.empty(rows, k, dtype=torch.int8) for _, k in SHAPES}
    block_scales = {k: torch.empty(rows, k // cpu_gemm.QK) for _, k in SHAPES}
    scratch = torch.empty(rows * widest, dtype=torch.int16)  # ts_bf16_gemm's rounded rows (AVX-512 build)

    def one_pass(lib: Kernels, weights: list) -> None:
        for layer in weights:
            for (n, k), weight in zip(SHAPES, layer):
                if args.kernel == "bf16":
                    lib.matmul(weight, inputs[k], outputs[n], bf16_rows=scratch)
                else:
                    lib.matmul(weight, inputs[k], outputs[n], q8_rows=quantized[k], q8_scales=block_scales[k])

    with tempfile.TemporaryDirectory(prefix="tierserve-kernel-variants-") as folder:
        builds = {d: build(MACROS[args.kernel], d, Path(folder)) for d in distances}
        checked = {  # each build's view of the same packed weights
            d: [[lib.matmul_weight(p.projection(), n, k) for (n, k), p in zip(SHAPES, layer)] for layer in layers]
            for d, lib in builds.items()
        }
        times: dict[int, list[float]] = {d: [] for d in distances}
        reference = None
        for _ in range(args.repeats):
            for distance, lib in builds.items():
                start = time.perf_counter()
                one_pass(lib, checked[distance])
                times[distance].append(time.perf_counter() - start)
                result = torch.cat([outputs[n] for n, _ in SHAPES], 1)
                if reference is None:
                    reference = result.clone()
                elif not torch.equal(result, reference):
                    raise SystemExit(f"{MACROS[args.kernel]}={distance} computed other values than the first build")
    streamed = sum(p.weight.numel() * p.weight.element_size() for layer in layers for p in layer)
    print(f"{args.kernel}, {rows} row(s), {streamed / 1e6:.1f} MB of weights a pass, {args.repeats} alternating repeats")
    for distance in distances:
        median = statistics.median(times[distance])
        print(f"  {MACROS[args.kernel]}={distance:<4d} median {median * 1e3:.2f} ms, best {min(times[distance]) * 1e3:.2f} ms, "
              f"{streamed / median / 1e9:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
