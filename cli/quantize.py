"""``tierserve quantize``: a GGUF file written again in another block type (``plugins.backends.gguf_quantize``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_quantize(args: argparse.Namespace) -> int:
    from tierserve.plugins.backends.gguf_quantize import quantize_gguf

    summary = quantize_gguf(Path(args.source), Path(args.target), args.type, args.allow_requantize)
    print(f"{args.target}: {summary.quantized} tensors in {args.type.upper()}, {summary.kept} kept as they were; "
          f"{summary.source_bytes / 2**20:.1f} MiB -> {summary.target_bytes / 2**20:.1f} MiB")  # fmt: skip
    return 0


def add_quantize_command(commands: argparse._SubParsersAction) -> None:
    from tierserve.plugins.backends.gguf_quantize import TARGETS

    quantize = commands.add_parser(
        "quantize", help="write a GGUF file again in another llama.cpp file type, Q4_K_M included (llama.cpp's "
        "reference quantizers; llama-server and tierserve load the result)",
    )
    quantize.add_argument("source", help="a GGUF file (F32, F16, BF16 or Q8_0 weights)")
    quantize.add_argument("target", help="the .gguf file to write (must not exist)")
    quantize.add_argument("--type", required=True, choices=sorted(TARGETS), help="the llama.cpp file type to write (the block type of each matrix as llama-quantize picks it)")
    quantize.add_argument("--allow-requantize", action="store_true",
                          help="also quantize weights that are quantized already (loses more)")  # fmt: skip
    quantize.set_defaults(handler=cmd_quantize)
