"""tierserve's panel kernels against oneDNN's prepacked GEMM on the bench model's layer shapes, in one process.

    python -m bench.panels_vs_onednn float32 1,4,32,256
    python -m bench.panels_vs_onednn bfloat16 1,32,512 --repeats 10

For each row count the bench model's 48 layer matmuls (12 layers of qkv, o,
gate_up, down) run through ``cpu_gemm.PackedFloat`` (``f32-panels`` or
``bf16-panels``, the AVX-512 build) and through oneDNN's
``_linear_pointwise`` on weights prepacked by ``_reorder_linear_weight``,
alternating pass by pass so both share the machine's moods; the two outputs
must agree to float32 (bfloat16: bfloat16) rounding. Prints the median time
of a pass and its GFLOP/s. Not part of the tests: the README's kernel figures
came from it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tierserve.plugins.backends import cpu_gemm
from tierserve.plugins.backends.cpu_gemm import PackedFloat

SHAPES = [(1280, 768), (768, 768), (6144, 768), (768, 3072)]  # the bench model's qkv, o, gate_up, down
LAYERS = 12
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtype", choices=sorted(DTYPES))
    parser.add_argument("rows", help="comma-separated activation row counts, e.g. 1,32,256")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not cpu_gemm.float_panels():
        raise SystemExit("the panel kernels run on cpu_gemm's AVX-512 build only (AVX-512 F/BW/VL/VNNI/BF16)")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).mul_(0.02).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)]
    panels = [[PackedFloat(w, None) for w in layer] for layer in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in layer] for layer in weights]
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k).to(dtype) for _, k in SHAPES}
        flops = 2 * m * sum(n * k for n, k in SHAPES) * LAYERS

        def run_panels() -> list[torch.Tensor]:
            return [p(inputs[p.in_features]).to(dtype) for layer in panels for p in layer]

        def run_onednn() -> list[torch.Tensor]:
            return [
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], packed, None, "none", [], "")
                for layer, packed_layer in zip(weights, onednn) for w, packed in zip(layer, packed_layer)
            ]  # fmt: skip

        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
        for ours, theirs in zip(run_panels(), run_onednn()):
            assert torch.allclose(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance), "outputs disagree"
        times: dict[str, list[float]] = {"panels": [], "onednn": []}
        for _ in range(args.repeats):
            for name, run in (("panels", run_panels), ("onednn", run_onednn)):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(
            f"{args.dtype} {m:>5} rows: panels {medians['panels'] * 1e3:8.2f} ms ({flops / medians['panels'] / 1e9:4.0f}"
            f" GFLOP/s), oneDNN {medians['onednn'] * 1e3:8.2f} ms ({flops / medians['onednn'] / 1e9:4.0f} GFLOP/s),"
            f" oneDNN / panels {medians['onednn'] / medians['panels']:.2f}x"
        )


if __name__ == "__main__":
    main()
