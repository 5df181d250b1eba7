"""A normal (non-editable) install carries every sub-package, the presets, the console script and the CPU
kernels' builds (compiled by the wheel's build, loaded from it with nothing compiled at run time)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_wheel_contains_packages_presets_and_entry_point(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path), str(REPO_ROOT)],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    [wheel] = tmp_path.glob("tierserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "tierserve/core/hookspecs.py",
        "tierserve/core/plugins.py",
        "tierserve/engine/core.py",
        "tierserve/settings/config.py",
        "tierserve/models/gguf.py",
        "tierserve/cache/eviction.py",
        "tierserve/plugins/eviction/adaptive.py",
        "tierserve/configs/production.toml",
        "tierserve/configs/development.toml",
        "tierserve/server/dashboard/index.html",  # /dashboard serves these from the installed package
        "tierserve/server/dashboard/dashboard.js",
        "tierserve/server/dashboard/dashboard.css",
        "tierserve/server/dashboard/common.js",
        "tierserve/server/dashboard/fleet.html",  # the fleet's ingress serves its own page
        "tierserve/server/dashboard/fleet.js",
    ):
        assert required in names, required
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    kernels = {"tierserve/plugins/backends/_cpu_gemm_avx2.so", "tierserve/plugins/backends/_cpu_gemm_avx512.so"}
    assert kernels <= names if x86 else not kernels & names  # one object per instruction set, built by the wheel
    assert "tierserve/plugins/backends/cpu_gemm.c" not in names  # nothing to compile at run time
    packages = {  # every package folder of the checkout, as the wheel must name it
        "tierserve/" + str(init.parent.relative_to(REPO_ROOT))
        for folder in ("core", "cache", "models", "settings", "engine", "plugins", "server", "configs", "fleet", "cli")
        for init in (REPO_ROOT / folder).rglob("__init__.py")
    }
    assert {p + "/__init__.py" for p in packages} <= names, sorted({p + "/__init__.py" for p in packages} - names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tierserve = tierserve.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    env = {k: v for k, v in env.items() if not k.startswith("TIERSERVE_")}
    result = subprocess.run(
        [sys.executable, "-c",
         "import tierserve.core, tierserve.plugins.eviction.lru as m; print(m.__file__);"
         "from tierserve.settings.config import load_settings;"
         "print(load_settings('production').settings.kv_cache.eviction_policy);"
         "from tierserve.server.dashboard_routes import asset; assert b'dashboard.js' in asset('index.html');"
         "from tierserve.plugins.backends import cpu_gemm; lib = cpu_gemm.library(); print(lib and lib.path)"],
        capture_output=True, text=True, env={**env, "CC": "false", "TIERSERVE_CACHE_DIR": str(tmp_path / "cache")},
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    module_file, policy, kernels_file = result.stdout.split()
    assert module_file.startswith(str(site))
    assert policy == "adaptive"
    if x86 and kernels_file == "None":  # a CPU without AVX2 and FMA: torch's kernels, said so
        assert "cpu_gemm_unavailable" in result.stderr and "AVX2" in result.stderr
    else:
        assert kernels_file.startswith(str(site)) == x86
    assert not (tmp_path / "cache").exists()  # nothing compiled into the cache at first use
