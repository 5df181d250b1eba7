"""The builds of ``cpu_gemm.c``: one shared object per instruction set, compiled when the package is built.

``setup.py`` compiles each build listed here into the package (``pip install``,
``pip install -e .``, ``pip wheel``); ``cpu_gemm.py`` loads the one this CPU
runs. This file is read by ``setup.py`` before tierserve is installed, so it
imports nothing but the standard library.

    cpu_gemm.c, k_quantize.c --(setup.py, gcc: COMMON_FLAGS + ISAS[isa])--> _cpu_gemm_avx2.so
                                                                           _cpu_gemm_avx512.so
                             cpu_gemm.py: /proc/cpuinfo flags --> one of them, by ctypes
"""

from __future__ import annotations

import platform
from pathlib import Path

# Bump when any kernel's results change, in either build: the cache fingerprint names it, so KV computed by
# earlier kernels is never served as this version's. tests/test_cpu_gemm.py keeps each version's output bits.
KERNEL_VERSION = 2

SOURCES = ("cpu_gemm.c", "k_quantize.c")  # one shared object: the kernels, and llama.cpp's K-type quantizers
# -ffp-contract=off: every product and sum rounded as written, so the elementwise code matches torch's to the bit;
# -mf16c: Q4 blocks keep their float16 scales (every AVX2 CPU has F16C)
COMMON_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off")
LINK_FLAGS = ("-fopenmp",)
ISAS = {"avx2": (), "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16")}
# what /proc/cpuinfo must list for each build to run (torch's own AVX2 check comes first)
CPU_FLAGS = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")}


def compile_flags(isa: str) -> list[str]:
    """The compiler flags of ``isa``'s build (the version compiled in: the loader checks it)."""
    return [*COMMON_FLAGS, *ISAS[isa], f"-DTS_KERNEL_VERSION={KERNEL_VERSION}"]


def object_name(isa: str) -> str:
    """The file name of ``isa``'s shared object, beside ``cpu_gemm.py``."""
    return f"_cpu_gemm_{isa}.so"


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``); empty where that file is missing."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return set(next(line for line in lines if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


def built_here() -> bool:
    """Whether a build this CPU can run sits beside this module: what ``cpu_gemm.library()`` would load,
    told without loading it (or torch), for the HTTP process's memory estimate."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = cpu_flags()
    return any(
        (Path(__file__).parent / object_name(isa)).is_file() and set(CPU_FLAGS[isa]) <= flags for isa in ISAS
    )
