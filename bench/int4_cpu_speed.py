"""torch's group-wise int4 CPU kernel against tierserve's q8 kernel: the bench model's 48 layer matmuls.

    python -m bench.int4_cpu_speed [--passes 30]

The question it answers: is there a fast int4 kernel in torch on this CPU
(issue 15's optional int4)? Each pass runs the 12 layers' qkv, o, gate_up
and down projections once, so the weights (52 MB at int4, 104 MB at int8)
stream from memory as in a decode step; the int4 pass
(``torch.ops.aten._weight_int4pack_mm_for_cpu``, groups of 32, asymmetric,
bfloat16 activations, as torchao's int4 weight-only layout calls it) and the
q8 pass (``Int8Linear`` with ``kernel = "q8"``, float32 activations) alternate.
A last case is one 6144x768 matrix called again and again (it stays in
cache). Prints median milliseconds. Not part of the tests: the README's
int4 figures came from it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tierserve.plugins.backends.linear import Int8Linear

SHAPES = [(1280, 768), (768, 768), (6144, 768), (768, 3072)]  # the bench model's qkv, o, gate_up, down
LAYERS = 12
GROUP = 32


def int4_layer(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x @ W.T`` through torch's int4 kernel, W quantized to 16 levels per group of 32 (min to max)."""
    rows, columns = weight.shape
    groups = weight.view(rows, columns // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)
    zero = low + scale * 8  # the op computes (q - 8) * scale + zero
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(rows, columns)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    int4, q8 = [], []
    for _ in range(LAYERS):
        for rows, columns in SHAPES:
            weight = torch.randn(rows, columns) * 0.02
            int4.append((int4_layer(weight), columns))
            q8.append((Int8Linear(weight, None, "q8", torch.float32), columns))
    print(f"{'case':<44} {'int4 ms':>9} {'q8 ms':>9}")
    for batch in (1, 4):
        inputs = {columns: torch.randn(batch, columns, dtype=torch.bfloat16) for _, columns in SHAPES}
        wide = {columns: x.float() for columns, x in inputs.items()}

        def int4_pass() -> None:
            for layer, columns in int4:
                layer(inputs[columns])

        def q8_pass() -> None:
            for layer, columns in q8:
                layer(wide[columns])

        for _ in range(3):
            int4_pass(), q8_pass()
        times = ([], [])
        for _ in range(args.passes):
            times[0].append(timed(int4_pass))
            times[1].append(timed(q8_pass))
        print(f"{f'48 matmuls, {batch} row(s), streamed':<44} "
              f"{statistics.median(times[0]) * 1e3:>9.2f} {statistics.median(times[1]) * 1e3:>9.2f}")  # fmt: skip
    weight = torch.randn(6144, 768) * 0.02
    one4, one8 = int4_layer(weight), Int8Linear(weight, None, "q8", torch.float32)
    x = torch.randn(1, 768, dtype=torch.bfloat16)
    times = ([], [])
    for _ in range(10 * args.passes):
        times[0].append(timed(lambda: one4(x)))
        times[1].append(timed(lambda: one8(x.float())))
    print(f"{'one 6144x768 matrix, 1 row, in cache':<44} "
          f"{statistics.median(times[0]) * 1e3:>9.3f} {statistics.median(times[1]) * 1e3:>9.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
