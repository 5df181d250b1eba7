"""int8-g32 (Q8_0 group-wise) against the per-row int8 kernels and float32: one bench-model layer's four matmuls.

    python -m bench.int8_group_speed      (prints microseconds per layer at batch 1, 16 and 128)
"""

from __future__ import annotations

import time

import torch

from tierserve.plugins.backends.linear import Int8Linear, Linear, quantize_groups, int8_kernels

torch.manual_seed(0)
shapes = [(1280, 768), (768, 768), (6144, 768), (768, 3072)]  # qkv, o, gate_up, down
def timeit(fn, n=40):
    for _ in range(3): fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6
kernels = [k for k in int8_kernels(torch.device("cpu")) if k != "dequantize"]
for T in (1, 16, 128):
    tot = {}
    for N, K in shapes:
        w = torch.randn(N, K) * 0.02
        x = torch.randn(T, K)
        layers = {"float32-onednn": Linear(w, None, True)}
        layers |= {f"int8-{k} (per row)": Int8Linear(w, None, k, torch.float32) for k in kernels}
        layers["int8-g32"] = Int8Linear(quantize_groups(w), None, "grouped", torch.float32)
        for name, layer in layers.items():
            tot[name] = tot.get(name, 0) + timeit(lambda: layer(x))
    print(f"batch {T:3d}: " + ", ".join(f"{k} {v:.0f} us" for k, v in tot.items()))
