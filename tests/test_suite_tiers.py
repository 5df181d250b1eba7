"""The test suite's own rules: every module names its tier, ``pytest`` alone runs the fast tiers, CI runs the
README's command with every tier, and a missing service skips a local run but fails under CI.

The rules are run on small test files of their own, in a fresh folder, with this suite's conftest.py and
pytest settings, in a pytest process of their own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, TIERS

pytestmark = pytest.mark.integration

PYTEST_SETTINGS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def readme_test_command() -> str:
    """The README's command that runs the tests (the one line that sets up the venv and runs pytest)."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    [command] = [line for line in lines if line.startswith("python3.11 -m venv .venv") and "pytest" in line]
    return command


def every_tier() -> str:
    """The ``-m`` expression of the README's test command."""
    return re.search(r'-m "([^"]+)"', readme_test_command()).group(1)


def run_suite(folder: Path, files: dict[str, str], *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``pytest -n 0 -rA *args`` on ``files`` (name: source) beside a copy of tests/conftest.py, with
    pyproject.toml's pytest settings; the environment is this one's less CI and pytest's own, plus ``env``.

    Of the installed pytest plugins only xdist is loaded (``addopts`` names its options): loading them all
    takes seconds.
    """
    tests = folder / "tests"
    tests.mkdir(parents=True)
    shutil.copy(REPO_ROOT / "tests" / "conftest.py", tests / "conftest.py")
    for name, source in files.items():
        (tests / name).write_text(textwrap.dedent(source))
    markers = "".join(f"\n    {line}" for line in PYTEST_SETTINGS["markers"])
    (folder / "pytest.ini").write_text(f"[pytest]\ntestpaths = tests\naddopts = {PYTEST_SETTINGS['addopts']}\nmarkers ={markers}\n")
    clean = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith(("PYTEST_", "TIERSERVE_REAL"))}
    clean["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    command = [sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-n", "0", "-rA", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=folder, env={**clean, **env}, capture_output=True, text=True, timeout=120)


ONE_TEST_PER_TIER = {
    f"test_{tier}.py": f"""
        import pytest

        pytestmark = pytest.mark.{tier}

        def test_{tier}():
            pass

        @pytest.mark.slow
        def test_{tier}_slow():
            pass
        """
    for tier in TIERS
}
A_MISSING_SERVICE = {
    "test_service.py": """
        import pytest

        from tests.conftest import require_service

        pytestmark = pytest.mark.integration

        def test_needs_a_service():
            require_service("frobnicator", "apt-get install frobnicator")
        """
}
A_REAL_MODEL_TEST = {
    "test_model.py": """
        import pytest

        pytestmark = pytest.mark.real_model

        def test_loads_the_model(real_model):
            assert real_model.read_bytes() == b"GGUF"
        """
}


def ran(result: subprocess.CompletedProcess[str], outcome: str) -> set[str]:
    """The tests ``-rA`` reports with ``outcome`` (PASSED, FAILED, ERROR), by function name."""
    return set(re.findall(rf"^{outcome} \S+::(\w+)", result.stdout, re.M))


def test_ci_runs_the_readme_command_and_it_names_every_tier():
    assert readme_test_command() in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert set(every_tier().split(" or ")) == TIERS
    assert {line.split(":")[0] for line in PYTEST_SETTINGS["markers"]} == TIERS | {"slow"}


def test_pytest_alone_runs_the_fast_unit_and_integration_tests_and_the_readme_command_all(tmp_path):
    model = tmp_path / "smollm2.gguf"
    model.write_bytes(b"GGUF")
    default = run_suite(tmp_path / "default", ONE_TEST_PER_TIER, TIERSERVE_REAL_MODEL=str(model))
    assert default.returncode == 0, default.stdout
    assert ran(default, "PASSED") == {"test_unit", "test_integration"}
    everything = run_suite(tmp_path / "all", ONE_TEST_PER_TIER, "-m", every_tier(), TIERSERVE_REAL_MODEL=str(model))
    assert everything.returncode == 0, everything.stdout
    assert ran(everything, "PASSED") == {f"test_{tier}{slow}" for tier in TIERS for slow in ("", "_slow")}


def test_a_module_without_a_tier_fails_collection_though_no_tier_would_select_it(tmp_path):
    untiered = {"test_untiered.py": "def test_anything():\n    pass\n"}
    result = run_suite(tmp_path, {**ONE_TEST_PER_TIER, **untiered})
    assert result.returncode != 0
    assert "tests/test_untiered.py has no tier: add `pytestmark = pytest.mark.<tier>`" in result.stdout


def test_a_missing_service_skips_here_with_the_reason_and_fails_under_ci(tmp_path):
    files = {**A_MISSING_SERVICE, **A_REAL_MODEL_TEST}
    nothing_pulled = str(tmp_path / "empty-cache")
    here = run_suite(tmp_path / "here", files, "-m", every_tier(), TIERSERVE_CACHE_DIR=nothing_pulled)
    assert here.returncode == 0, here.stdout
    assert "no frobnicator here: apt-get install frobnicator" in here.stdout
    assert "no SmolLM2-135M-Instruct GGUF here: TIERSERVE_REAL_MODEL is not set" in here.stdout
    assert "run `tierserve pull smollm2`" in here.stdout
    under_ci = run_suite(tmp_path / "ci", files, "-m", every_tier(), CI="true", TIERSERVE_CACHE_DIR=nothing_pulled)
    assert under_ci.returncode == 1
    assert ran(under_ci, "FAILED") == {"test_needs_a_service"} and ran(under_ci, "ERROR") == {"test_loads_the_model"}
    assert "no frobnicator here: apt-get install frobnicator" in under_ci.stdout


def test_a_real_model_test_gets_the_file_the_environment_names(tmp_path):
    model = tmp_path / "smollm2.gguf"
    model.write_bytes(b"GGUF")
    result = run_suite(tmp_path / "suite", A_REAL_MODEL_TEST, "-m", "real_model", CI="true", TIERSERVE_REAL_MODEL=str(model))
    assert result.returncode == 0, result.stdout
    assert ran(result, "PASSED") == {"test_loads_the_model"}
