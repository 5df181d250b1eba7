"""Compiles tierserve's CPU kernels (``plugins/backends/cpu_gemm.c``, ``k_quantize.c``) when the package is built.

Everything else about the package is in ``pyproject.toml``. Each build in
``cpu_gemm_builds.ISAS`` becomes its own shared object in
``tierserve/plugins/backends/`` (in place beside the source for ``pip install
-e .``), loaded by ``cpu_gemm.py`` with ctypes: the objects use no Python API.
A build that fails (no C compiler, a compiler without AVX-512 BF16, another
CPU architecture) leaves the install without it, with a warning here; at run
time the AVX2 build or torch's kernels run instead, and ``cpu_gemm`` logs why.
"""

from __future__ import annotations

import os
import platform
import runpy

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BACKENDS = "plugins/backends"  # relative: setuptools takes the extensions' sources from the project root
builds = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), BACKENDS, "cpu_gemm_builds.py"))


class BuildKernels(build_ext):
    """``build_ext`` for plain shared objects: no Python ABI tag in the name, no libpython linked, and each
    build compiled in its own temporary folder (they share one source file, so their objects share a name)."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def get_libraries(self, ext: Extension) -> list[str]:
        return ext.libraries

    def build_extension(self, ext: Extension) -> None:
        shared_temp = self.build_temp
        self.build_temp = os.path.join(shared_temp, ext.name.rsplit(".", 1)[-1])
        try:  # optional: a failed build is warned about by build_ext, and the install goes on without it
            super().build_extension(ext)
        finally:
            self.build_temp = shared_temp


def kernels() -> list[Extension]:
    """One extension per build; none off x86-64, where the kernels cannot run."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return [
        Extension(
            "tierserve.plugins.backends." + builds["object_name"](isa).removesuffix(".so"),
            sources=[f"{BACKENDS}/{source}" for source in builds["SOURCES"]],
            depends=[f"{BACKENDS}/cpu_gemm_builds.py"],  # KERNEL_VERSION and the flags: rebuilt when they change
            # -g0: Python's own CFLAGS add -g, five times the object's size in symbols
            extra_compile_args=[*builds["compile_flags"](isa), "-g0"],
            extra_link_args=list(builds["LINK_FLAGS"]),
            optional=True,
        )
        for isa in builds["ISAS"]
    ]


setup(ext_modules=kernels(), cmdclass={"build_ext": BuildKernels})
