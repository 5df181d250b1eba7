"""Shared test helpers: the test tiers and the one rule for a missing service, temporary installed plugin
distributions, and the root logger put back after a test.

Every test module names its tier (a marker registered in pyproject.toml): ``pytest`` alone runs the fast
tiers, ``.ci/run`` all of them. A module without one fails collection, so no test slips in unclassified.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Generator
from pathlib import Path
from typing import NoReturn

import logging

import pytest
import structlog
from hypothesis import settings

# CI runs the property tests with a fixed seed so a green run stays green;
# local runs explore fresh examples each time (and found real bugs that way).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO_ROOT = Path(__file__).resolve().parent.parent

# pytest-xdist runs one worker per core: each computes on one thread (engine child processes and
# servers inherit it), so the workers share the cores instead of fighting over them
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


# what a test needs to run (pyproject.toml registers and describes them); each test has one. ``slow``, the
# other marker registered there, says how long it runs and comes on top of its tier
TIERS = frozenset({"unit", "integration", "redis", "fleet", "browser", "real_model"})


def require_service(name: str, reason: str) -> NoReturn:
    """Stop the calling test (or test module) because ``name`` (an OS package, a module, a model file) is missing.

    Locally the test is skipped with ``reason``, which should say how to get ``name``; under ``CI`` (any
    non-empty value) it fails with that reason instead, so a CI run can never pass without running it.
    """
    message = f"no {name} here: {reason}"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)


def real_model_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF the ``real_model`` tests load: ``$TIERSERVE_REAL_MODEL`` when set, else
    the catalogue's ``smollm2`` where ``tierserve pull smollm2`` put it (the README's test command pulls it).

    A missing file is a missing service: skipped here, failed under CI.
    """
    named = os.environ.get("TIERSERVE_REAL_MODEL", "")
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            require_service("SmolLM2-135M-Instruct GGUF", f"TIERSERVE_REAL_MODEL={named} is not a file")
        return path
    from tierserve.models.catalogue import cached_path, catalogue_entry

    pulled = cached_path(catalogue_entry("smollm2"))
    if not pulled.is_file():
        require_service(
            "SmolLM2-135M-Instruct GGUF",
            f"TIERSERVE_REAL_MODEL is not set and {pulled} is not there: run `tierserve pull smollm2`",
        )
    return pulled


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A test module without a tier in its ``pytestmark`` fails collection (so every run fails, whatever its
    ``-m``), saying what to add."""
    report = yield
    if isinstance(collector, pytest.Module) and report.passed:
        if not TIERS & {mark.name for mark in collector.iter_markers()}:
            report.outcome = "failed"
            report.longrepr = (
                f"{collector.nodeid} has no tier: add `pytestmark = pytest.mark.<tier>` below its imports, "
                f"<tier> one of {', '.join(sorted(TIERS))} (pyproject.toml's markers say which)"
            )
    return report


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``real_model`` test needs the model file: without it, the missing-service rule applies."""
    if item.get_closest_marker("real_model"):
        real_model_file()


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The path of the SmolLM2-135M-Instruct GGUF (see ``real_model_file``)."""
    return real_model_file()


@pytest.fixture
def restore_logging():
    """Undo a test's ``configure_logging``: the root logger's handlers and level, structlog's defaults."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers, root.level = handlers, level
    structlog.reset_defaults()


@pytest.fixture
def toml_file(tmp_path):
    """``toml_file(text, name="config.toml")`` writes dedented TOML into the test's folder and returns its path."""

    def write(text: str, name: str = "config.toml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def install_fake_plugin(tmp_path, monkeypatch):
    """Write a real installed distribution (dist-info + module) onto sys.path.

    ``install_fake_plugin(dist, module, source, entry_point=None)`` returns the
    site folder; importlib.metadata finds its ``tierserve`` entry point exactly
    as it finds one that pip installed.
    """
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    installed: list[str] = []

    def install(dist: str, module: str, source: str, entry_point: str | None = None) -> Path:
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
        (info / "entry_points.txt").write_text(f"[tierserve]\n{entry_point or module} = {module}\n")
        installed.append(module)
        return site

    yield install
    for module in installed:
        sys.modules.pop(module, None)
